"""The channel-gated rules chunk by chunk, in stages, with a hand-derived backward: Kimi
Delta Attention (KDA), Gated DeltaNet-2 (GDN-2) and gated linear attention (GLA).

Per head and token, with per-channel log-decays ``g_t [K]``, an erase gate ``b_t`` (``[K]``,
or one number) and a write gate ``w_t`` (``[V]``, or one number)::

    S_t = S_{t-1} Diag(alpha_t) + U_t k_t^T,   U_t = w_t * v_t - S_{t-1} Diag(alpha_t) (b_t * k_t)

GDN-2 has both gates per channel; KDA is ``b_t = w_t = beta_t``; with equal channels of
``g`` it is the gated delta rule (whose scalar decays ``ops/chunked/scalar.py`` runs faster). GLA is
``b = 0``, ``w = 1`` (``erase=False``): ``U = V``, no WY system, no erase scores and their
pullback, only the queries read the state (as ``wy.LINEAR`` on the scalar engine). With
``e_t = b_t * k_t`` (what a token erases along) and ``x_t = w_t * v_t`` (what it writes), a
chunk of ``C`` tokens from state ``S``, ``G_t`` the decays summed from its start
(``chunked/channel_decays.py``), is the same problem as the gated delta rule's (``chunked/wy.py``), the
decays inside the channel sums:

1. Decays and WY factors: ``(I + A) U = X - (E * exp(G)) S^T`` with ``A_ti = sum_c e_tc k_ic
   exp(G_tc - G_ic)`` for ``i < t`` (``channel_decays.channel_scores``, which no gate can
   overflow), so for ``T = (I + A)^{-1}``: ``U = u - w S^T``, ``u = T X``, ``w = T (E *
   exp(G))`` (``wy.two_products``).
2. The state pass, the only sequential part (``chunked.state_pass``):
   ``[w; Q * exp(G)] S^T``, ``U = u - w S^T``, ``S' = S Diag(exp(G_C)) + U^T (K * exp(G_C -
   G))``.
3. The outputs: ``Y = (Q * exp(G)) S^T + M U``, ``M_ti = sum_c q_tc k_ic exp(G_tc - G_ic)``
   for ``i <= t``.

Backward, written by hand in the same stages (derivation, for cotangents ``dY`` and ``dS'``):
``dU = M^T dY + (K * exp(G_C - G)) dS'^T``; the start state's cotangent ``dS = dY^T (Q *
exp(G)) + dS' Diag(exp(G_C)) - dU^T w``; these two need the carried ``dS'`` and run in the
reverse state pass (``chunked.state_pass_bwd``), which also returns ``U dS'`` (the
cotangent of the decayed keys) and ``d exp(G_C) = sum_v dS' * S``. The rest needs only the
chunk's start state: ``dM = dY U^T`` on ``i <= t``; the WY pullback (``wy.two_products_bwd``)
``dX = T^T dU``, ``d(E * exp(G)) = -dX S``, ``dA = -(dX U^T)`` on ``i < t`` (``d(I + A)^{-1}
= -T dA T``); ``d(Q * exp(G)) = dY S``; then ``dM`` and ``dA`` through the scores to ``q``,
``e``, ``k`` and the decay factors, ``e = b * k`` and ``x = w * v`` to the gates, and every
decay factor's cotangent to ``g`` (``channel_decays.channel_scores_bwd``, down its chain of
sums). Between the forward and the backward only the inputs, in their own dtype, and one
``[V, K]`` state per chunk are kept (the ``associative`` schedule keeps ``T`` and ``M`` too).

As in ``ops/chunked/scalar.py``, stages 1 and 3 and the gradients run hoisted out of the scan over
chunks and batched (``"hoisted"``: only state-sized products in the loops; the keys and
queries enter them already decayed), hoisted with the state pass an associative scan
(``"associative"``, its backward in ``chunked/channel_backward.py``) or inside the scan,
chunk by chunk (``"in_scan"``). All take GDN-2's ``x = w * v`` already formed
(``_writes_first``; the hoisted ones only where that is no wider than ``v``). A NaN in k, v
or a gate reaches the outputs from the start of its chunk on.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from gdn_jax.ops import checks
from gdn_jax.ops.chunked import stages
from gdn_jax.ops.chunked.blocks import barrier_off_cpu, scan_blocks, scan_blocks_backward
from gdn_jax.ops.chunked.channel_backward import (
    associative_backward,
    grads_in_groups,
    start_products,
)
from gdn_jax.ops.chunked.channel_decays import ChannelDecays
from gdn_jax.ops.chunked.channel_gates import (
    NO_ERASE,
    WRITTEN,
    EraseGate,
    clamped,
    erases,
    gated,
    gated_bwd,
    writes,
    writes_bwd,
)
from gdn_jax.ops.chunked.channel_levels import scores, scores_bwd
from gdn_jax.ops.chunked.decays import LOG_ALPHA_FLOOR
from gdn_jax.ops.chunked.scalar import (
    cast_back,
    cast_to,
    dtypes_of,
    over_chunks,
    state_pass,
    state_pass_bwd,
)
from gdn_jax.ops.chunked.schedules import run_schedule
from gdn_jax.ops.chunked.state_scan import state_pass_over
from gdn_jax.ops.chunked.varlen import chunk_layout
from gdn_jax.ops.chunked.wy import two_products


class Factors(NamedTuple):
    """Stage 1 of one chunk: its decays, erase vectors ``e = b * k``, WY factors and the
    decayed query-key scores ``M`` of its outputs."""

    decays: ChannelDecays
    erase: Float[Array, "C K"] | None  # None, and no w and T, without an erase gate
    w: Float[Array, "C K"] | None
    u: Float[Array, "C V"]
    inverse: Float[Array, "C C"] | None  # T = (I + A)^{-1}
    scores: Float[Array, "C C"]  # M


def chunk_factors(q, k, v, log_alpha, erase_gate: EraseGate, write_gate, *, halving=False):
    """Stage 1 for one chunk (inputs in the compute dtype): ``Factors``. ``write_gate`` is a
    ``WriteGate``, ``None`` (the erase gate writes: KDA's ``beta``) or ``WRITTEN`` (``v`` is
    what is written). Both scores come from one pass over the levels (``channel_levels.scores``,
    the halving on every platform with ``halving``); with ``NO_ERASE`` only the queries'
    (``U = V``)."""
    with jax.named_scope(stages.FACTORS):
        if not erases(erase_gate):
            (q_scores,), decays = scores((q,), k, clamped(log_alpha), halving)
            return Factors(decays, None, None, writes(v, erase_gate, write_gate), None, q_scores)
        erase = gated(k, erase_gate)
        (q_scores, erase_scores), decays = scores((q, erase), k, clamped(log_alpha), halving)
        w, u, inverse = two_products(
            jnp.tril(erase_scores, -1), erase * decays.from_start, writes(v, erase_gate, write_gate)
        )
        return Factors(decays, erase, w, u, inverse, q_scores)


def outputs(y_start, scores, corrections):
    """Stage 3: ``Y = diag(exp(g)) Q S^T + M U`` from the state pass's read and ``U``."""
    with jax.named_scope(stages.OUTPUTS):
        return y_start + scores @ corrections


def chunk_forward(state, q, k, v, log_alpha, erase_gate, write_gate):
    """All three stages for one chunk: ``(S, chunk inputs) -> (S', Y [C, V])``, with q, k
    and v in their input dtype."""
    q, k, v, *gates = cast_to(state.dtype, q, k, v, log_alpha, erase_gate, write_gate)
    f = chunk_factors(q, k, v, *gates)
    k_to_end, q_from_start = k * f.decays.to_end, q * f.decays.from_start
    new_state, (corrections, y_start) = state_pass(
        state, f.w, f.u, k_to_end, q_from_start, f.decays.whole
    )
    return new_state, outputs(y_start, f.scores, f.u if f.w is None else corrections)


def backward_inputs(q, k, v, log_alpha, erase_gate, write_gate, d_y, *, halving=False):
    """What the reverse state pass needs of one chunk: stage 1 again (``chunk_factors``),
    the decayed keys and queries, and the cotangent of ``U`` from the chunk's own outputs,
    ``M^T dY``."""
    with jax.named_scope(stages.FACTORS_AGAIN):
        f = chunk_factors(q, k, v, log_alpha, erase_gate, write_gate, halving=halving)
        k_to_end, q_from_start = k * f.decays.to_end, q * f.decays.from_start
        return f, k_to_end, q_from_start, f.scores.T @ d_y


def input_grads(q, k, v, log_alpha, erase_gate, write_gate, made, d_k_to_end, d_whole, *,
                halving=False):  # fmt: skip
    """Gradients of one chunk's q, k, v, log_alpha and gates from its inputs (compute
    dtype), ``start_products``' ``made`` and the reverse state pass's ``d(K decayed to the
    end)`` and ``d exp(G_C)``: the scores' pullback (``channel_levels.scores_bwd``, with
    ``halving`` as ``chunk_factors``, the decays and levels formed again), then the gates."""
    with jax.named_scope(stages.INPUT_GRADS):
        d_q_from_start, d_scores, d_write, d_erase_decayed, d_strict = made
        if erases(erase_gate):
            erase = gated(k, erase_gate)
            rows, d_rows = (q, erase), (d_scores, d_strict)
            d_from_start = d_q_from_start * q + d_erase_decayed * erase
        else:
            rows, d_rows, d_from_start = (q,), (d_scores,), d_q_from_start * q
        d_decays = (d_from_start, d_k_to_end * k, d_whole)
        (d_q, *d_erase), d_k, d_log_alpha, decays = scores_bwd(
            rows, k, clamped(log_alpha), d_rows, d_decays, halving
        )
        d_erase_gate = NO_ERASE
        if erases(erase_gate):
            d_erase = d_erase[0] + d_erase_decayed * decays.from_start
            d_k_erase, d_erase_gate = gated_bwd(k, erase_gate, d_erase)
            d_k = d_k + d_k_erase
        d_v, d_write_gate = writes_bwd(v, erase_gate, write_gate, d_write)
        if write_gate is None:  # one gate erases and writes
            d_erase_gate, d_write_gate = d_erase_gate + d_write_gate, None
        d_q = d_q + d_q_from_start * decays.from_start
        d_k = d_k + d_k_to_end * decays.to_end
        d_log_alpha = jnp.where(log_alpha > LOG_ALPHA_FLOOR, d_log_alpha, 0)
        return d_q, d_k, d_v, d_log_alpha, d_erase_gate, d_write_gate


def chunk_grads(q, k, v, log_alpha, erase_gate, write_gate, inverse, start, d, *, halving=False):
    """Gradients of one chunk's q, k, v, log_alpha and gates from its inputs (compute
    dtype), ``T``, start state ``S`` and what the reverse state pass returned, ``d = (dY, U,
    dU, d(K decayed to the end), d exp(G_C))``: ``input_grads`` of ``start_products``."""
    d_y, corrections, d_u, d_k_to_end, d_whole = d
    made = start_products(inverse, start, d_y, corrections, d_u)
    inputs = (q, k, v, log_alpha, erase_gate, write_gate)
    return input_grads(*inputs, made, d_k_to_end, d_whole, halving=halving)


def chunk_backward(d_end, start, q, k, v, log_alpha, erase_gate, write_gate, d_y):
    """The whole backward of one chunk: ``(dS', S, chunk inputs, dY) -> (dS, grads)``, the
    inputs and their gradients in the inputs' dtype."""
    inputs = (q, k, v, log_alpha, erase_gate, write_gate)
    q, k, v, *gates = cast_to(start.dtype, *inputs)
    f, k_to_end, q_from_start, d_u_intra = backward_inputs(q, k, v, *gates, d_y)
    d_start, (corrections, d_u, d_k_to_end, d_whole) = state_pass_bwd(
        d_end, start, f.w, f.u, k_to_end, q_from_start, f.decays.whole, d_u_intra, d_y
    )
    d = (d_y, corrections, d_u, d_k_to_end, d_whole)
    grads = chunk_grads(q, k, v, *gates, f.inverse, start, d)
    return d_start, cast_back(grads, dtypes_of(inputs))


def _hoisted_forward(inputs, initial_states, resets, *, keep, associative=False):
    q, k, v, *gates = cast_to(initial_states.dtype, *inputs)
    # The associative schedule's scores are the platform's (every level at once on a GPU),
    # and it keeps T and M for its backward; hoisted's the halving, keeping neither.
    f = over_chunks(functools.partial(chunk_factors, halving=not associative))(q, k, v, *gates)
    k_to_end, q_from_start = k * f.decays.to_end, q * f.decays.from_start
    blocks = (f.w, f.u, k_to_end, q_from_start, f.decays.whole)
    (corrections, y_start), *starts, finals = state_pass_over(
        state_pass, blocks, (f.w, f.u, k_to_end, f.decays.whole), initial_states, resets,
        keep_starts=keep, associative=associative,
    )  # fmt: skip
    kept = (*starts, f.inverse, f.scores) if associative and keep else tuple(starts)
    return outputs(y_start, f.scores, f.u if f.w is None else corrections), finals, kept


def _hoisted_backward(inputs, kept, resets, d_ys, d_finals):
    (starts,) = kept
    q, k, v, *gates = cast_to(starts.dtype, *inputs)
    f, k_to_end, q_from_start, d_u_intra = over_chunks(
        functools.partial(backward_inputs, halving=True)
    )(q, k, v, *gates, d_ys)
    xs = (starts, f.w, f.u, k_to_end, q_from_start, f.decays.whole, d_u_intra, d_ys)
    (corrections, d_u, d_k_to_end, d_whole), d_initial = scan_blocks_backward(
        state_pass_bwd, xs, d_finals, resets
    )
    # As in chunked.py: off CPU a barrier keeps XLA from keeping the decays of stage 1
    # through the loop for chunk_grads, which forms them again after it.
    inputs, d_u = barrier_off_cpu(inputs, d_u)
    d = (d_ys, corrections, d_u, d_k_to_end, d_whole)
    dtypes = dtypes_of(inputs)

    def grads_of(*xs):
        *chunk_inputs, inverse, start, d = xs
        q, k, v, *gates = cast_to(starts.dtype, *chunk_inputs)
        grads = chunk_grads(q, k, v, *gates, inverse, start, d, halving=True)
        return cast_back(grads, dtypes)

    grads = grads_in_groups(grads_of, (*inputs, f.inverse, starts, d))
    return grads, d_initial


def _writes_first(inputs, dtype, *, wider_too: bool):
    """``inputs`` with GDN-2's values and write gates as one array, ``w * v`` in ``dtype``,
    and ``WRITTEN`` for the gate. Both schedules lay their inputs out chunk by chunk and
    return a gradient for each, so that is one token-sized array fewer in and out, less temp
    at the same time. ``w * v`` is formed once and kept from the forward to the backward, so
    when it is wider than ``v`` (``dtype`` float32, inputs bfloat16) the hoisted schedule
    keeps the inputs as they are (``wider_too=False``): formed, it took more TPU temp than it
    saved. KDA's inputs are left as they are (figures in docs/benchmarks.md)."""
    q, k, v, log_alpha, erase_gate, write_gate = inputs
    if write_gate is None or isinstance(write_gate, tuple) or not (wider_too or v.dtype == dtype):
        return inputs
    made = over_chunks(gated)(v.astype(dtype), write_gate.astype(dtype))
    return q, k, made, log_alpha, erase_gate, WRITTEN


def _in_scan_forward(inputs, initial_states, resets, *, keep):
    ys, *starts, finals = scan_blocks(
        chunk_forward, inputs, initial_states, resets, keep_starts=keep
    )
    return ys, finals, tuple(starts)


def _in_scan_backward(inputs, kept, resets, d_ys, d_finals):
    return scan_blocks_backward(chunk_backward, (*kept, *inputs, d_ys), d_finals, resets)


def _with_writes_first(schedule, *, wider_too: bool):
    """``schedule``'s forward and backward on ``_writes_first``'s inputs, the gradient of
    ``w * v`` taken back to ``v`` and ``w`` after it."""
    forward, backward = schedule

    def folded_forward(inputs, initial_states, resets, *, keep):
        folded = _writes_first(inputs, initial_states.dtype, wider_too=wider_too)
        return forward(folded, initial_states, resets, keep=keep)

    def folded_backward(inputs, kept, resets, d_ys, d_finals):
        dtype = kept[0].dtype
        folded = _writes_first(inputs, dtype, wider_too=wider_too)
        grads, d_initial = backward(folded, kept, resets, d_ys, d_finals)
        if folded is inputs:
            return grads, d_initial
        v, write_gate = inputs[2], inputs[5]
        v_c, gate_c = v.astype(dtype), write_gate.astype(dtype)
        d_v, d_write_gate = over_chunks(gated_bwd)(v_c, gate_c, grads[2])
        d_v, d_write_gate = d_v.astype(v.dtype), d_write_gate.astype(write_gate.dtype)
        return (*grads[:2], d_v, *grads[3:5], d_write_gate), d_initial

    return folded_forward, folded_backward


SCHEDULES = {
    "hoisted": _with_writes_first((_hoisted_forward, _hoisted_backward), wider_too=False),
    "associative": _with_writes_first(
        (functools.partial(_hoisted_forward, associative=True), associative_backward),
        wider_too=False,
    ),
    "in_scan": _with_writes_first((_in_scan_forward, _in_scan_backward), wider_too=True),
}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def channel_core(schedule, q, k, v, log_alpha, erase_gate, write_gate, initial_states, resets):
    """The chunked form for one head in ``schedule`` (a key of ``SCHEDULES``): q, k ``[NC,
    C, K]`` (q unscaled), v ``[NC, C, V]``, log_alpha ``[NC, C, K]``, the gates ``[NC, C]``
    or ``[NC, C, K]`` (erase) and ``[NC, C, V]`` (write), ``initial_states [N, V, K]``,
    ``resets`` as in ``blocks.scan_blocks``. Returns ``(y [NC, C, V], finals [N, V, K])``."""
    forward, _ = SCHEDULES[schedule]
    inputs = (q, k, v, log_alpha, erase_gate, write_gate)
    ys, finals, _ = forward(inputs, initial_states, resets, keep=False)
    return ys, finals


def _channel_core_fwd(schedule, q, k, v, log_alpha, erase_gate, write_gate, initial_states, resets):
    forward, _ = SCHEDULES[schedule]
    inputs = (q, k, v, log_alpha, erase_gate, write_gate)
    ys, finals, kept = forward(inputs, initial_states, resets, keep=True)
    return (ys, finals), (inputs, kept, resets)


def _channel_core_bwd(schedule, residuals, cotangents):
    _, backward = SCHEDULES[schedule]
    inputs, kept, resets = residuals
    grads, d_initial = backward(inputs, kept, resets, *cotangents)
    return (*grads, d_initial, None)


channel_core.defvjp(_channel_core_fwd, _channel_core_bwd)


def channel_chunked_rule(
    q: Float[Array, "T K"],
    k: Float[Array, "T K"],
    v: Float[Array, "T V"],
    gates: tuple,
    initial_states: Float[Array, "N V K"],
    *,
    chunk_size: int,
    cu_seqlens: Int[Array, " N+1"] | None = None,
    schedule: checks.Schedule = "auto",
    erase: bool = True,
) -> tuple[Float[Array, "T V"], Float[Array, "N V K"]]:
    """Lay the tokens out in chunks, run ``channel_core`` in ``schedule``, and back: the
    chunked form of one head (``rule.Rule.chunked``) with ``gates = (log_alpha [T, K], b
    [T, K], w [T, V])`` (GDN-2), ``(log_alpha [T, K], beta [T])`` (KDA: one gate erases
    and writes) or ``(log_alpha [T, K],)`` with ``erase=False`` (GLA) in the compute dtype,
    q, k and v in it or narrower (``q`` unscaled), ``initial_states [N, V, K]``. The layout
    is ``varlen.chunk_layout``'s. Returns ``(y [T, V], finals [N, V, K])``."""
    layout = chunk_layout(q.shape[0], chunk_size, cu_seqlens)
    if erase:
        log_alpha, erase_gate, *write_gate = gates
        erase_chunks = layout.to_chunks(erase_gate)
        write = layout.to_chunks(write_gate[0]) if write_gate else None
    else:
        (log_alpha,), erase_chunks, write = gates, NO_ERASE, WRITTEN
    chunks = [layout.to_chunks(x) for x in (q, k, v, log_alpha)] + [erase_chunks, write]
    cores = {name: functools.partial(channel_core, name) for name in SCHEDULES}
    ys, finals = run_schedule(cores, schedule, *chunks, initial_states, layout.resets)
    return layout.from_chunks(ys), finals
