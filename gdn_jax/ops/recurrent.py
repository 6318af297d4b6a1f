"""The gated delta rule token by token: ``gated_delta_step`` under ``jax.lax.scan``; and
Kimi Delta Attention's the same way, whose gates are ``[T, K]`` (``kda_token.py``).

This is the readable reference form. Its forward is cheap, but reverse-mode autodiff keeps
one ``[V, K]`` state per token (``T * V * K`` floats per head), so train with the chunked form.
"""

from __future__ import annotations

from typing import no_type_check

from jaxtyping import Array, Float, Int

from gdn_jax.ops.blocks import scan_blocks
from gdn_jax.ops.step import checked_single_head, token_step
from gdn_jax.ops.varlen import pack_layout


def recurrent_core(
    q: Float[Array, "T K"],
    k: Float[Array, "T K"],
    v: Float[Array, "T V"],
    log_alpha: Float[Array, " T"] | Float[Array, "T K"],
    beta: Float[Array, " T"],
    initial_states: Float[Array, "N V K"],
    resets=None,
    step=token_step,
) -> tuple[Float[Array, "T V"], Float[Array, "N V K"]]:
    """Scan ``step`` over tokens in the states' dtype, which q, k and v are cast to (``q``
    unscaled); see ``scan_blocks``."""
    q, k, v = (x.astype(initial_states.dtype) for x in (q, k, v))
    return scan_blocks(step, (q, k, v, log_alpha, beta), initial_states, resets)


def recurrent_rule(
    q: Float[Array, "T K"],
    k: Float[Array, "T K"],
    v: Float[Array, "T V"],
    log_alpha: Float[Array, " T"] | Float[Array, "T K"],
    beta: Float[Array, " T"],
    initial_states: Float[Array, "N V K"],
    *,
    cu_seqlens: Int[Array, " N+1"] | None = None,
    step=token_step,
) -> tuple[Float[Array, "T V"], Float[Array, "N V K"]]:
    """Run ``recurrent_core`` with ``step`` over the tokens, resetting the state where packed
    ``cu_seqlens`` start a sequence; the recurrent twin of ``chunked.chunked_rule``, with the
    same arguments and results (a block is one token, so the layout keeps every token in
    place, and its gather zeroes the tokens past a traced last offset). Gates ``[T, K]``
    with ``step=token_step`` run KDA."""
    if cu_seqlens is None:
        return recurrent_core(q, k, v, log_alpha, beta, initial_states, None, step)
    layout = pack_layout(cu_seqlens, q.shape[0], 1)
    ys, finals = recurrent_core(q, k, v, log_alpha, beta, initial_states, layout.resets, step)
    return layout.gather(ys), finals


@no_type_check  # a public entry point: checks.py names its bad arguments
def gated_delta_rule_recurrent(
    q: Float[Array, "T K"],
    k: Float[Array, "T K"],
    v: Float[Array, "T V"],
    log_alpha: Float[Array, " T"],
    beta: Float[Array, " T"],
    *,
    scale: float | None = None,
    initial_state: Float[Array, "V K"] | None = None,
) -> tuple[Float[Array, "T V"], Float[Array, "V K"]]:
    """One head, one sequence, one token at a time.

    For ``t = 1..T``: ``S_t = alpha_t S_{t-1} + beta_t (v_t - alpha_t S_{t-1} k_t) k_t^T`` and
    ``y_t = S_t (scale q_t)``, with ``alpha_t = exp(log_alpha_t)`` and ``S_0 = initial_state``
    (zeros when ``None``).

    Args:
      q, k: ``[T, K]``; v: ``[T, V]``; all three in one floating dtype.
      log_alpha: ``[T]`` decay gates in log space (``<= 0``).
      beta: ``[T]`` writing strengths, already activated.
      scale: query scale; ``None`` means ``K ** -0.5``.
      initial_state: ``[V, K]`` or ``None``.

    Returns:
      ``(y [T, V], final_state [V, K])``: ``y`` in the input dtype, the state in float32
      (float64 for float64 input).
    """
    return checked_single_head(
        "gated_delta_rule_recurrent", recurrent_rule, q, k, v, log_alpha, beta, initial_state,
        scale=scale,
    )  # fmt: skip


@no_type_check  # a public entry point: checks.py names its bad arguments
def kda_recurrent(
    q: Float[Array, "T K"],
    k: Float[Array, "T K"],
    v: Float[Array, "T V"],
    log_alpha: Float[Array, "T K"],
    beta: Float[Array, " T"],
    *,
    scale: float | None = None,
    initial_state: Float[Array, "V K"] | None = None,
) -> tuple[Float[Array, "T V"], Float[Array, "V K"]]:
    """Kimi Delta Attention for one head and one sequence, one token at a time.

    For ``t = 1..T``: ``S_t = S_{t-1} Diag(alpha_t) + beta_t (v_t - S_{t-1} Diag(alpha_t) k_t)
    k_t^T`` and ``y_t = S_t (scale q_t)``, with ``alpha_t = exp(log_alpha_t)`` per key channel
    and ``S_0 = initial_state`` (zeros when ``None``).

    Args:
      q, k: ``[T, K]``; v: ``[T, V]``; all three in one floating dtype.
      log_alpha: ``[T, K]`` decay gates in log space (``<= 0``), one per key channel.
      beta: ``[T]`` writing strengths, already activated.
      scale: query scale; ``None`` means ``K ** -0.5``.
      initial_state: ``[V, K]`` or ``None``.

    Returns:
      ``(y [T, V], final_state [V, K])``: ``y`` in the input dtype, the state in float32
      (float64 for float64 input).
    """
    return checked_single_head(
        "kda_recurrent", recurrent_rule, q, k, v, log_alpha, beta, initial_state,
        scale=scale, per_channel=True,
    )  # fmt: skip
