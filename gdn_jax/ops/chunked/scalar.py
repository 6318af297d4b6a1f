"""The gated delta rule chunk by chunk, in stages: only the state recurrence is sequential.

For chunks of ``C`` tokens, with ``g`` the summed log-decay from a chunk's start (Yang et
al., 2025, Sec. 3.3; flash-linear-attention's ``chunk_gated_delta_rule`` has the same stages):

1. Decays and WY factors of every chunk (``chunked/decays.py``, ``chunked/wy.py``): the corrections a chunk
   writes are ``U = u - w S^T`` for its start state ``S``.
2. The state pass, a scan over chunks with every product that touches a state, two per chunk
   (``w`` and the queries read the state together):

       [w S^T; diag(exp(g)) Q S^T] = [w; diag(exp(g)) Q] S^T,
       U = u - w S^T,     S' = exp(g_C) S + U^T diag(exp(g_C - g)) K.

3. The outputs of every chunk: ``Y = diag(exp(g)) Q S^T + (Q K^T * Gamma) U`` with
   ``Gamma_ti = exp(g_t - g_i)`` for ``i <= t``.

The backward is written by hand in the same stages. One reverse scan carries the state's
cotangent, ``dS = exp(g_C) dS' + dY^T diag(exp(g)) Q - dU^T w`` with ``dU = (Q K^T *
Gamma)^T dY + diag(exp(g_C - g)) K dS'^T``, and forms there the products with the carried
cotangent and ``U = u - w S^T``; only token-sized arrays leave it (``U``, ``dU``, ``U dS'``).
Every input's gradient then follows chunk by chunk, with the products of the cotangents
with the chunk's start state, which need nothing carried (``dY S``, and ``dw = -dU S`` in
the WY backward). Between the forward and the backward only the inputs, in their own dtype,
and each chunk's start state are kept.

Stages 1 and 3 and the gradients run hoisted out of the scan and batched over all chunks
(``"hoisted"``: only state-sized products inside the loop, the shape GPUs and TPUs need),
hoisted with an associative scan over the chunks' state maps in place of the loop
(``"associative"``, ``state_scan.py``: no loop, for GPUs, where a loop launches kernels
every chunk), or inside the scan, one chunk per step (``"in_scan"``: faster on CPU, where a
chunk's intermediates then stay in cache). All three compose the same per-chunk functions.
What the hoisted schedules keep is held down for the accelerators' memory
(docs/benchmarks.md): q, k and v stay in their input dtype until a chunk's work reads them,
the loops decay the keys and queries themselves, and the backward forms its chunks' ``[C,
C]`` matrices other than ``T`` again after its loop instead of keeping them through it.

A NaN or inf goes further back than in the recurrent form, to the start of its chunk. A NaN
in k, v, log_alpha or beta at token t reaches the recurrent outputs from t on, but the
chunked ones from the start of t's chunk on: the in-chunk products are dense matmuls (the
segment sums, ``T k``, ``T v``, ``(Q K^T * Gamma) U``) in which the exact zeros of the causal
structure multiply it, and 0 * NaN = NaN. Selecting with ``where`` before the products does
not help, since the zeros meet the NaN inside the matmul; only per-row masked products,
``C`` times the work, would. A NaN in q reaches ``y_t`` alone in both forms; outputs before
t's chunk and the other sequences of a packed batch are never touched
(``tests/ops/test_edges.py`` checks this extent).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from gdn_jax.ops import checks
from gdn_jax.ops.chunked import stages
from gdn_jax.ops.chunked.blocks import barrier_off_cpu, scan_blocks, scan_blocks_backward
from gdn_jax.ops.chunked.decays import LOG_ALPHA_FLOOR, ChunkDecays, chunk_decays, chunk_decays_bwd
from gdn_jax.ops.chunked.schedules import run_schedule
from gdn_jax.ops.chunked.state_scan import end_cotangents, state_pass_over
from gdn_jax.ops.chunked.varlen import chunk_layout
from gdn_jax.ops.chunked.wy import DELTA, WriteRule

over_chunks = jax.vmap


def cast_to(dtype, *arrays):
    """``arrays`` cast to ``dtype`` (None, and an empty tuple in place of a gate, stay as
    they are): the inputs stay in their own dtype until a chunk's work reads them."""
    return tuple(x if x is None or isinstance(x, tuple) else x.astype(dtype) for x in arrays)


def cast_back(arrays, dtypes):
    """Each of ``arrays`` cast to its own of ``dtypes`` (gradients back to their inputs';
    None and an empty tuple stay as they are)."""
    return tuple(
        x if x is None or isinstance(x, tuple) else x.astype(d)
        for x, d in zip(arrays, dtypes, strict=True)
    )


def dtypes_of(arrays) -> tuple:
    return tuple(x if x is None or isinstance(x, tuple) else x.dtype for x in arrays)


def decayed(
    x: Float[Array, "C K"], decay: Float[Array, " C"] | Float[Array, "C K"]
) -> Float[Array, "C K"]:
    """``x`` in its own dtype times its decays in theirs (the compute dtype): one per row,
    ``diag(decay) x``, or one per entry, KDA's per-channel decays."""
    return x.astype(decay.dtype) * (decay[:, None] if decay.ndim == 1 else decay)


def state_pass(
    state: Float[Array, "V K"],
    w: Float[Array, "C K"] | None,
    u: Float[Array, "C V"],
    k_to_end: Float[Array, "C K"],
    q_from_start: Float[Array, "C K"],
    whole: Float[Array, ""] | Float[Array, " K"],
):
    """One chunk of the state pass, with every product that touches the state.

    ``(S [V, K], w [C, K] or None, u [C, V], K decayed to the chunk's end, Q decayed from its
    start, exp(g_C)) -> (S' [V, K], (U [C, V] or (), diag(exp(g)) Q S^T [C, V]))``. ``w`` and
    the queries read the state in one product. Per-channel decays (KDA and GDN-2,
    ``ops/chunked/channel.py``), ``exp(g_C) [K]``, decay the state as ``S Diag(exp(g_C))``.
    """
    with jax.named_scope(stages.STATE_PASS):
        faded = jnp.atleast_1d(whole)[None, :] * state  # [1, 1] or [1, K] against [V, K]
        if w is None:
            return faded + u.T @ k_to_end, ((), q_from_start @ state.T)
        chunk = w.shape[0]
        reads = jnp.concatenate([w, q_from_start]) @ state.T
        corrections = u - reads[:chunk]
        return faded + corrections.T @ k_to_end, (corrections, reads[chunk:])


def state_pass_bwd(d_end, start, w, u, k_to_end, q_from_start, whole, d_u_intra, d_y):
    """Pullback of ``state_pass`` for one chunk, given its start state.

    ``d_end`` is the cotangent of the chunk's end state and ``d_u_intra`` that of ``U`` from
    the chunk's own outputs. Returns the start state's cotangent and the token-sized ``(U,
    dU, d(K decayed to the end), d exp(g_C))``, the last shaped like ``whole``. The
    cotangents' products with the start state, ``dY S`` and ``dw = -dU S``, need no carried
    state: the chunk's gradients form them.
    """
    with jax.named_scope(stages.STATE_PASS_BACKWARD):
        corrections = u if w is None else u - w @ start.T
        d_u = d_u_intra + k_to_end @ d_end.T
        faded = jnp.atleast_1d(whole)[None, :] * d_end
        if w is None:
            d_start = faded + d_y.T @ q_from_start
        else:
            cotangents = jnp.concatenate([d_y, -d_u])
            d_start = faded + cotangents.T @ jnp.concatenate([q_from_start, w])
        # One decay over the chunk (a scalar) or one per key channel (a column of the state).
        d_whole = jnp.sum(d_end * start) if jnp.ndim(whole) == 0 else jnp.sum(d_end * start, 0)
        return d_start, (corrections, d_u, corrections @ d_end, d_whole)


def state_step(state, w, u, k, q, from_start, to_end, whole):
    """``state_pass`` with the keys and queries (in their input dtype) cast and decayed
    here, where the products read them: batched over all chunks they would be two more
    token-sized arrays. Decays ``[C]`` (one per token) or ``[C, K]`` (per channel)."""
    return state_pass(state, w, u, decayed(k, to_end), decayed(q, from_start), whole)


def state_step_bwd(d_end, start, w, u, k, q, from_start, to_end, whole, d_u_intra, d_y):
    """Pullback of ``state_step``: ``state_pass_bwd`` with the keys and queries decayed."""
    k_to_end, q_from_start = decayed(k, to_end), decayed(q, from_start)
    return state_pass_bwd(d_end, start, w, u, k_to_end, q_from_start, whole, d_u_intra, d_y)


def chunk_output(
    q: Float[Array, "C K"],
    k: Float[Array, "C K"],
    decays: ChunkDecays,
    corrections: Float[Array, "C V"],
    y_start: Float[Array, "C V"],
) -> Float[Array, "C V"]:
    """``Y [C, V]`` of one chunk: its read of the start state plus the causal intra-chunk
    part."""
    with jax.named_scope(stages.OUTPUTS):
        attn_CxC = (q @ k.T) * decays.within
        return y_start + attn_CxC @ corrections


def chunk_grads(write: WriteRule, q, k, v, beta, decays, inverse, start, d):
    """Gradients of one chunk's q, k, v, beta and log_alpha from its inputs, decays, ``T``
    (``None`` without the delta correction), start state ``S`` and what the reverse state
    pass returned, ``d = (dY, U, dU, d(K diag(exp(g_C - g))), d exp(g_C))``.

    ``q k^T`` is formed again here rather than passed in: where the chunk's stage 1 runs in
    the same program (the in-scan schedule) XLA merges the two products, and the hoisted
    backward, which calls this after its loop, keeps no ``[C, C]`` array per chunk through
    the loop for it.
    """
    with jax.named_scope(stages.INPUT_GRADS):
        d_y, corrections, d_u, d_k_to_end, d_whole = d
        qk = q @ k.T
        d_y_u = d_y @ corrections.T
        d_attn = d_y_u * decays.within
        d_y_start = d_y @ start
        grads = write.factors_bwd(k, v, beta, decays, inverse, start, corrections, d_u)
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


def chunk_prepare(write: WriteRule, q, k, v, log_alpha, beta):
    """Stage 1 for one chunk: its decays and WY factors."""
    with jax.named_scope(stages.FACTORS):
        decays = chunk_decays(log_alpha)
        return decays, write.factors(k, v, beta, decays)


def chunk_forward(
    write: WriteRule,
    state: Float[Array, "V K"],
    q: Float[Array, "C K"],
    k: Float[Array, "C K"],
    v: Float[Array, "C V"],
    log_alpha: Float[Array, " C"],
    beta: Float[Array, " C"],
) -> tuple[Float[Array, "V K"], Float[Array, "C V"]]:
    """All three stages for one chunk: ``(S, chunk inputs) -> (S', Y [C, V])``, with q, k
    and v in their input dtype."""
    q, k, v = cast_to(state.dtype, q, k, v)
    decays, (w, u, _) = chunk_prepare(write, q, k, v, log_alpha, beta)
    new_state, (corrections, y_start) = state_step(
        state, w, u, k, q, decays.from_start, decays.to_end, decays.whole
    )
    corrections = u if w is None else corrections
    return new_state, chunk_output(q, k, decays, corrections, y_start)


def chunk_backward_inputs(write: WriteRule, q, k, v, log_alpha, beta, d_y):
    """What the reverse state pass needs of one chunk: stage 1 again and the cotangent of
    ``U`` from the chunk's own outputs, ``(Q K^T * Gamma)^T dY``."""
    with jax.named_scope(stages.FACTORS_AGAIN):
        decays, factors = chunk_prepare(write, q, k, v, log_alpha, beta)
        return decays, factors, ((q @ k.T) * decays.within).T @ d_y


def chunk_backward(write: WriteRule, d_end, start, q, k, v, log_alpha, beta, d_y):
    """The whole backward of one chunk: ``(dS', S, chunk inputs, dY) -> (dS, grads)``, with
    q, k and v and their gradients in their input dtype."""
    dtypes = (q.dtype, k.dtype, v.dtype)
    q, k, v = cast_to(start.dtype, q, k, v)
    decays, (w, u, inverse), d_u_intra = chunk_backward_inputs(write, q, k, v, log_alpha, beta, d_y)
    d_start, (corrections, d_u, d_k_to_end, d_whole) = state_step_bwd(
        d_end, start, w, u, k, q, *decays[1:], d_u_intra, d_y
    )
    d = (d_y, corrections, d_u, d_k_to_end, d_whole)
    grads = chunk_grads(write, q, k, v, beta, decays, inverse, start, d)
    return d_start, (*cast_back(grads[:3], dtypes), *grads[3:])


def _hoisted_forward(write, inputs, initial_states, resets, *, keep_starts, associative=False):
    # The scan reads q and k in their input dtype; the batched stages cast them as they read.
    q_in, k_in = inputs[:2]
    q, k, v = cast_to(initial_states.dtype, *inputs[:3])
    decays, (w, u, _) = over_chunks(functools.partial(chunk_prepare, write))(q, k, v, *inputs[3:])
    blocks = (w, u, k_in, q_in, *decays[1:])
    factors = _map_factors(w, u, k_in, decays) if associative else None
    (corrections, y_start), *starts, finals = state_pass_over(
        state_step, blocks, factors, initial_states, resets,
        keep_starts=keep_starts, associative=associative,
    )  # fmt: skip
    corrections = u if w is None else corrections
    ys = over_chunks(chunk_output)(q, k, decays, corrections, y_start)
    return ys, finals, starts


def _hoisted_backward(write, inputs, starts, resets, d_ys, d_finals):
    q_in, k_in, _, log_alpha, beta = inputs
    q, k, v = cast_to(starts.dtype, *inputs[:3])
    backward_inputs = over_chunks(functools.partial(chunk_backward_inputs, write))
    decays, (w, u, inverse), d_u_intra = backward_inputs(q, k, v, log_alpha, beta, d_ys)
    xs = (starts, w, u, k_in, q_in, *decays[1:], d_u_intra, d_ys)
    (corrections, d_u, d_k_to_end, d_whole), d_initial = scan_blocks_backward(
        state_step_bwd, xs, d_finals, resets
    )
    # The chunks' decays, q k^T and k k^T are formed again for chunk_grads. Off CPU they are
    # formed again indeed, after the loop, rather than kept through it: a barrier keeps XLA
    # from merging them with those before it. On CPU, where memory is plenty and the batched
    # products are slow, XLA merges them (docs/benchmarks.md).
    inputs, d_u = barrier_off_cpu(inputs, d_u)
    q, k, v = cast_to(starts.dtype, *inputs[:3])
    decays, beta = over_chunks(chunk_decays)(inputs[3]), inputs[4]
    d = (d_ys, corrections, d_u, d_k_to_end, d_whole)
    grads = over_chunks(functools.partial(chunk_grads, write))(
        q, k, v, beta, decays, inverse, starts, d
    )
    dtypes = (x.dtype for x in inputs[:3])
    return (*cast_back(grads[:3], dtypes), *grads[3:]), d_initial


def _associative_backward(write, inputs, starts, resets, d_ys, d_finals):
    # Without the barrier XLA merges stage 1 here with the forward's and keeps it between.
    inputs, starts = barrier_off_cpu(inputs, starts)
    q_in, k_in, _, log_alpha, beta = inputs
    q, k, v = cast_to(starts.dtype, *inputs[:3])
    backward_inputs = over_chunks(functools.partial(chunk_backward_inputs, write))
    decays, (w, u, _), d_u_intra = backward_inputs(q, k, v, log_alpha, beta, d_ys)
    xs = (starts, w, u, k_in, q_in, *decays[1:], d_u_intra, d_ys)
    factors = _map_factors(w, u, k_in, decays)
    d_ends, d_initial = end_cotangents(state_step_bwd, xs, factors, d_finals, resets)
    # With its end state's cotangent known, each chunk's backward is the in-scan one's.
    inputs, starts, d_ends = barrier_off_cpu(inputs, starts, d_ends)

    def backward_of(d_end, start, *chunk):
        return chunk_backward(write, d_end, start, *chunk)[1]

    grads = over_chunks(backward_of)(d_ends, starts, *inputs, d_ys)
    return grads, d_initial


def _map_factors(w, u, k_in, decays):
    """What ``state_scan`` builds the chunks' state maps from: ``(w, u, K~, exp(g_C))``."""
    return w, u, over_chunks(decayed)(k_in, decays.to_end), decays.whole


def _in_scan_forward(write, inputs, initial_states, resets, *, keep_starts):
    step = functools.partial(chunk_forward, write)
    ys, *starts, finals = scan_blocks(step, inputs, initial_states, resets, keep_starts=keep_starts)
    return ys, finals, starts


def _in_scan_backward(write, inputs, starts, resets, d_ys, d_finals):
    step = functools.partial(chunk_backward, write)
    return scan_blocks_backward(step, (starts, *inputs, d_ys), d_finals, resets)


# Where each chunk's own work runs: hoisted out of the scan over chunks and batched over all
# chunks (the accelerator shape: only state-sized products inside the loop), hoisted too with
# the scan replaced by an associative scan over the chunks' state maps (no loop: a loop
# launches a few kernels a chunk on a GPU), or inside the scan, chunk by chunk, which keeps a
# chunk's intermediates in cache on CPU.
SCHEDULES = {
    "hoisted": (_hoisted_forward, _hoisted_backward),
    "associative": (functools.partial(_hoisted_forward, associative=True), _associative_backward),
    "in_scan": (_in_scan_forward, _in_scan_backward),
}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def chunked_core(write, schedule, q, k, v, log_alpha, beta, initial_states, resets):
    """The chunked form for one head: q, k ``[NC, C, K]`` (q unscaled), v ``[NC, C, V]``,
    gates ``[NC, C]``, ``initial_states [N, V, K]``, ``resets`` as in ``blocks.scan_blocks``;
    ``write`` is ``wy.DELTA`` or ``wy.LINEAR``, ``schedule`` a key of ``SCHEDULES``. It
    computes in the states' dtype; q, k and v may be narrower and are kept so (also as the
    residuals of the backward), their gradients in their own dtype.

    Returns ``(y [NC, C, V], finals [N, V, K])``.
    """
    forward, _ = SCHEDULES[schedule]
    inputs = (q, k, v, log_alpha, beta)
    ys, finals, _ = forward(write, inputs, initial_states, resets, keep_starts=False)
    return ys, finals


def _chunked_core_fwd(write, schedule, q, k, v, log_alpha, beta, initial_states, resets):
    forward, _ = SCHEDULES[schedule]
    inputs = (q, k, v, log_alpha, beta)
    ys, finals, (starts,) = forward(write, inputs, initial_states, resets, keep_starts=True)
    return (ys, finals), (inputs, starts, resets)


def _chunked_core_bwd(write, schedule, residuals, cotangents):
    _, backward = SCHEDULES[schedule]
    inputs, starts, resets = residuals
    (d_q, d_k, d_v, d_beta, d_log_alpha), d_initial = backward(
        write, inputs, starts, resets, *cotangents
    )
    return d_q, d_k, d_v, d_log_alpha, d_beta, d_initial, None


chunked_core.defvjp(_chunked_core_fwd, _chunked_core_bwd)


def chunked_rule(
    q: Float[Array, "T K"],
    k: Float[Array, "T K"],
    v: Float[Array, "T V"],
    gates: tuple,
    initial_states: Float[Array, "N V K"],
    *,
    chunk_size: int,
    cu_seqlens: Int[Array, " N+1"] | None = None,
    write: WriteRule = DELTA,
    schedule: checks.Schedule = "auto",
) -> tuple[Float[Array, "T V"], Float[Array, "N V K"]]:
    """Lay the tokens out in chunks, run ``chunked_core`` with ``write`` and ``schedule``, and
    back: the chunked form of one head (``rule.Rule.chunked``) with ``gates = (log_alpha
    [T], beta [T])``.

    The gates and states are in the compute dtype, q, k and v in it or narrower, and ``q``
    is not scaled (the callers scale ``y``): q, k ``[T, K]``, v ``[T, V]``,
    ``initial_states [N, V, K]``. The layout is ``chunk_layout``'s. Returns ``(y [T, V],
    finals [N, V, K])``.
    """
    log_alpha, beta = cast_to(initial_states.dtype, *gates)  # [T] each: no copy worth keeping
    log_alpha = jnp.maximum(log_alpha, LOG_ALPHA_FLOOR)
    layout = chunk_layout(q.shape[0], chunk_size, cu_seqlens)
    chunks = (layout.to_chunks(x) for x in (q, k, v, log_alpha, beta))
    cores = {name: functools.partial(chunked_core, write, name) for name in SCHEDULES}
    ys, finals = run_schedule(cores, schedule, *chunks, initial_states, layout.resets)
    return layout.from_chunks(ys), finals
