"""The gated delta rule chunk by chunk: matmuls inside a chunk, a scan across chunks.

Inside a chunk of ``C`` tokens starting from state ``S`` (Yang et al., 2025, Sec. 3.3),
write ``g_t`` for the summed log-decay from the chunk start through token ``t`` and
``u_t = beta_t (v_t - alpha_t S_{t-1} k_t)`` for the correction each token writes, so that
``S_t = exp(g_t) S + sum_{i<=t} exp(g_t - g_i) u_i k_i^T``. Substituting ``S_{t-1}`` into
``u_t`` gives a unit lower-triangular system for all corrections at once (the UT / WY
transform):

    (I + A) U = diag(beta) (V - diag(exp(g)) K S^T),  A_ti = beta_t exp(g_t - g_i) k_t.k_i, i < t

and then

    Y = (Q K^T * Gamma) U + diag(exp(g)) Q S^T,        Gamma_ti = exp(g_t - g_i), i <= t
    S' = exp(g_C) S + (diag(exp(g_C - g)) U)^T K.

Decays between tokens come from segment sums of ``log_alpha`` (summed over ``(i, t]``
directly, as Mamba-2 does) rather than from differences of a running sum, whose float32
cancellation loses the small gaps after a large one (``log_alpha = -1e4``, then ``-0.01``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from gdn_jax.ops import _checks
from gdn_jax.ops.blocks import scan_blocks, scan_blocks_backward
from gdn_jax.ops.step import core_inputs
from gdn_jax.ops.triangular import unit_lower_inverse


def segment_sums(log_alpha: Float[Array, " C"]) -> Float[Array, "C+1 C+1"]:
    """``L[a, b] = sum(x[b+1 : a+1])`` for ``a >= b`` over ``x = [0, *log_alpha]``, else 0.

    Row and column 0 stand for the chunk start, so ``L[t+1, i+1]`` is the log-decay from
    token ``i`` to token ``t``, ``L[t+1, 0]`` from the start to ``t`` and ``L[C, i+1]`` from
    ``i`` to the end. Entries above the diagonal are 0, so their ``exp`` cannot overflow.
    """
    x = jnp.concatenate([jnp.zeros((1,), log_alpha.dtype), log_alpha])
    lower = jnp.tril(jnp.ones((x.shape[0],) * 2, log_alpha.dtype))
    # A cumulative sum down the columns of the masked [C+1, C+1] matrix, as a product with a
    # lower-triangular matrix of ones: XLA's CPU cumsum (a reduce_window) took 1.8x as long.
    # HIGHEST keeps TPU and GPU from rounding the log-decays to bf16 or tf32.
    masked = jnp.where(jnp.tril(lower, -1) > 0, x[:, None], 0)
    return jnp.matmul(lower, masked, precision=jax.lax.Precision.HIGHEST)


def chunk_decays(log_alpha):
    """Decays inside a chunk from ``log_alpha [C]``: token-to-token ``[C, C]`` (zero above the
    diagonal), chunk start to each token ``[C]``, each token to chunk end ``[C]``, and the
    whole chunk (a scalar)."""
    chunk = log_alpha.shape[0]
    seg = segment_sums(log_alpha)
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    decay_CxC = jnp.where(causal, jnp.exp(seg[1:, 1:]), 0)
    return decay_CxC, jnp.exp(seg[1:, 0]), jnp.exp(seg[chunk, 1:]), jnp.exp(seg[chunk, 0])


def chunk_step(state, q, k, v, log_alpha, beta):
    """Advance ``state [V, K]`` over one chunk and read it.

    q, k ``[C, K]`` (q pre-scaled), v ``[C, V]``, gates ``[C]``. Returns
    ``(new_state [V, K], y [C, V])``.
    """
    decay_CxC, from_start, to_end, chunk_decay = chunk_decays(log_alpha)
    a_CxC = jnp.tril(beta[:, None] * (k @ k.T) * decay_CxC, -1)
    rhs_CxV = beta[:, None] * (v - from_start[:, None] * (k @ state.T))
    u_CxV = unit_lower_inverse(a_CxC) @ rhs_CxV
    y = ((q @ k.T) * decay_CxC) @ u_CxV + from_start[:, None] * (q @ state.T)
    new_state = chunk_decay * state + (u_CxV * to_end[:, None]).T @ k
    return new_state, y


def linear_chunk_step(state, q, k, v, log_alpha, beta):
    """``chunk_step`` without the delta correction: each token writes ``u_t = beta_t v_t``,
    so no triangular system is solved (gated linear attention, Mamba-2's SSD form)."""
    decay_CxC, from_start, to_end, chunk_decay = chunk_decays(log_alpha)
    u_CxV = beta[:, None] * v
    y = ((q @ k.T) * decay_CxC) @ u_CxV + from_start[:, None] * (q @ state.T)
    new_state = chunk_decay * state + (u_CxV * to_end[:, None]).T @ k
    return new_state, y


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def chunked_core(step, q, k, v, log_alpha, beta, initial_states, resets):
    """Scan ``step`` (``chunk_step`` or ``linear_chunk_step``) over chunks: q, k ``[N, C, K]``,
    v ``[N, C, V]``, gates ``[N, C]``, ``initial_states [M, V, K]``, ``resets`` as in
    ``blocks.scan_blocks``.

    Returns ``(y [N, C, V], finals [M, V, K])``. The custom VJP keeps the inputs and one state
    per chunk, and recomputes each chunk inside the reverse scan. Preparing the state-free
    part of all chunks at once, outside the scan, measured slower on CPU: XLA's batched
    matmuls over thousands of small matrices ran at 15 GFLOP/s, against 45 for one chunk's
    heads at a time.
    """
    return scan_blocks(step, (q, k, v, log_alpha, beta), initial_states, resets)


def _chunked_core_fwd(step, q, k, v, log_alpha, beta, initial_states, resets):
    blocks = (q, k, v, log_alpha, beta)
    ys, starts, finals = scan_blocks(step, blocks, initial_states, resets, keep_starts=True)
    return (ys, finals), (blocks, starts, initial_states, resets)


def _chunked_core_bwd(step, residuals, cotangents):
    blocks, starts, initial_states, resets = residuals
    d_ys, d_finals = cotangents
    d_blocks, d_initial = scan_blocks_backward(
        step, blocks, starts, initial_states, resets, d_ys, d_finals
    )
    return (*d_blocks, d_initial, None)


chunked_core.defvjp(_chunked_core_fwd, _chunked_core_bwd)


def chunked_rule(
    q, k, v, log_alpha, beta, initial_states, *, chunk_size, layout=None, step=chunk_step
):
    """Chunk the tokens, run ``chunked_core`` with ``step``, unchunk.

    Arrays are in the compute dtype and ``q`` is pre-scaled: q, k ``[T, K]``, v ``[T, V]``,
    gates ``[T]``, ``initial_states [M, V, K]``. Without ``layout`` the tail is padded with
    inert tokens (zero q, k, v and beta, log_alpha 0: no decay, no write); with a
    ``varlen.PackedLayout`` each packed sequence starts on a chunk boundary.
    Returns ``(y [T, V], finals [M, V, K])``.
    """
    seq_len = q.shape[0]
    if layout is None:
        num_chunks = -(-seq_len // chunk_size)
        pad = num_chunks * chunk_size - seq_len

        def to_chunks(x):
            x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
            return x.reshape(num_chunks, chunk_size, *x.shape[1:])

        def from_chunks(y):
            return y.reshape(num_chunks * chunk_size, -1)[:seq_len]

        resets = None
    else:

        def to_chunks(x):
            return layout.scatter(x).reshape(-1, chunk_size, *x.shape[1:])

        def from_chunks(y):
            return layout.gather(y.reshape(-1, y.shape[-1]))

        resets = layout.resets
    ys, finals = chunked_core(
        step, *(to_chunks(x) for x in (q, k, v, log_alpha, beta)), initial_states, resets
    )
    return from_chunks(ys), finals


def gated_delta_rule_chunked(
    q: Float[Array, "T K"],
    k: Float[Array, "T K"],
    v: Float[Array, "T V"],
    log_alpha: Float[Array, " T"],
    beta: Float[Array, " T"],
    *,
    scale: float | None = None,
    initial_state: Float[Array, "V K"] | None = None,
    chunk_size: int = 64,
) -> tuple[Float[Array, "T V"], Float[Array, "V K"]]:
    """One head, one sequence, chunkwise; the same contract as ``gated_delta_rule_recurrent``.

    Any ``T >= 1`` works (the tail chunk is padded with tokens that neither decay nor write).
    Gradients reach q, k, v, log_alpha, beta and initial_state through a custom VJP that
    stores the inputs and one ``[V, K]`` state per chunk, never one per token.

    Args:
      q, k: ``[T, K]``; v: ``[T, V]``; all three in one floating dtype.
      log_alpha: ``[T]`` decay gates in log space (``<= 0``).
      beta: ``[T]`` writing strengths, already activated.
      scale: query scale; ``None`` means ``K ** -0.5``.
      initial_state: ``[V, K]`` or ``None`` (zeros).
      chunk_size: ``C``, one of 16, 32, 64, 128.

    Returns:
      ``(y [T, V], final_state [V, K])``: ``y`` in the input dtype, the state in float32
      (float64 for float64 input).
    """
    fn = "gated_delta_rule_chunked"
    _checks.check_single_head(fn, q, k, v, log_alpha, beta, initial_state)
    _checks.check_chunk_size(fn, chunk_size)
    inputs = core_inputs(q, k, v, log_alpha, beta, initial_state, scale)
    y, finals = chunked_rule(*inputs, chunk_size=chunk_size)
    return y.astype(v.dtype), finals[0]
