"""Kimi Delta Attention chunk by chunk, in the stages of ``chunked.py``.

For a chunk of ``C`` tokens starting from state ``S``, with per-channel log-decays ``G_t``
summed from the chunk's start (``channel_decays.py``), token ``t``'s state is
``S_t = S Diag(exp(G_t)) + sum_{i <= t} U_i (k_i * exp(G_t - G_i))^T`` for the corrections
``U_i = beta_i (v_i - S_{i-1} Diag(alpha_i) k_i)`` it writes. Substituting gives, as for the
gated delta rule (``wy.py``) but with the decays inside the channel sums:

1. Decays and WY factors of every chunk: ``(I + A) U = diag(beta) V - diag(beta) (K *
   exp(G)) S^T`` with ``A_ti = beta_t sum_c k_tc k_ic exp(G_tc - G_ic)`` for ``i < t``, so for
   ``T = (I + A)^{-1}``: ``U = u - w S^T``, ``u = T diag(beta) V``, ``w = T diag(beta) (K *
   exp(G))``. The intra-chunk scores ``A`` and ``Q K^T``-with-decays come from
   ``channel_decays.channel_scores``, which no gate can overflow.
2. The state pass, the only sequential part (``chunked.state_step``):
   ``[w; Q * exp(G)] S^T``, ``U = u - w S^T``,
   ``S' = S Diag(exp(G_C)) + U^T (K * exp(G_C - G))``.
3. The outputs: ``Y = (Q * exp(G)) S^T + M U`` with ``M_ti = sum_c q_tc k_ic exp(G_tc -
   G_ic)`` for ``i <= t``.

The backward is JAX's autodiff of these stages with each chunk's work rematerialised
(``jax.checkpoint``): between the forward and the backward only the inputs and one ``[V, K]``
state per chunk are kept, and the backward recomputes a chunk's stages 1 and 3 from its start
state. ``"in_scan"`` checkpoints each chunk's step inside the scan; ``"hoisted"`` batches
stages 1 and 3 over all chunks outside the scan (the accelerator shape) and checkpoints the
whole, so its backward reruns the forward once. On CPU (``"in_scan"``) this costs 1.8x the
gated delta rule's hand-derived backward in time and 1.1x in memory; the hoisted schedule's
backward holds every chunk's intermediates at once, 2.7x (docs/benchmarks.md, KDA).

As in ``chunked.py``, a NaN in k, v, log_alpha or beta reaches the outputs from the start of
its chunk on, not from its token on as in the recurrent form; one in q reaches its own output
alone.
"""

from __future__ import annotations

from typing import no_type_check

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from gdn_jax.ops import checks
from gdn_jax.ops.blocks import scan_blocks
from gdn_jax.ops.channel_decays import channel_decays, channel_scores
from gdn_jax.ops.chunked import chunk_layout, run_schedule, state_step
from gdn_jax.ops.decays import LOG_ALPHA_FLOOR
from gdn_jax.ops.step import checked_single_head
from gdn_jax.ops.triangular import unit_lower_inverse


def chunk_prepare(
    q: Float[Array, "C K"],
    k: Float[Array, "C K"],
    v: Float[Array, "C V"],
    log_alpha: Float[Array, "C K"],
    beta: Float[Array, " C"],
):
    """Stage 1 for one chunk: ``(w [C, K], u [C, V], exp(G) [C, K], exp(G_C - G) [C, K],
    exp(G_C) [K], M [C, C])``, ``M`` the decayed causal query-key scores."""
    # -inf gates become full resets that keep the segment sums' matmuls free of inf * 0.
    # Clamped here, inside the rematerialised work, the clamp's mask is not kept for the
    # backward either.
    decays = channel_decays(jnp.maximum(log_alpha, LOG_ALPHA_FLOOR))
    q_scores, k_scores = channel_scores(q, k, decays), channel_scores(k, k, decays)
    inverse = unit_lower_inverse(jnp.tril(beta[:, None] * k_scores, -1))
    k_beta = k * decays.from_start * beta[:, None]
    w, u = jnp.split(inverse @ jnp.concatenate([k_beta, v * beta[:, None]], 1), [k.shape[1]], 1)
    return w, u, decays.from_start, decays.to_end, decays.whole, q_scores


def chunk_forward(
    state: Float[Array, "V K"],
    q: Float[Array, "C K"],
    k: Float[Array, "C K"],
    v: Float[Array, "C V"],
    log_alpha: Float[Array, "C K"],
    beta: Float[Array, " C"],
) -> tuple[Float[Array, "V K"], Float[Array, "C V"]]:
    """All three stages for one chunk: ``(S, chunk inputs) -> (S', Y [C, V])``."""
    w, u, *decays, scores = chunk_prepare(q, k, v, log_alpha, beta)
    new_state, (corrections, y_start) = state_step(state, w, u, k, q, *decays)
    return new_state, y_start + scores @ corrections


def in_scan(inputs, initial_states, resets):
    """Each chunk's stages inside the scan over chunks, rematerialised in the backward."""
    return scan_blocks(jax.checkpoint(chunk_forward), inputs, initial_states, resets)


@jax.checkpoint
def hoisted(inputs, initial_states, resets):
    """Stages 1 and 3 batched over all chunks around a scan of state-sized products; the
    backward reruns this forward rather than keep its ``[NC, C, C]`` intermediates."""
    w, u, *decays, scores = jax.vmap(chunk_prepare)(*inputs)
    blocks = (w, u, inputs[1], inputs[0], *decays)
    (corrections, y_start), finals = scan_blocks(state_step, blocks, initial_states, resets)
    return y_start + scores @ corrections, finals


SCHEDULES = {"hoisted": hoisted, "in_scan": in_scan}


def kda_chunked_rule(
    q: Float[Array, "T K"],
    k: Float[Array, "T K"],
    v: Float[Array, "T V"],
    log_alpha: Float[Array, "T K"],
    beta: Float[Array, " T"],
    initial_states: Float[Array, "N V K"],
    *,
    chunk_size: int,
    cu_seqlens: Int[Array, " N+1"] | None = None,
    schedule: checks.Schedule = "auto",
) -> tuple[Float[Array, "T V"], Float[Array, "N V K"]]:
    """KDA's twin of ``chunked.chunked_rule``: the same layout (padded tail, or packed
    sequences each from a chunk boundary) and contract (``q`` unscaled; q, k and v in the
    compute dtype or narrower, cast here), gates ``[T, K]``. Returns ``(y [T, V], finals [N,
    V, K])``."""
    q, k, v = (x.astype(initial_states.dtype) for x in (q, k, v))
    layout = chunk_layout(q.shape[0], chunk_size, cu_seqlens)
    chunks = tuple(layout.to_chunks(x) for x in (q, k, v, log_alpha, beta))
    ys, finals = run_schedule(SCHEDULES, schedule, chunks, initial_states, layout.resets)
    return layout.from_chunks(ys), finals


@no_type_check  # a public entry point: checks.py names its bad arguments
def kda_chunked(
    q: Float[Array, "T K"],
    k: Float[Array, "T K"],
    v: Float[Array, "T V"],
    log_alpha: Float[Array, "T K"],
    beta: Float[Array, " T"],
    *,
    scale: float | None = None,
    initial_state: Float[Array, "V K"] | None = None,
    chunk_size: int = 64,
    schedule: checks.Schedule = "auto",
) -> tuple[Float[Array, "T V"], Float[Array, "V K"]]:
    """Kimi Delta Attention for one head and one sequence, chunkwise; the contract of
    ``kda_recurrent``.

    Any ``T >= 1`` works (the tail chunk is padded with tokens that neither decay nor write).
    Gradients reach every input; the backward keeps the inputs and one ``[V, K]`` state per
    chunk and recomputes the rest chunk by chunk (module docstring).

    Args:
      q, k: ``[T, K]``; v: ``[T, V]``; all three in one floating dtype.
      log_alpha: ``[T, K]`` decay gates in log space (``<= 0``; ``-inf`` resets a channel).
      beta: ``[T]`` writing strengths, already activated.
      scale: query scale; ``None`` means ``K ** -0.5``.
      initial_state: ``[V, K]`` or ``None`` (zeros).
      chunk_size: ``C``, one of 16, 32, 64, 128.
      schedule: ``"hoisted"``, ``"in_scan"`` or ``"auto"``, as in ``gated_delta_rule_chunked``.

    Returns:
      ``(y [T, V], final_state [V, K])``: ``y`` in the input dtype, the state in float32
      (float64 for float64 input).
    """
    fn = "kda_chunked"
    chunk_size = checks.check_chunk_size(fn, chunk_size)
    checks.check_schedule(fn, schedule)
    return checked_single_head(
        fn, kda_chunked_rule, q, k, v, log_alpha, beta, initial_state,
        scale=scale, per_channel=True, chunk_size=chunk_size, schedule=schedule,
    )  # fmt: skip
