"""The gated delta rule chunk by chunk, in stages: only the state recurrence is sequential.

For chunks of ``C`` tokens, with ``g`` the summed log-decay from a chunk's start (Yang et
al., 2025, Sec. 3.3; flash-linear-attention's ``chunk_gated_delta_rule`` has the same stages):

1. Decays and WY factors, for all chunks at once (``decays.py``, ``wy.py``): the corrections
   a chunk writes are ``U = u - w S^T`` for its start state ``S``.
2. The state pass, the only scan, two state-sized matmuls per chunk:

       U = u - w S^T,     S' = exp(g_C) S + U^T diag(exp(g_C - g)) K.

3. The outputs of all chunks at once from their start states:

       Y = diag(exp(g)) Q S^T + (Q K^T * Gamma) U,     Gamma_ti = exp(g_t - g_i), i <= t.

The backward is written by hand in the same stages: the cotangents of ``U`` and of each
chunk's end state come from one reverse scan over chunks, ``dU = (Q K^T * Gamma)^T dY +
diag(exp(g_C - g)) K dS'^T`` and ``dS = exp(g_C) dS' + dY^T diag(exp(g)) Q - dU^T w``, and
every input's gradient then follows for all chunks at once. Between the forward and the
backward only the inputs and each chunk's start state are kept.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from gdn_jax.ops import _checks
from gdn_jax.ops.blocks import scan_blocks, scan_blocks_backward
from gdn_jax.ops.decays import LOG_ALPHA_FLOOR, ChunkDecays, chunk_decays, chunk_decays_bwd
from gdn_jax.ops.step import core_inputs
from gdn_jax.ops.wy import DELTA, WriteRule

over_chunks = jax.vmap


def state_step(state, w, u, k_to_end, whole, q_from_start):
    """One chunk of the state pass, with every product that touches the state.

    ``(S [V, K], w [C, K] or None, u [C, V], K diag(exp(g_C - g)) [C, K], exp(g_C),
    diag(exp(g)) Q [C, K]) -> (S' [V, K], (U [C, V] or (), diag(exp(g)) Q S^T [C, V]))``.
    ``w`` and the queries read the state in one product.
    """
    if w is None:
        return whole * state + u.T @ k_to_end, ((), q_from_start @ state.T)
    chunk = w.shape[0]
    reads = jnp.concatenate([w, q_from_start]) @ state.T
    corrections = u - reads[:chunk]
    return whole * state + corrections.T @ k_to_end, (corrections, reads[chunk:])


def state_step_bwd(d_end, start, w, u, k_to_end, whole, q_from_start, d_u_intra, d_y):
    """Pullback of ``state_step`` for one chunk, given its start state.

    ``d_end`` is the cotangent of the chunk's end state and ``d_u_intra`` that of ``U`` from
    the chunk's own outputs. Returns the start state's cotangent and the token-sized
    ``(U, dU, dY S, dw, d(K diag(exp(g_C - g))), d exp(g_C))``.
    """
    d_u = d_u_intra + k_to_end @ d_end.T
    if w is None:
        corrections, d_y_start = u, d_y @ start
        d_start = whole * d_end + d_y.T @ q_from_start
        d_w = ()
    else:
        corrections = u - w @ start.T
        cotangents = jnp.concatenate([d_y, -d_u])
        d_start = whole * d_end + cotangents.T @ jnp.concatenate([q_from_start, w])
        d_y_start, d_w = jnp.split(cotangents @ start, 2)
    d_k_to_end = corrections @ d_end
    outs = (corrections, d_u, d_y_start, d_w, d_k_to_end, (d_end * start).sum())
    return d_start, outs


def chunk_output(q, k, decays: ChunkDecays, corrections, y_start):
    """``Y [C, V]`` of one chunk: its read of the start state plus the causal intra-chunk
    part."""
    attn_CxC = (q @ k.T) * decays.within
    return y_start + attn_CxC @ corrections


def chunk_grads(rule: WriteRule, q, k, v, beta, decays, factors, d):
    """Gradients of one chunk's q, k, v, beta and log_alpha from what the reverse state
    pass returned, ``d = (dY, U, dU, dY S, dw, d(K diag(exp(g_C - g))), d exp(g_C))``."""
    d_y, corrections, d_u, d_y_start, d_w, d_k_to_end, d_whole = d
    d_y_u = d_y @ corrections.T
    d_attn = d_y_u * decays.within
    grads = rule.factors_bwd(k, v, beta, decays, factors, d_w, d_u)
    d_q = d_y_start * decays.from_start[:, None] + d_attn @ k
    d_k = d_attn.T @ q + d_k_to_end * decays.to_end[:, None] + grads.k
    d_decays = ChunkDecays(
        within=d_y_u * (q @ k.T) + grads.within,
        from_start=(d_y_start * q).sum(1) + grads.from_start,
        to_end=(d_k_to_end * k).sum(1),
        whole=d_whole,
    )
    return d_q, d_k, grads.v, grads.beta, chunk_decays_bwd(decays, d_decays)


def _prepare(rule, q, k, v, log_alpha, beta):
    """Stage 1 for ``N`` chunks: decays, WY factors, and the keys and queries decayed to
    the chunk's end and from its start."""
    decays = over_chunks(chunk_decays)(log_alpha)
    factors = over_chunks(rule.factors)(k, v, beta, decays)
    k_to_end = k * decays.to_end[..., None]
    q_from_start = q * decays.from_start[..., None]
    return decays, factors, k_to_end, q_from_start


def _staged_forward(rule, q, k, v, log_alpha, beta, initial_states, resets, *, keep_starts):
    decays, (w, u, _), k_to_end, q_from_start = _prepare(rule, q, k, v, log_alpha, beta)
    blocks = (w, u, k_to_end, decays.whole, q_from_start)
    out = scan_blocks(state_step, blocks, initial_states, resets, keep_starts=keep_starts)
    (corrections, y_start), *starts, finals = out
    corrections = u if w is None else corrections
    ys = over_chunks(chunk_output)(q, k, decays, corrections, y_start)
    return ys, finals, starts


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def chunked_core(rule, q, k, v, log_alpha, beta, initial_states, resets):
    """The staged chunked form for one head: q, k ``[N, C, K]`` (q pre-scaled), v ``[N, C,
    V]``, gates ``[N, C]``, ``initial_states [M, V, K]``, ``resets`` as in
    ``blocks.scan_blocks``; ``rule`` is ``wy.DELTA`` or ``wy.LINEAR``.

    Returns ``(y [N, C, V], finals [M, V, K])``.
    """
    args = (rule, q, k, v, log_alpha, beta, initial_states, resets)
    ys, finals, _ = _staged_forward(*args, keep_starts=False)
    return ys, finals


def _chunked_core_fwd(rule, q, k, v, log_alpha, beta, initial_states, resets):
    args = (rule, q, k, v, log_alpha, beta, initial_states, resets)
    ys, finals, (starts,) = _staged_forward(*args, keep_starts=True)
    return (ys, finals), (q, k, v, log_alpha, beta, starts, resets)


def _chunked_core_bwd(rule, residuals, cotangents):
    q, k, v, log_alpha, beta, starts, resets = residuals
    d_ys, d_finals = cotangents
    decays, factors, k_to_end, q_from_start = _prepare(rule, q, k, v, log_alpha, beta)
    w, u, _ = factors
    attn = jnp.einsum("nck,nik->nci", q, k) * decays.within
    d_u_intra = jnp.einsum("nci,ncv->niv", attn, d_ys)
    xs = (starts, w, u, k_to_end, decays.whole, q_from_start, d_u_intra, d_ys)
    outs, d_initial = scan_blocks_backward(state_step_bwd, xs, d_finals, resets)
    d_q, d_k, d_v, d_beta, d_log_alpha = over_chunks(functools.partial(chunk_grads, rule))(
        q, k, v, beta, decays, factors, (d_ys, *outs)
    )
    return d_q, d_k, d_v, d_log_alpha, d_beta, d_initial, None


chunked_core.defvjp(_chunked_core_fwd, _chunked_core_bwd)


def chunked_rule(q, k, v, log_alpha, beta, initial_states, *, chunk_size, layout=None, rule=DELTA):
    """Chunk the tokens, run ``chunked_core`` with ``rule``, unchunk.

    Arrays are in the compute dtype and ``q`` is pre-scaled: q, k ``[T, K]``, v ``[T, V]``,
    gates ``[T]``, ``initial_states [M, V, K]``. Without ``layout`` the tail is padded with
    inert tokens (zero q, k, v and beta, log_alpha 0: no decay, no write); with a
    ``varlen.PackedLayout`` each packed sequence starts on a chunk boundary.
    Returns ``(y [T, V], finals [M, V, K])``.
    """
    seq_len = q.shape[0]
    log_alpha = jnp.maximum(log_alpha, LOG_ALPHA_FLOOR)
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
        rule, *(to_chunks(x) for x in (q, k, v, log_alpha, beta)), initial_states, resets
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
    Gradients reach q, k, v, log_alpha, beta and initial_state through a hand-written VJP
    that stores the inputs and one ``[V, K]`` state per chunk, never one per token.

    Args:
      q, k: ``[T, K]``; v: ``[T, V]``; all three in one floating dtype.
      log_alpha: ``[T]`` decay gates in log space (``<= 0``; ``-inf`` is a full reset).
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
