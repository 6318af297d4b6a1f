"""The batched, multi-head entry of every rule, in flash-linear-attention's layout.

``batched`` checks the shapes once against the rule's gates, then runs the form ``impl``
chooses (``dispatch.run_batched``): a one-head form mapped over value heads and batch with
``jax.vmap`` (anything it computes, a user gets equally by vmapping a rule's single-head
forms themselves), or one of the rule's kernels over the whole batch.
"""

from __future__ import annotations

import functools
from typing import no_type_check

import jax
import jax.numpy as jnp

from gdn_jax.ops import checks, dispatch
from gdn_jax.ops.forward_mode import reverse_mode_only
from gdn_jax.ops.normalize import l2_normalize
from gdn_jax.ops.rule import Rule
from gdn_jax.ops.single_head import compute_dtype, scaled_outputs


def prepare_batched(q, k, v, gates: tuple, initial_state, *, use_qk_l2norm, cu_seqlens):
    """The batched inputs as the one-head forms take them: q, k, v and the gates in their own
    dtype (the forms cast them where they compute, so that no compute-dtype copy of them is
    kept), q and k L2-normalised in the compute dtype (float32, or float64 for float64 input)
    when asked, and the initial states (zeros when None) in it, ``[B, HV, V, K]``,
    or ``[N, HV, V, K]`` for packed ``cu_seqlens``. ``q`` is not scaled: ``y`` is linear in
    it, so the callers scale the outputs."""
    key_dim, (v_heads, value_dim) = q.shape[-1], v.shape[2:]
    num_states = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    compute = compute_dtype(q, *gates, initial_state)
    if use_qk_l2norm:
        q, k = l2_normalize(q.astype(compute)), l2_normalize(k.astype(compute))
    if initial_state is None:
        initial_state = jnp.zeros((num_states, v_heads, value_dim, key_dim), compute)
    return q, k, v, tuple(gates), initial_state.astype(compute)


def over_batch_and_heads(
    one_head, q, k, v, gates: tuple, initial_states, cu_seqlens=None, *, share_qk=True
):
    """Run ``one_head`` (one head, one sequence: ``(q [T, K], k, v [T, V], gates,
    initial_states [N, V, K], cu_seqlens=) -> (y [T, V], finals [N, V, K])``) over the batch,
    the key heads and the value-head groups. Returns ``(o [B, T, HV, V], finals [B or N, HV,
    V, K])``.

    The value heads of one query/key head form a group of R that reads the same q and k.
    With ``share_qk`` the group is vmapped with q and k unbatched, which shares them (and
    their q k^T, k k^T products) instead of materialising R copies. Without it (the
    per-channel rules, whose every product of q or k carries a value head's own decays, so
    that nothing is shared) q and k are repeated per value head: sharing them made autodiff
    sum their cotangents over the group inside the loop, as reduces of products over a middle
    axis, and XLA:CPU hands those to YNNPACK, which segfaulted or returned wrong values on
    some of their shapes (``tests/ops/test_head_layouts.py`` runs a grid of them)."""
    if not share_qk:
        return _over_value_heads(one_head, q, k, v, gates, initial_states, cu_seqlens)
    batch, seq_len, heads, key_dim = q.shape
    v_heads, value_dim = v.shape[2:]
    num_states = initial_states.shape[0]
    group = v_heads // heads
    # Each keeps its own length (``T n`` where it is per step) and per-channel gates their
    # trailing K or V axis.
    v, *gates = (x.reshape(*x.shape[:2], heads, group, *x.shape[3:]) for x in (v, *gates))
    gates = tuple(gates)
    states = initial_states.reshape(num_states, heads, group, value_dim, key_dim)
    if cu_seqlens is None:
        over_group = jax.vmap(
            _one_sequence(one_head), in_axes=(None, None, 1, 1, 0), out_axes=(1, 0)
        )
        over_heads = jax.vmap(over_group, in_axes=(1, 1, 1, 1, 0), out_axes=(1, 0))
        out, final = jax.vmap(over_heads)(q, k, v, gates, states)
    else:
        # B == 1; each head carries the N packed sequences' states: [N, HV, V, K].
        packed = functools.partial(one_head, cu_seqlens=cu_seqlens)
        over_group = jax.vmap(packed, in_axes=(None, None, 1, 1, 1), out_axes=(1, 1))
        over_heads = jax.vmap(over_group, in_axes=(1, 1, 1, 1, 1), out_axes=(1, 1))
        out, final = over_heads(q[0], k[0], v[0], tuple(x[0] for x in gates), states)
        out = out[None]
    out = out.reshape(batch, seq_len, v_heads, value_dim)
    return out, final.reshape(num_states, v_heads, value_dim, key_dim)


def _one_sequence(one_head):
    """``one_head`` for one sequence with one initial state: ``[V, K]`` in and out, where
    the form takes and returns ``[1, V, K]``."""

    def one_sequence(q, k, v, gates, state):
        y, finals = one_head(q, k, v, gates, state[None])
        return y, finals[0]

    return one_sequence


def _over_value_heads(one_head, q, k, v, gates, initial_states, cu_seqlens):
    """``over_batch_and_heads`` with q and k repeated per value head, mapped over the batch
    and the value heads: two maps where the grouped layout needs three, which trace a
    channel-gated rule's forward and backward once more over, and take longer to trace
    (docs/benchmarks.md). Each axis stays its own, so a mesh that
    splits the batch and the heads over different axes keeps them split."""
    q, k = (jnp.repeat(x, v.shape[2] // q.shape[2], axis=2) for x in (q, k))
    if cu_seqlens is None:
        over_heads = jax.vmap(_one_sequence(one_head), in_axes=(1, 1, 1, 1, 0), out_axes=(1, 0))
        return jax.vmap(over_heads)(q, k, v, gates, initial_states)
    # B == 1; each value head carries the N packed sequences' states: [N, HV, V, K].
    packed = functools.partial(one_head, cu_seqlens=cu_seqlens)
    over_heads = jax.vmap(packed, in_axes=(1, 1, 1, 1, 1), out_axes=(1, 1))
    out, final = over_heads(q[0], k[0], v[0], tuple(x[0] for x in gates), initial_states)
    return out[None], final


@no_type_check  # the body of the public batched ops: checks.py names its bad arguments
def batched(
    rule: Rule,
    q,
    k,
    v,
    gates: tuple,
    *,
    scale,
    initial_state,
    impl: checks.Impl,
    chunk_size: int,
    schedule: checks.Schedule,
    cu_seqlens,
    use_qk_l2norm: bool,
    **rule_options,
):
    """``rule`` over a batch of sequences and heads (the body of every batched op): the
    shape checks, the prepared inputs, then the one-head form ``impl`` over batch and heads,
    and the outputs scaled: ``S (scale q) = scale (S q)``. ``rule_options`` are the batched
    op's own (``Rule.steps``)."""
    fn = rule.name
    steps = checks.check_steps(fn, rule, rule_options)
    named = dict(zip(rule.gate_names, gates, strict=True))
    cu_seqlens = checks.as_cu_seqlens(fn, cu_seqlens)
    sizes = checks.check_batched(fn, rule, q, k, v, named, initial_state, cu_seqlens, steps)
    checks.check_scale(fn, scale)
    checks.check_flag(fn, use_qk_l2norm=use_qk_l2norm)
    dispatch.check_impl(fn, rule, impl)
    # Whatever the impl: a typo would wait for the day the impl changes.
    chunk_size = checks.check_chunk_size(fn, chunk_size)
    checks.check_schedule(fn, schedule)
    if impl != "recurrent":
        if not rule.forward_mode or impl not in ("auto", "chunked"):
            q, k, v, gates, initial_state = reverse_mode_only(
                fn, 'impl="recurrent"', rule.gate_names, q, k, v, gates, initial_state
            )
        compute = compute_dtype(q, *gates, initial_state)
        dispatch.check_kernel(fn, rule, impl, q, k, v, compute, chunk_size, cu_seqlens)
    gates = rule.with_defaults(gates, "batched", sizes)
    inputs = prepare_batched(
        q, k, v, gates, initial_state, use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens
    )
    over_batch = functools.partial(over_batch_and_heads, share_qk=rule.shares_qk)
    out, final = dispatch.run_batched(
        rule, impl, inputs, cu_seqlens, chunk_size=chunk_size, schedule=schedule,
        over_batch=over_batch,
    )  # fmt: skip
    return scaled_outputs(out, q.shape[-1], scale, v.dtype), final
