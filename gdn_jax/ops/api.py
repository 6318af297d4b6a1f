"""The batched, multi-head entry point in flash-linear-attention's layout.

It checks shapes once, then maps the single-head forms over value heads and batch with
``jax.vmap``; anything it computes, a user gets equally by vmapping
``gated_delta_rule_chunked`` or ``gated_delta_rule_recurrent`` themselves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple, no_type_check

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from gdn_jax.ops import checks
from gdn_jax.ops.chunked import chunked_rule
from gdn_jax.ops.kda_chunkwise import kda_chunked_rule
from gdn_jax.ops.normalize import l2_normalize
from gdn_jax.ops.recurrent import recurrent_rule
from gdn_jax.ops.step import compute_dtype, linear_token_step, scaled_outputs, token_step
from gdn_jax.ops.wy import DELTA, LINEAR, WriteRule


class Rule(NamedTuple):
    """One recurrence in both forms: the token step of the recurrent form and the write
    rule of the chunked form."""

    token: Callable
    chunk: WriteRule


DELTA_RULE = Rule(token_step, DELTA)  # S' = alpha S + beta (v - alpha S k) k^T
LINEAR_RULE = Rule(linear_token_step, LINEAR)  # S' = alpha S + beta v k^T


class Forms(NamedTuple):
    """The one-head functions of a recurrence, with ``chunked.chunked_rule``'s contract
    (``(q, k, v, log_alpha, beta, initial_states, *, cu_seqlens) -> (y, finals)``, the
    chunked one also taking ``chunk_size`` and ``schedule``), and whether its gates are one
    per key channel, ``[.., K]``."""

    recurrent: Callable
    chunked: Callable
    per_channel: bool
    reverse_only: bool = True  # the chunked form is a custom_vjp: no forward-mode autodiff


def rule_forms(rule: Rule) -> Forms:
    """The recurrent and chunked forms of a per-head-gated ``rule``."""
    recurrent = functools.partial(recurrent_rule, step=rule.token)
    return Forms(recurrent, functools.partial(chunked_rule, rule=rule.chunk), per_channel=False)


# S' = S Diag(alpha) + beta (v - S Diag(alpha) k) k^T: token_step broadcasts [K] gates. Its
# chunked form differentiates by autodiff, forward mode included.
KDA_FORMS = Forms(
    functools.partial(recurrent_rule, step=token_step),
    kda_chunked_rule,
    per_channel=True,
    reverse_only=False,
)


@no_type_check  # a public entry point: checks.py names its bad arguments
def gated_delta_rule(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T HV V"],
    log_alpha: Float[Array, "B T HV"],
    beta: Float[Array, "B T HV"],
    *,
    scale: float | None = None,
    initial_state: Float[Array, "B HV V K"] | None = None,
    impl: checks.Impl = "chunked",
    chunk_size: int = 64,
    schedule: checks.Schedule = "auto",
    cu_seqlens: Int[Array, " N+1"] | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[Float[Array, "B T HV V"], Float[Array, "B HV V K"]]:
    """Gated delta rule over a batch of sequences and heads.

    Per value head and sequence this is ``gated_delta_rule_chunked`` (or ``_recurrent``):
    ``S_t = alpha_t S_{t-1} + beta_t (v_t - alpha_t S_{t-1} k_t) k_t^T``,
    ``y_t = S_t (scale q_t)``, ``alpha_t = exp(log_alpha_t)``, states ``[V, K]``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; one floating dtype for all three.
        ``HV`` is a multiple of ``H``: value head ``i`` reads query/key head ``i // (HV // H)``.
      log_alpha, beta: ``[B, T, HV]``, log-space decay (``<= 0``) and activated strength.
      scale: query scale; ``None`` means ``K ** -0.5``.
      initial_state: ``[B, HV, V, K]``, or ``[N, HV, V, K]`` with ``cu_seqlens``; ``None`` is
        zeros. flash-linear-attention's states are ``[.., K, V]``: pass ``swapaxes(-1, -2)``.
      impl: ``"chunked"`` (train with this) or ``"recurrent"`` (the token-by-token reference).
      chunk_size: 16, 32, 64 or 128 (chunked only).
      schedule: ``"auto"``, ``"hoisted"`` or ``"in_scan"`` (chunked only), as in
        ``gated_delta_rule_chunked``.
      cu_seqlens: ``[N+1]`` int offsets of ``N`` sequences packed along ``T`` (needs ``B == 1``).
        Each sequence starts from its own initial state and returns its own final state, as
        if run alone. It may be traced; its values are checked only when concrete.
      use_qk_l2norm: L2-normalise q and k over ``K`` (eps 1e-6) inside the op.

    Returns:
      ``(o [B, T, HV, V], final_state)``: ``o`` in the input dtype; ``final_state`` float32
      (float64 for float64 input), ``[B, HV, V, K]`` or ``[N, HV, V, K]`` with ``cu_seqlens``.
    """
    options = dict(scale=scale, initial_state=initial_state, impl=impl, chunk_size=chunk_size)
    options.update(schedule=schedule, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm)
    return _batched("gated_delta_rule", rule_forms(DELTA_RULE), q, k, v, log_alpha, beta, **options)


@no_type_check  # a public entry point: checks.py names its bad arguments
def gated_linear_attention(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T HV V"],
    log_alpha: Float[Array, "B T HV"],
    beta: Float[Array, "B T HV"],
    *,
    scale: float | None = None,
    initial_state: Float[Array, "B HV V K"] | None = None,
    impl: checks.Impl = "chunked",
    chunk_size: int = 64,
    schedule: checks.Schedule = "auto",
    cu_seqlens: Int[Array, " N+1"] | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[Float[Array, "B T HV V"], Float[Array, "B HV V K"]]:
    """The same recurrence without the delta correction: ``S_t = alpha_t S_{t-1} +
    beta_t v_t k_t^T``, ``y_t = S_t (scale q_t)``.

    With ``log_alpha`` it is gated linear attention with a scalar gate per head (Mamba-2's
    form); with ``log_alpha = 0`` and ``beta = 1`` plain causal linear attention. Arguments,
    layouts and results are those of ``gated_delta_rule``.
    """
    options = dict(scale=scale, initial_state=initial_state, impl=impl, chunk_size=chunk_size)
    options.update(schedule=schedule, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm)
    return _batched(
        "gated_linear_attention", rule_forms(LINEAR_RULE), q, k, v, log_alpha, beta, **options
    )


@no_type_check  # a public entry point: checks.py names its bad arguments
def kda(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T HV V"],
    log_alpha: Float[Array, "B T HV K"],
    beta: Float[Array, "B T HV"],
    *,
    scale: float | None = None,
    initial_state: Float[Array, "B HV V K"] | None = None,
    use_qk_l2norm: bool = False,
    cu_seqlens: Int[Array, " N+1"] | None = None,
    impl: checks.Impl = "chunked",
    chunk_size: int = 64,
    schedule: checks.Schedule = "auto",
) -> tuple[Float[Array, "B T HV V"], Float[Array, "B HV V K"]]:
    """Kimi Delta Attention (KDA) over a batch of sequences and heads.

    Per value head and sequence: ``S_t = S_{t-1} Diag(alpha_t) + beta_t (v_t - S_{t-1}
    Diag(alpha_t) k_t) k_t^T``, ``y_t = S_t (scale q_t)``, ``alpha_t = exp(log_alpha_t)`` with
    one gate per key channel, states ``[V, K]``. With equal channels it is
    ``gated_delta_rule``, whose arguments and results it shares but for ``log_alpha``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; one floating dtype for all three.
        ``HV`` is a multiple of ``H``: value head ``i`` reads query/key head ``i // (HV // H)``.
      log_alpha: ``[B, T, HV, K]`` log-space decays (``<= 0``; ``-inf`` resets a channel).
      beta: ``[B, T, HV]`` activated writing strengths.
      scale: query scale; ``None`` means ``K ** -0.5``.
      initial_state: ``[B, HV, V, K]``, or ``[N, HV, V, K]`` with ``cu_seqlens``; ``None`` is
        zeros. flash-linear-attention's states are ``[.., K, V]``: pass ``swapaxes(-1, -2)``.
      use_qk_l2norm: L2-normalise q and k over ``K`` (eps 1e-6) inside the op.
      cu_seqlens: ``[N+1]`` int offsets of ``N`` sequences packed along ``T`` (needs
        ``B == 1``), as in ``gated_delta_rule``.
      impl: ``"chunked"`` (train with this; ``kda_chunked``) or ``"recurrent"`` (the
        token-by-token reference, ``kda_recurrent``).
      chunk_size: 16, 32, 64 or 128 (chunked only).
      schedule: ``"auto"``, ``"hoisted"`` or ``"in_scan"`` (chunked only), as in
        ``gated_delta_rule_chunked``.

    Returns:
      ``(o [B, T, HV, V], final_state)``: ``o`` in the input dtype; ``final_state`` float32
      (float64 for float64 input), ``[B, HV, V, K]`` or ``[N, HV, V, K]`` with ``cu_seqlens``.
    """
    options = dict(scale=scale, initial_state=initial_state, impl=impl, chunk_size=chunk_size)
    options.update(schedule=schedule, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm)
    return _batched("kda", KDA_FORMS, q, k, v, log_alpha, beta, **options)


def prepare_batched(q, k, v, log_alpha, beta, initial_state, *, use_qk_l2norm, cu_seqlens):
    """The batched inputs as the one-head forms take them: q, k and v in their own dtype (the
    forms cast them where they compute, so that no compute-dtype copy of them is kept), q and
    k L2-normalised in the compute dtype (float32, or float64 for float64 input) when asked,
    the gates in the compute dtype, and the initial states (zeros when None) ``[B, HV, V, K]``,
    or ``[N, HV, V, K]`` for packed ``cu_seqlens``. ``q`` is not scaled: ``y`` is linear in
    it, so the callers scale the outputs."""
    key_dim, (v_heads, value_dim) = q.shape[-1], v.shape[2:]
    num_states = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    compute = compute_dtype(q, log_alpha, beta, initial_state)
    if use_qk_l2norm:
        q, k = l2_normalize(q.astype(compute)), l2_normalize(k.astype(compute))
    if initial_state is None:
        initial_state = jnp.zeros((num_states, v_heads, value_dim, key_dim), compute)
    rest = (x.astype(compute) for x in (log_alpha, beta, initial_state))
    return (q, k, v, *rest)


def over_batch_and_heads(
    one_head, q, k, v, log_alpha, beta, initial_states, cu_seqlens=None, *, share_qk=True
):
    """Run ``one_head`` (one head, one sequence, as ``chunked.chunked_rule``: ``(q [T, K],
    ..., initial_states [N, V, K], cu_seqlens=) -> (y [T, V], finals [N, V, K])``) over the
    batch, the key heads and the value-head groups. Returns ``(o [B, T, HV, V], finals
    [B or N, HV, V, K])``.

    The value heads of one query/key head form a group of R that reads the same q and k.
    With ``share_qk`` the group is vmapped with q and k unbatched, which shares them (and
    their q k^T, k k^T products) instead of materialising R copies. Without it (the
    per-channel rules, whose every product of q or k carries a value head's own decays, so
    that nothing is shared) q and k are repeated per value head: sharing them made autodiff
    sum their cotangents over the group inside the loop, as reduces of products over a middle
    axis, and XLA:CPU (jaxlib 0.10.2) hands those to YNNPACK, which segfaults or returns
    wrong values on some of their shapes (``tests/test_head_layouts.py``)."""
    heads, v_heads = q.shape[2], v.shape[2]
    if not share_qk:
        q, k = (jnp.repeat(x, v_heads // heads, axis=2) for x in (q, k))
    batch, seq_len, heads, key_dim = q.shape
    value_dim = v.shape[3]
    num_states = initial_states.shape[0]
    group = v_heads // heads
    v = v.reshape(batch, seq_len, heads, group, value_dim)
    # Per-channel gates (KDA) keep their trailing K axis.
    log_alpha = log_alpha.reshape(batch, seq_len, heads, group, *log_alpha.shape[3:])
    beta = beta.reshape(batch, seq_len, heads, group)
    states = initial_states.reshape(num_states, heads, group, value_dim, key_dim)
    if cu_seqlens is None:
        # Each (batch, head) is one sequence with one initial state: [V, K] -> [1, V, K].
        def one_sequence(q, k, v, log_alpha, beta, state):
            y, finals = one_head(q, k, v, log_alpha, beta, state[None])
            return y, finals[0]

        over_group = jax.vmap(one_sequence, in_axes=(None, None, 1, 1, 1, 0), out_axes=(1, 0))
        over_heads = jax.vmap(over_group, in_axes=(1, 1, 1, 1, 1, 0), out_axes=(1, 0))
        out, final = jax.vmap(over_heads)(q, k, v, log_alpha, beta, states)
    else:
        # B == 1; each head carries the N packed sequences' states: [N, HV, V, K].
        packed = functools.partial(one_head, cu_seqlens=cu_seqlens)
        over_group = jax.vmap(packed, in_axes=(None, None, 1, 1, 1, 1), out_axes=(1, 1))
        over_heads = jax.vmap(over_group, in_axes=(1, 1, 1, 1, 1, 1), out_axes=(1, 1))
        out, final = over_heads(q[0], k[0], v[0], log_alpha[0], beta[0], states)
        out = out[None]
    out = out.reshape(batch, seq_len, v_heads, value_dim)
    return out, final.reshape(num_states, v_heads, value_dim, key_dim)


def _batched(
    fn,
    forms,
    q,
    k,
    v,
    log_alpha,
    beta,
    *,
    scale,
    initial_state,
    impl,
    chunk_size,
    schedule,
    cu_seqlens,
    use_qk_l2norm,
):
    """Shared body of ``gated_delta_rule``, ``gated_linear_attention`` and ``kda``: a shape
    check, the prepared inputs, then the one-head form ``impl`` of ``forms`` over batch and
    heads, and the outputs scaled: ``S (scale q) = scale (S q)``."""
    per_channel = forms.per_channel
    checks.check_batched(
        fn, q, k, v, log_alpha, beta, initial_state, cu_seqlens, per_channel=per_channel
    )
    checks.check_scale(fn, scale)
    checks.check_impl(fn, impl)
    if impl == "chunked":
        chunk_size = checks.check_chunk_size(fn, chunk_size)
        checks.check_schedule(fn, schedule)
        if forms.reverse_only:
            arrays = dict(q=q, k=k, v=v, log_alpha=log_alpha, beta=beta)
            checks.check_reverse_mode(fn, 'impl="recurrent"', **arrays, initial_state=initial_state)
    inputs = prepare_batched(
        q,
        k,
        v,
        log_alpha,
        beta,
        initial_state,
        use_qk_l2norm=use_qk_l2norm,
        cu_seqlens=cu_seqlens,
    )
    if impl == "chunked":
        one_head = functools.partial(forms.chunked, chunk_size=chunk_size, schedule=schedule)
    else:
        one_head = forms.recurrent
    share_qk = not forms.per_channel
    out, final = over_batch_and_heads(one_head, *inputs, cu_seqlens, share_qk=share_qk)
    return scaled_outputs(out, q.shape[-1], scale, v.dtype), final
