"""The batched, multi-head entry point in flash-linear-attention's layout.

It checks shapes once, then maps the single-head forms over value heads and batch with
``jax.vmap``; anything it computes, a user gets equally by vmapping
``gated_delta_rule_chunked`` or ``gated_delta_rule_recurrent`` themselves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from gdn_jax.ops import checks
from gdn_jax.ops.chunked import chunked_rule
from gdn_jax.ops.normalize import l2_normalize
from gdn_jax.ops.recurrent import recurrent_rule
from gdn_jax.ops.step import compute_dtype, default_scale, linear_token_step, token_step
from gdn_jax.ops.wy import DELTA, LINEAR, WriteRule


class Rule(NamedTuple):
    """One recurrence in both forms: the token step of the recurrent form and the write
    rule of the chunked form."""

    token: Callable
    chunk: WriteRule


DELTA_RULE = Rule(token_step, DELTA)  # S' = alpha S + beta (v - alpha S k) k^T
LINEAR_RULE = Rule(linear_token_step, LINEAR)  # S' = alpha S + beta v k^T


def _check_batched(fn, q, k, v, log_alpha, beta, initial_state, cu_seqlens):
    checks.check_arrays(
        fn, q=q, k=k, v=v, log_alpha=log_alpha, beta=beta, initial_state=initial_state
    )
    checks.check_floating(
        fn, q=q, k=k, v=v, log_alpha=log_alpha, beta=beta, initial_state=initial_state
    )
    checks.check_same_dtype(fn, q=q, k=k, v=v)
    checks.check_rank(fn, "q", q, 4, "[B, T, H, K]")
    checks.check_rank(fn, "v", v, 4, "[B, T, HV, V]")
    batch, seq_len, heads, key_dim = q.shape
    v_heads, value_dim = v.shape[2], v.shape[3]
    checks.check_shape(fn, "k", k, q.shape, "[B, T, H, K] like q")
    checks.check_shape(fn, "v", v, (batch, seq_len, v_heads, value_dim), "[B, T, HV, V]")
    checks.check_shape(fn, "log_alpha", log_alpha, (batch, seq_len, v_heads), "[B, T, HV]")
    checks.check_shape(fn, "beta", beta, (batch, seq_len, v_heads), "[B, T, HV]")
    if v_heads % heads:
        raise ValueError(
            f"{fn}: value heads HV={v_heads} (v.shape={v.shape}) must be a multiple of "
            f"query/key heads H={heads} (q.shape={q.shape})"
        )
    if seq_len < 1:
        raise ValueError(f"{fn}: need at least one token, got q.shape={q.shape}")
    num_states = batch
    if cu_seqlens is not None:
        if batch != 1:
            raise ValueError(
                f"{fn}: cu_seqlens packs sequences along T and needs B == 1, got q.shape={q.shape}"
            )
        checks.check_cu_seqlens(fn, cu_seqlens, seq_len)
        num_states = cu_seqlens.shape[0] - 1
    if initial_state is not None:
        layout = "[N, HV, V, K]" if cu_seqlens is not None else "[B, HV, V, K]"
        checks.check_shape(
            fn, "initial_state", initial_state, (num_states, v_heads, value_dim, key_dim), layout
        )


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
    return _batched("gated_delta_rule", DELTA_RULE, q, k, v, log_alpha, beta, **options)


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
    return _batched("gated_linear_attention", LINEAR_RULE, q, k, v, log_alpha, beta, **options)


def _batched(
    fn,
    rule,
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
    """Shared body of ``gated_delta_rule`` and ``gated_linear_attention``: a shape check,
    the compute-dtype inputs, then ``rule`` in the form ``impl`` vmapped over batch and heads."""
    _check_batched(fn, q, k, v, log_alpha, beta, initial_state, cu_seqlens)
    checks.check_scale(fn, scale)
    checks.check_impl(fn, impl)
    if impl == "chunked":
        checks.check_chunk_size(fn, chunk_size)
        checks.check_schedule(fn, schedule)
    batch, seq_len, heads, key_dim = q.shape
    v_heads, value_dim = v.shape[2], v.shape[3]
    scale = default_scale(key_dim) if scale is None else scale
    compute = compute_dtype(q, log_alpha, beta, initial_state)
    out_dtype = v.dtype

    q, k = q.astype(compute), k.astype(compute)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * scale
    v, log_alpha, beta = v.astype(compute), log_alpha.astype(compute), beta.astype(compute)

    num_states = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if initial_state is None:
        initial_state = jnp.zeros((num_states, v_heads, value_dim, key_dim), compute)
    initial_state = initial_state.astype(compute)

    if impl == "chunked":
        one_head = functools.partial(
            chunked_rule,
            chunk_size=chunk_size,
            cu_seqlens=cu_seqlens,
            rule=rule.chunk,
            schedule=schedule,
        )
    else:
        one_head = functools.partial(recurrent_rule, cu_seqlens=cu_seqlens, step=rule.token)

    # The value heads of one query/key head form a group of R that reads the same q and k:
    # vmapping the group with q and k unbatched shares them (and their q k^T, k k^T products)
    # instead of materialising R copies.
    group = v_heads // heads
    v = v.reshape(batch, seq_len, heads, group, value_dim)
    log_alpha, beta = (x.reshape(batch, seq_len, heads, group) for x in (log_alpha, beta))
    if cu_seqlens is None:
        # Each (batch, head) is one sequence with one initial state: [V, K] -> [1, V, K].
        def one_sequence(q, k, v, log_alpha, beta, state):
            y, finals = one_head(q, k, v, log_alpha, beta, state[None])
            return y, finals[0]

        over_group = jax.vmap(one_sequence, in_axes=(None, None, 1, 1, 1, 0), out_axes=(1, 0))
        over_heads = jax.vmap(over_group, in_axes=(1, 1, 1, 1, 1, 0), out_axes=(1, 0))
        states = initial_state.reshape(batch, heads, group, value_dim, key_dim)
        out, final = jax.vmap(over_heads)(q, k, v, log_alpha, beta, states)
    else:
        # B == 1; each head carries the N packed sequences' states: [N, HV, V, K].
        over_group = jax.vmap(one_head, in_axes=(None, None, 1, 1, 1, 1), out_axes=(1, 1))
        over_heads = jax.vmap(over_group, in_axes=(1, 1, 1, 1, 1, 1), out_axes=(1, 1))
        states = initial_state.reshape(num_states, heads, group, value_dim, key_dim)
        out, final = over_heads(q[0], k[0], v[0], log_alpha[0], beta[0], states)
        out = out[None]
    out = out.reshape(batch, seq_len, v_heads, value_dim)
    final = final.reshape(num_states, v_heads, value_dim, key_dim)
    return out.astype(out_dtype), final
