"""One token of Kimi Delta Attention (KDA; Kimi Team, "Kimi Linear", arXiv 2510.26692, Sec. 3).

KDA is the gated delta rule with one decay per key channel instead of one per head:

    S_t = S_{t-1} Diag(alpha_t) + beta_t (v_t - S_{t-1} Diag(alpha_t) k_t) k_t^T,
    y_t = S_t (scale q_t),     alpha_t = exp(log_alpha_t) in (0, 1]^K.

With every channel of ``log_alpha_t`` equal it is the gated delta rule. The arithmetic is
``step.token_step``'s, whose decay broadcasts a ``[K]`` gate along the state's rows.
"""

from __future__ import annotations

from typing import no_type_check

from jaxtyping import Array, Float

from gdn_jax.ops.step import checked_step


@no_type_check  # a public entry point: checks.py names its bad arguments
def kda_step(
    state: Float[Array, "V K"],
    q: Float[Array, " K"],
    k: Float[Array, " K"],
    v: Float[Array, " V"],
    log_alpha: Float[Array, " K"],
    beta: Float[Array, ""],
    *,
    scale: float | None = None,
) -> tuple[Float[Array, "V K"], Float[Array, " V"]]:
    """Advance one head's KDA memory by one token and read it.

    ``S_t = S_{t-1} Diag(alpha_t) + beta_t (v_t - S_{t-1} Diag(alpha_t) k_t) k_t^T``,
    ``y_t = S_t (scale q_t)`` with ``alpha_t = exp(log_alpha_t)`` per key channel. This is
    what a decoder calls per token.

    Args:
      state: memory ``[V, K]`` (flash-linear-attention stores the transpose, ``[K, V]``).
      q, k: query and key ``[K]``.
      v: value ``[V]``; q, k and v share one dtype.
      log_alpha: ``[K]`` decay gates in log space, ``<= 0``, one per key channel.
      beta: scalar writing strength, already activated, as an array or a Python number.
      scale: query scale; ``None`` means ``K ** -0.5``.

    Returns:
      ``(new_state, y)``: the state in float32 (float64 for float64 input) and ``y [V]`` in
      the dtype of ``v``.
    """
    return checked_step("kda_step", state, q, k, v, log_alpha, beta, scale=scale, per_channel=True)
