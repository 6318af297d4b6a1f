"""The gated delta rule chunk by chunk, in stages: only the state recurrence is sequential.

For chunks of ``C`` tokens, with ``g`` the summed log-decay from a chunk's start (Yang et
al., 2025, Sec. 3.3; flash-linear-attention's ``chunk_gated_delta_rule`` has the same stages):

1. Decays and WY factors of every chunk (``decays.py``, ``wy.py``): the corrections a chunk
   writes are ``U = u - w S^T`` for its start state ``S``.
2. The state pass, a scan over chunks with every product that touches a state, two per chunk
   (``w`` and the queries read the state together):

       [w S^T; diag(exp(g)) Q S^T] = [w; diag(exp(g)) Q] S^T,
       U = u - w S^T,     S' = exp(g_C) S + U^T diag(exp(g_C - g)) K.

3. The outputs of every chunk: ``Y = diag(exp(g)) Q S^T + (Q K^T * Gamma) U`` with
   ``Gamma_ti = exp(g_t - g_i)`` for ``i <= t``.

The backward is written by hand in the same stages. One reverse scan carries the state's
cotangent, ``dS = exp(g_C) dS' + dY^T diag(exp(g)) Q - dU^T w`` with ``dU = (Q K^T *
Gamma)^T dY + diag(exp(g_C - g)) K dS'^T``, and forms the products with each chunk's start
state there (``dY S``, ``dw = -dU S``, ``U dS'``), so only token-sized arrays leave it; every
input's gradient then follows chunk by chunk. Between the forward and the backward only the
inputs and each chunk's start state are kept.

Stages 1 and 3 and the gradients run either hoisted out of the scan and batched over all
chunks (``"hoisted"``: only state-sized products inside the loop, the shape GPUs and TPUs
need) or inside the scan, one chunk per step (``"in_scan"``: faster on CPU, where a chunk's
intermediates then stay in cache). Both compose the same per-chunk functions.

A NaN or inf goes further back than in the recurrent form, to the start of its chunk. A NaN
in k, v, log_alpha or beta at token t reaches the recurrent outputs from t on, but the
chunked ones from the start of t's chunk on: the in-chunk products are dense matmuls (the
segment sums, ``T [k | v]``, ``(Q K^T * Gamma) U``) in which the exact zeros of the causal
structure multiply it, and 0 * NaN = NaN. Selecting with ``where`` before the products does
not help, since the zeros meet the NaN inside the matmul; only per-row masked products,
``C`` times the work, would. A NaN in q reaches ``y_t`` alone in both forms; outputs before
t's chunk and the other sequences of a packed batch are never touched
(``tests/test_edges.py`` checks this extent).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple, no_type_check

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from gdn_jax.ops import checks
from gdn_jax.ops.blocks import scan_blocks, scan_blocks_backward
from gdn_jax.ops.decays import LOG_ALPHA_FLOOR, ChunkDecays, chunk_decays, chunk_decays_bwd
from gdn_jax.ops.step import core_inputs
from gdn_jax.ops.varlen import pack_layout
from gdn_jax.ops.wy import DELTA, WriteRule

over_chunks = jax.vmap


def state_step(
    state: Float[Array, "V K"],
    w: Float[Array, "C K"] | None,
    u: Float[Array, "C V"],
    k_to_end: Float[Array, "C K"],
    whole: Float[Array, ""] | Float[Array, " K"],
    q_from_start: Float[Array, "C K"],
):
    """One chunk of the state pass, with every product that touches the state.

    ``(S [V, K], w [C, K] or None, u [C, V], K diag(exp(g_C - g)) [C, K], exp(g_C),
    diag(exp(g)) Q [C, K]) -> (S' [V, K], (U [C, V] or (), diag(exp(g)) Q S^T [C, V]))``.
    ``w`` and the queries read the state in one product. A per-channel ``exp(g_C) [K]``
    (KDA, ``kda_chunkwise.py``) decays the state as ``S Diag(exp(g_C))``.
    """
    decayed = jnp.atleast_1d(whole)[None, :] * state  # [1, 1] or [1, K] against [V, K]
    if w is None:
        return decayed + u.T @ k_to_end, ((), q_from_start @ state.T)
    chunk = w.shape[0]
    reads = jnp.concatenate([w, q_from_start]) @ state.T
    corrections = u - reads[:chunk]
    return decayed + corrections.T @ k_to_end, (corrections, reads[chunk:])


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


def chunk_output(
    q: Float[Array, "C K"],
    k: Float[Array, "C K"],
    decays: ChunkDecays,
    corrections: Float[Array, "C V"],
    y_start: Float[Array, "C V"],
) -> Float[Array, "C V"]:
    """``Y [C, V]`` of one chunk: its read of the start state plus the causal intra-chunk
    part."""
    attn_CxC = (q @ k.T) * decays.within
    return y_start + attn_CxC @ corrections


def chunk_grads(rule: WriteRule, q, k, v, beta, decays, factors, qk, d):
    """Gradients of one chunk's q, k, v, beta and log_alpha from ``q k^T`` and what the
    reverse state pass returned, ``d = (dY, U, dU, dY S, dw, d(K diag(exp(g_C - g))),
    d exp(g_C))``."""
    d_y, corrections, d_u, d_y_start, d_w, d_k_to_end, d_whole = d
    d_y_u = d_y @ corrections.T
    d_attn = d_y_u * decays.within
    grads = rule.factors_bwd(k, v, beta, decays, factors, d_w, d_u)
    d_q = d_y_start * decays.from_start[:, None] + d_attn @ k
    d_k = d_attn.T @ q + d_k_to_end * decays.to_end[:, None] + grads.k
    if grads.gram is not None:
        d_k = d_k + (grads.gram + grads.gram.T) @ k
    d_decays = ChunkDecays(
        within=d_y_u * qk + grads.within,
        from_start=(d_y_start * q).sum(1) + grads.from_start,
        to_end=(d_k_to_end * k).sum(1),
        whole=d_whole,
    )
    return d_q, d_k, grads.v, grads.beta, chunk_decays_bwd(decays, d_decays)


def chunk_prepare(rule: WriteRule, q, k, v, log_alpha, beta):
    """Stage 1 for one chunk: decays, WY factors, and the keys and queries decayed to the
    chunk's end and from its start."""
    decays = chunk_decays(log_alpha)
    factors = rule.factors(k, v, beta, decays)
    return decays, factors, k * decays.to_end[:, None], q * decays.from_start[:, None]


def chunk_forward(
    rule: WriteRule,
    state: Float[Array, "V K"],
    q: Float[Array, "C K"],
    k: Float[Array, "C K"],
    v: Float[Array, "C V"],
    log_alpha: Float[Array, " C"],
    beta: Float[Array, " C"],
) -> tuple[Float[Array, "V K"], Float[Array, "C V"]]:
    """All three stages for one chunk: ``(S, chunk inputs) -> (S', Y [C, V])``."""
    decays, (w, u, _), k_to_end, q_from_start = chunk_prepare(rule, q, k, v, log_alpha, beta)
    new_state, (corrections, y_start) = state_step(
        state, w, u, k_to_end, decays.whole, q_from_start
    )
    corrections = u if w is None else corrections
    return new_state, chunk_output(q, k, decays, corrections, y_start)


def chunk_backward_inputs(rule: WriteRule, q, k, v, log_alpha, beta, d_y):
    """What the reverse state pass needs of one chunk: stage 1 again, ``q k^T`` and the
    cotangent of ``U`` from the chunk's own outputs, ``(Q K^T * Gamma)^T dY``."""
    prepared = chunk_prepare(rule, q, k, v, log_alpha, beta)
    qk = q @ k.T
    return prepared, qk, (qk * prepared[0].within).T @ d_y


def chunk_backward(rule: WriteRule, d_end, start, q, k, v, log_alpha, beta, d_y):
    """The whole backward of one chunk: ``(dS', S, chunk inputs, dY) -> (dS, grads)``."""
    prepared, qk, d_u_intra = chunk_backward_inputs(rule, q, k, v, log_alpha, beta, d_y)
    decays, factors, k_to_end, q_from_start = prepared
    w, u, _ = factors
    d_start, outs = state_step_bwd(
        d_end, start, w, u, k_to_end, decays.whole, q_from_start, d_u_intra, d_y
    )
    return d_start, chunk_grads(rule, q, k, v, beta, decays, factors, qk, (d_y, *outs))


def _hoisted_forward(rule, inputs, initial_states, resets, *, keep_starts):
    q, k = inputs[:2]
    prepare = over_chunks(functools.partial(chunk_prepare, rule))
    decays, (w, u, _), k_to_end, q_from_start = prepare(*inputs)
    blocks = (w, u, k_to_end, decays.whole, q_from_start)
    out = scan_blocks(state_step, blocks, initial_states, resets, keep_starts=keep_starts)
    (corrections, y_start), *starts, finals = out
    corrections = u if w is None else corrections
    ys = over_chunks(chunk_output)(q, k, decays, corrections, y_start)
    return ys, finals, starts


def _hoisted_backward(rule, inputs, starts, resets, d_ys, d_finals):
    q, k, v, _, beta = inputs
    backward_inputs = over_chunks(functools.partial(chunk_backward_inputs, rule))
    prepared, qk, d_u_intra = backward_inputs(*inputs, d_ys)
    decays, factors, k_to_end, q_from_start = prepared
    w, u, _ = factors
    xs = (starts, w, u, k_to_end, decays.whole, q_from_start, d_u_intra, d_ys)
    outs, d_initial = scan_blocks_backward(state_step_bwd, xs, d_finals, resets)
    grads = over_chunks(functools.partial(chunk_grads, rule))(
        q, k, v, beta, decays, factors, qk, (d_ys, *outs)
    )
    return grads, d_initial


def _in_scan_forward(rule, inputs, initial_states, resets, *, keep_starts):
    step = functools.partial(chunk_forward, rule)
    ys, *starts, finals = scan_blocks(step, inputs, initial_states, resets, keep_starts=keep_starts)
    return ys, finals, starts


def _in_scan_backward(rule, inputs, starts, resets, d_ys, d_finals):
    step = functools.partial(chunk_backward, rule)
    return scan_blocks_backward(step, (starts, *inputs, d_ys), d_finals, resets)


# Where each chunk's own work runs: hoisted out of the scan over chunks and batched over all
# chunks (the accelerator shape: only state-sized products inside the loop), or inside the
# scan, chunk by chunk, which keeps a chunk's intermediates in cache on CPU.
SCHEDULES = {
    "hoisted": (_hoisted_forward, _hoisted_backward),
    "in_scan": (_in_scan_forward, _in_scan_backward),
}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def chunked_core(rule, schedule, q, k, v, log_alpha, beta, initial_states, resets):
    """The chunked form for one head: q, k ``[NC, C, K]`` (q pre-scaled), v ``[NC, C, V]``,
    gates ``[NC, C]``, ``initial_states [N, V, K]``, ``resets`` as in ``blocks.scan_blocks``;
    ``rule`` is ``wy.DELTA`` or ``wy.LINEAR``, ``schedule`` a key of ``SCHEDULES``.

    Returns ``(y [NC, C, V], finals [N, V, K])``.
    """
    forward, _ = SCHEDULES[schedule]
    inputs = (q, k, v, log_alpha, beta)
    ys, finals, _ = forward(rule, inputs, initial_states, resets, keep_starts=False)
    return ys, finals


def _chunked_core_fwd(rule, schedule, q, k, v, log_alpha, beta, initial_states, resets):
    forward, _ = SCHEDULES[schedule]
    inputs = (q, k, v, log_alpha, beta)
    ys, finals, (starts,) = forward(rule, inputs, initial_states, resets, keep_starts=True)
    return (ys, finals), (inputs, starts, resets)


def _chunked_core_bwd(rule, schedule, residuals, cotangents):
    _, backward = SCHEDULES[schedule]
    inputs, starts, resets = residuals
    (d_q, d_k, d_v, d_beta, d_log_alpha), d_initial = backward(
        rule, inputs, starts, resets, *cotangents
    )
    return d_q, d_k, d_v, d_log_alpha, d_beta, d_initial, None


chunked_core.defvjp(_chunked_core_fwd, _chunked_core_bwd)

# What "auto" means on each platform the program is lowered for (``jax.lax.platform_dependent``
# keys): in the scan on CPU, where it measured faster (docs/benchmarks.md), hoisted on GPU, TPU
# and anything else.
AUTO_SCHEDULES = {"cpu": "in_scan", "default": "hoisted"}


def run_schedule(schedules: dict[str, Callable], schedule: checks.Schedule, *args):
    """``schedules[schedule](*args)``, with ``"auto"`` resolved by the platform the program
    is lowered for, not the host that traces it (``AUTO_SCHEDULES``): traced on a CPU and
    compiled for a TPU, it is ``"hoisted"``.

    A schedule's forward and backward sit whole inside its branch of
    ``jax.lax.platform_dependent``, so both follow one choice. Both branches are traced; a
    lowering for one platform keeps only that platform's.
    """
    if schedule != "auto":
        return schedules[schedule](*args)
    branches = {platform: schedules[choice] for platform, choice in AUTO_SCHEDULES.items()}
    return jax.lax.platform_dependent(*args, **branches)


def chunked_rule(
    q: Float[Array, "T K"],
    k: Float[Array, "T K"],
    v: Float[Array, "T V"],
    log_alpha: Float[Array, " T"],
    beta: Float[Array, " T"],
    initial_states: Float[Array, "N V K"],
    *,
    chunk_size: int,
    cu_seqlens: Int[Array, " N+1"] | None = None,
    rule: WriteRule = DELTA,
    schedule: checks.Schedule = "auto",
) -> tuple[Float[Array, "T V"], Float[Array, "N V K"]]:
    """Lay the tokens out in chunks, run ``chunked_core`` with ``rule`` and ``schedule``, and
    back; the chunked twin of ``recurrent.recurrent_rule``.

    Arrays are in the compute dtype and ``q`` is pre-scaled: q, k ``[T, K]``, v ``[T, V]``,
    gates ``[T]``, ``initial_states [N, V, K]``. Without ``cu_seqlens`` the tail is padded
    with inert tokens (zero q, k, v and beta, log_alpha 0: no decay, no write); with it each
    packed sequence starts on a chunk boundary (``varlen.pack_layout``).
    Returns ``(y [T, V], finals [N, V, K])``.
    """
    log_alpha = jnp.maximum(log_alpha, LOG_ALPHA_FLOOR)
    layout = chunk_layout(q.shape[0], chunk_size, cu_seqlens)
    chunks = (layout.to_chunks(x) for x in (q, k, v, log_alpha, beta))
    cores = {name: functools.partial(chunked_core, rule, name) for name in SCHEDULES}
    ys, finals = run_schedule(cores, schedule, *chunks, initial_states, layout.resets)
    return layout.from_chunks(ys), finals


class ChunkLayout(NamedTuple):
    """Tokens ``[T, ...]`` to chunks ``[NC, C, ...]`` and outputs ``[NC, C, V]`` back to
    ``[T, V]``, with the resets of ``blocks.scan_blocks`` (None for one sequence)."""

    to_chunks: Callable
    from_chunks: Callable
    resets: tuple | None


def chunk_layout(seq_len: int, chunk_size: int, cu_seqlens=None) -> ChunkLayout:
    """The chunks of one sequence, its tail padded with inert tokens (zero inputs, so zero
    q, k, v, beta and log_alpha: no decay, no write), or of packed ``cu_seqlens``, each
    sequence starting on a chunk boundary (``varlen.pack_layout``)."""
    if cu_seqlens is not None:
        layout = pack_layout(cu_seqlens, seq_len, chunk_size)
        return ChunkLayout(
            lambda x: layout.scatter(x).reshape(-1, chunk_size, *x.shape[1:]),
            lambda y: layout.gather(y.reshape(-1, y.shape[-1])),
            layout.resets,
        )
    num_chunks = -(-seq_len // chunk_size)
    pad = num_chunks * chunk_size - seq_len

    def to_chunks(x):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(num_chunks, chunk_size, *x.shape[1:])

    def from_chunks(y):
        return y.reshape(num_chunks * chunk_size, -1)[:seq_len]

    return ChunkLayout(to_chunks, from_chunks, None)


@no_type_check  # a public entry point: checks.py names its bad arguments
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
    schedule: checks.Schedule = "auto",
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
      schedule: where each chunk's own work runs. ``"hoisted"`` batches it over all chunks
        outside the sequential scan, which then holds only state-sized products (the shape
        accelerators need); ``"in_scan"`` runs it chunk by chunk inside the scan, which keeps
        a chunk's intermediates in cache on CPU; ``"auto"`` is ``"in_scan"`` when compiled for
        CPU and ``"hoisted"`` for any other platform, including a TPU compiled for ahead of
        time from a CPU host. Both compute the same function and gradients.

    Returns:
      ``(y [T, V], final_state [V, K])``: ``y`` in the input dtype, the state in float32
      (float64 for float64 input). A NaN in k, v or a gate at token t makes ``y`` NaN from
      the start of t's chunk on, not from t as in the recurrent form (module docstring).
    """
    fn = "gated_delta_rule_chunked"
    checks.check_single_head(fn, q, k, v, log_alpha, beta, initial_state)
    checks.check_scale(fn, scale)
    checks.check_chunk_size(fn, chunk_size)
    checks.check_schedule(fn, schedule)
    inputs = core_inputs(q, k, v, log_alpha, beta, initial_state, scale)
    y, finals = chunked_rule(*inputs, chunk_size=chunk_size, schedule=schedule)
    return y.astype(v.dtype), finals[0]
