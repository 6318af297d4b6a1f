"""The gated delta rule with the tokens split over a mesh axis (sequence or context parallelism).

Each of the ``n`` devices along ``axis_name`` holds ``T / n`` consecutive tokens. Every
token's update is affine in the state, and so is a shard's:

    S_end = S_start P + R,   P [K, K] = prod_t alpha_t (I - beta_t k_t k_t^T)  (in order),
                             R [V, K] = the shard's end state from a zero start,

with ``P = prod_t alpha_t I`` for the linear rule. The rows of a state evolve independently,
so one run of ``chunked.chunked_rule`` over the shard's own tokens gives both at once: it
runs the stacked state ``[R; P]`` of ``V + K`` rows from ``[0; I]`` with values ``[v | 0]``.
Its outputs are stacked the same way, ``y_t = R_t q_t`` and ``z_t = P_t q_t``. The devices
then gather the shards' ``[R; P]`` carries, ``[V + K, K]`` per head (state-sized; no
activation leaves its device), compose them in order into each shard's true start state
``S_start``, and finish without a second pass over the tokens:

    o_t = S_t q_t = R_t q_t + S_start P_t q_t = y_t + S_start z_t.

So the whole op is one chunked run of width ``V + K`` (its backward keeps one ``[V + K, K]``
state per chunk) rather than the ``(P, R)`` runs followed by a second pass over the tokens
from ``S_start``.

Gradients come from autodiff: the transpose of the gather carries the cotangents of the
pairs back to the shards that made them, so they cross the shard boundaries in reverse.

Packed sequences (``cu_seqlens``, global offsets on every device) may cross shard boundaries.
At most one sequence enters a shard from the left: the one holding the shard's first token,
when it started earlier. Only it starts from ``[0; I]``; every sequence that starts inside
the shard starts from ``[its initial state; 0]``, so it does not depend on ``S_start``. The
state handed to the next shard is that of the sequence holding the shard's last token, and
each sequence's final state comes from the shard holding its last token.

Shapes, with the project's letters: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, gates
``[B, T, HV]``, states ``[B, HV, V, K]`` (``[N, HV, V, K]`` with ``cu_seqlens``, ``B == 1``;
the annotations write ``_`` for that axis); one shard holds ``T / n`` tokens, laid out in
chunks of ``C``.
"""

from __future__ import annotations

import functools
from typing import no_type_check

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from gdn_jax.ops import checks
from gdn_jax.ops.api import over_batch_and_heads, prepare_batched
from gdn_jax.ops.forward_mode import reverse_mode_only
from gdn_jax.ops.rule import Rule
from gdn_jax.ops.single_head import scaled_outputs


def _compose(first, second):
    """The affine state maps ``S -> S P + R`` of two consecutive spans, as one:
    ``(S P1 + R1) P2 + R2 = S (P1 P2) + (R1 P2 + R2)``."""
    (p1, r1), (p2, r2) = first, second
    return p1 @ p2, r1 @ p2 + r2


def shard_start_state(carry, value_dim, axis_name):
    """This shard's true start state from every shard's stacked ``[R; P]`` carry.

    ``carry [V + K, K]`` is the state this shard hands on, from a zero start and from the
    identity. The gather is the only communication of the forward pass; shard 0's ``P`` is
    zero (it starts from the known initial state), so the composition starts from zero.
    """
    stacked = jax.lax.all_gather(carry, axis_name)  # [n, V + K, K]
    # The maps composed shard after shard, a fold of n - 1 state-sized products: the
    # gradient of jax.lax.associative_scan here crashed XLA:CPU in jaxlib 0.11.2 (a
    # segmentation fault compiling it on two or more devices).
    step = (stacked[0, value_dim:], stacked[0, :value_dim])
    after = [step[1]]
    for j in range(1, stacked.shape[0]):
        step = _compose(step, (stacked[j, value_dim:], stacked[j, :value_dim]))
        after.append(step[1])
    through = jnp.stack(after)  # through[j]: the state after shards 0..j
    shard = jax.lax.axis_index(axis_name)
    before = through[jnp.maximum(shard - 1, 0)]
    return jnp.where(shard > 0, before, jnp.zeros_like(before))


def _with_start(stacked, start, value_dim):
    """Apply the start state to stacked ``[R; P]`` rows: ``R + S_start P``."""
    return stacked[..., :value_dim, :] + start @ stacked[..., value_dim:, :]


def stacked_inputs(v, gates, rule: Rule, key_dim):
    """The values ``[v | 0]`` of the stacked state ``[R; P]`` and the gates to match: a
    write gate per value channel (GDN-2's ``w``) reaches the values only, so the transition
    rows, whose values are zero, get gates of one."""
    stacked_v = jnp.concatenate([v, jnp.zeros((v.shape[0], key_dim), v.dtype)], axis=1)
    stacked_gates = tuple(
        jnp.concatenate([gate, jnp.ones((gate.shape[0], key_dim), gate.dtype)], axis=1)
        if spec.channels == "V"
        else gate
        for spec, gate in zip(rule.gates, gates, strict=True)
    )
    return stacked_v, stacked_gates


def stacked_starts(initial_states, cu, first, local_len, shard):
    """The start states ``[N, V + K, K]`` of this shard's run and its local offsets (None
    without ``cu``). The values part starts from the known initial states, the transition
    part from I, and each from zero where the other applies. Masking the values part alone
    keeps the cotangent that the replicated initial states gather from every shard
    ``[V, K]``-sized."""
    identity = jnp.eye(initial_states.shape[-1], dtype=initial_states.dtype)
    if cu is None:
        # Shard 0 starts from the initial state, every other one from the carry.
        first_shard = shard == 0
        values = jnp.where(first_shard, initial_states, jnp.zeros_like(initial_states))
        transition = jnp.where(first_shard, jnp.zeros_like(identity), identity)[None]
        return jnp.concatenate([values, transition], axis=1), None
    num_seqs = cu.shape[0] - 1
    ids = jnp.arange(num_seqs, dtype=jnp.int32)
    # The sequence holding token t is (number of offsets <= t) - 1, a count rather than
    # jnp.searchsorted, which fails on a shard-varying t inside shard_map (jax 0.10.2).
    # Past a traced last offset the count gives N: no sequence holds the token.
    entering = jnp.sum(cu <= first, dtype=jnp.int32) - 1
    enters = (entering < num_seqs) & (cu[jnp.minimum(entering, num_seqs - 1)] < first)
    from_left = (enters & (ids == entering))[:, None, None]
    values = jnp.where(from_left, jnp.zeros_like(initial_states), initial_states)
    transition = jnp.where(from_left, identity[None], jnp.zeros_like(identity)[None])
    # Local offsets; sequences outside the shard become empty and keep their start.
    return jnp.concatenate([values, transition], axis=1), jnp.clip(cu - first, 0, local_len)


def handed_on(finals, cu, last_token):
    """The stacked state this shard hands on: that of the sequence holding its last token
    (zeros if none does)."""
    if cu is None:
        return finals[0]
    num_seqs = cu.shape[0] - 1
    holder = jnp.sum(cu <= last_token, dtype=jnp.int32) - 1
    held = holder < num_seqs
    return jnp.where(held, finals[jnp.minimum(holder, num_seqs - 1)], jnp.zeros_like(finals[0]))


def gathered_finals(finals, initial_states, cu, local_len, shard, axis_name):
    """Each sequence's final state, the same on every shard. It lives on the shard with the
    sequence's last token; one masked sum spreads it (and sends the cotangent back to that
    shard alone)."""
    if cu is None:
        owns = (shard == jax.lax.axis_size(axis_name) - 1)[None]
    else:
        last = cu[1:] - 1
        owns = (last >= cu[:-1]) & (last // local_len == shard)
    total = jax.lax.psum(jnp.where(owns[:, None, None], finals, jnp.zeros_like(finals)), axis_name)
    if cu is None:
        return total
    # A sequence without tokens has no shard; it keeps its initial state.
    return jnp.where((cu[1:] == cu[:-1])[:, None, None], initial_states, total)


def seq_parallel_rule(
    q: Float[Array, "T K"],
    k: Float[Array, "Tn K"],
    v: Float[Array, "Tn V"],
    gates: tuple,
    initial_states: Float[Array, "N V K"],
    *,
    rule: Rule,
    axis_name: str,
    chunk_size: int,
    cu_seqlens: Int[Array, " N+1"] | None = None,
    schedule: checks.Schedule = "auto",
) -> tuple[Float[Array, "T V"], Float[Array, "N V K"]]:
    """One head of ``rule`` over one shard of the tokens, called inside ``jax.shard_map``;
    the sequence-parallel twin of ``rule.chunked``, with its arguments and results.

    The gates and states are in the compute dtype, q, k and v in it or narrower, and ``q`` is
    not scaled: q ``[T / n, K]``, k, v and the gates are this shard's tokens (their steps,
    with several a token: ``Rule.steps``);
    ``initial_states [N, V, K]`` and ``cu_seqlens [N+1]`` (global offsets) are the same on
    every shard. ``T / n`` need not be a multiple of ``chunk_size``.

    Returns ``(y [T / n, V], finals [N, V, K])``; ``finals`` is the same on every shard.
    """
    local_len, key_dim = q.shape
    value_dim = v.shape[1]
    shard = jax.lax.axis_index(axis_name)
    first = shard * local_len
    cu = None if cu_seqlens is None else cu_seqlens.astype(jnp.int32)
    stacked_v, stacked_gates = stacked_inputs(v, gates, rule, key_dim)
    starts, local_cu = stacked_starts(initial_states, cu, first, local_len, shard)
    ys, finals = rule.chunked(
        q, k, stacked_v, stacked_gates, starts,
        chunk_size=chunk_size, cu_seqlens=local_cu, schedule=schedule,
    )  # fmt: skip
    carry = handed_on(finals, cu, first + local_len - 1)
    start = shard_start_state(carry, value_dim, axis_name)
    y = ys[:, :value_dim] + ys[:, value_dim:] @ start.T
    finals = _with_start(finals, start, value_dim)
    return y, gathered_finals(finals, initial_states, cu, local_len, shard, axis_name)


def _check_mesh(fn, mesh, axis_name, seq_len):
    if not isinstance(mesh, (Mesh, AbstractMesh)):
        raise ValueError(f"{fn}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"{fn}: axis_name={axis_name!r} must be an axis of the mesh, got axes "
            f"{tuple(mesh.axis_names)}"
        )
    shards = mesh.shape[axis_name]
    if seq_len % shards:
        raise ValueError(
            f"{fn}: T={seq_len} (q.shape[1]) must be divisible by the {shards} devices of mesh "
            f"axis {axis_name!r}"
        )


@no_type_check  # the body of the public *_seq_parallel ops: checks.py names bad arguments
def seq_parallel(
    rule: Rule,
    q,
    k,
    v,
    gates: tuple,
    *,
    fn: str,
    mesh,
    axis_name,
    scale,
    initial_state,
    chunk_size,
    schedule,
    cu_seqlens,
    use_qk_l2norm,
    **rule_options,
):
    """``rule``'s batched op (``api.batched``, chunked) with ``T`` split over the mesh axis
    ``axis_name``; the body of every ``*_seq_parallel`` op, whose errors name ``fn``.

    The arguments and results are those of the batched op, and so are the values, up to
    float rounding. Device ``i`` along ``axis_name`` holds tokens ``i T/n : (i+1) T/n``; the
    devices exchange one ``[V + K, K]`` state per head and sequence, never activations.
    The other axes of ``mesh`` are left to the compiler (``shard_map`` is manual over
    ``axis_name`` only), so a batch sharded over a data axis stays sharded. ``T`` must be
    divisible by the size ``n`` of the axis; ``cu_seqlens`` holds global offsets, and a
    sequence may cross any number of shard boundaries. ``rule_options`` are the op's own
    (``Rule.steps``): a token's steps stay on its shard.
    """
    steps = checks.check_steps(fn, rule, rule_options)
    named = dict(zip(rule.gate_names, gates, strict=True))
    cu_seqlens = checks.as_cu_seqlens(fn, cu_seqlens)
    sizes = checks.check_batched(fn, rule, q, k, v, named, initial_state, cu_seqlens, steps)
    _check_mesh(fn, mesh, axis_name, q.shape[1])
    checks.check_scale(fn, scale)
    checks.check_flag(fn, use_qk_l2norm=use_qk_l2norm)
    chunk_size = checks.check_chunk_size(fn, chunk_size)
    checks.check_schedule(fn, schedule)
    instead = 'the one-device op with impl="recurrent"'
    q, k, v, gates, initial_state = reverse_mode_only(
        fn, instead, rule.gate_names, q, k, v, gates, initial_state
    )
    gates = rule.with_defaults(gates, "batched", sizes)
    q, k, v, gates, states = prepare_batched(
        q, k, v, gates, initial_state, use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens
    )
    one_head = functools.partial(
        seq_parallel_rule, rule=rule, axis_name=axis_name, chunk_size=chunk_size,
        schedule=schedule,
    )  # fmt: skip

    def per_shard(q, k, v, gates, states, *cu):
        return over_batch_and_heads(one_head, q, k, v, gates, states, *cu, share_qk=rule.shares_qk)

    tokens = P(None, axis_name)
    # The states and offsets are the same on every shard.
    replicated = (states,) if cu_seqlens is None else (states, cu_seqlens)
    run = jax.shard_map(
        per_shard,
        mesh=mesh,
        in_specs=(tokens, tokens, tokens, (tokens,) * len(gates), *(P(),) * len(replicated)),
        out_specs=(tokens, P()),
        axis_names={axis_name},
    )
    out, final = run(q, k, v, gates, *replicated)
    return scaled_outputs(out, q.shape[-1], scale, v.dtype), final
