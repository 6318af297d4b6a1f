"""The channel-gated rules' backward over every chunk at once (``chunked/channel.py``'s
``hoisted`` and ``associative`` schedules): the gradients a group of chunks at a time, and
the ``associative`` schedule's backward, the form every GPU but Hopper's kernels runs.

A chunk's gradients (``channel.chunk_grads``) split in three. The products with its start
state and ``T`` (``start_products``: ``dY S``, ``dM``, the WY pullback) are matmuls of
``[C, C]``, ``[C, K]`` and ``[C, V]`` arrays. The decays' share (``decay_grads``: the
decayed queries, keys and erase vectors, the writes, every gate's sum of the decays'
cotangents) is elementwise work and one product. The scores' share (``level_grads``: ``dM``
and ``dA`` through the levels of ``chunked/channel_levels.py`` to ``q``, ``k``, the erase
vectors and the gates) is what takes memory: every level's factors stacked, ``log2(C)/2``
times the keys, and their cotangents as many again.

So the ``associative`` backward batches everything over every chunk but the scores' share,
which it forms a group of chunks at a time (``grads_in_groups``), each group adding its
share to the others' gradients where they lie. On a GPU a loop launches its body's kernels
every trip, and this body is only the levels' pullback. The forward keeps each chunk's
``T`` and ``M`` (``[C, C]`` each, together the size of the keys in float32) beside its start
state, so that the backward forms no score again: its factors are the decays and the two
products with ``T`` (``kept_factors``). The figures that chose this are in
docs/benchmarks.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gdn_jax.ops.chunked import stages
from gdn_jax.ops.chunked.blocks import add_groups, barrier_off_cpu, map_groups
from gdn_jax.ops.chunked.channel_gates import (
    NO_ERASE,
    clamped,
    erases,
    gated,
    gated_bwd,
    writes,
    writes_bwd,
)
from gdn_jax.ops.chunked.channel_levels import chunk_decays, decays_bwd, scores_levels_bwd
from gdn_jax.ops.chunked.decays import LOG_ALPHA_FLOOR
from gdn_jax.ops.chunked.scalar import cast_back, cast_to, dtypes_of, over_chunks, state_pass_bwd
from gdn_jax.ops.chunked.state_scan import end_cotangents
from gdn_jax.ops.chunked.wy import two_products_bwd

# Chunks whose gradients the backward forms together: GRADS_GROUP on accelerators,
# CPU_GRADS_GROUP on XLA:CPU (``grads_in_groups`` says why they differ); the scores' share
# alone, in the associative schedule, LEVELS_GROUP on accelerators: half the trips of 16,
# each a GPU's launches again, within hoisted's peak memory (docs/benchmarks.md).
GRADS_GROUP = 16
CPU_GRADS_GROUP = 4
LEVELS_GROUP = 32


def grads_in_groups(grads_of, xs, totals=None, *, size=GRADS_GROUP):
    """``map_groups(grads_of, xs, size)``, or with ``totals`` ``add_groups(grads_of, xs,
    totals, size)``: the gradients a group of chunks at a time. All at once, the levels'
    factors and their cotangents, some thirty ``[C, K]`` arrays a chunk, would take gigabytes
    of an accelerator's memory at long sequences. Each group reads its inputs in their own
    dtype. The group size depends on the platform: on XLA:CPU a group's arrays are its
    chunks' times the heads batched around them, and the pullback of the scores makes many
    elementwise passes over them, which run faster over few chunks that stay near the cores,
    at the same temp; on a TPU fewer chunks a group take more temp. The measurements that
    chose ``CPU_GRADS_GROUP`` and ``GRADS_GROUP`` are in docs/benchmarks.md."""

    def in_groups(size):
        if totals is None:
            return lambda xs: map_groups(grads_of, xs, size)
        return lambda xs, totals: add_groups(grads_of, xs, totals, size)

    args = (xs,) if totals is None else (xs, totals)
    return jax.lax.platform_dependent(
        *args, cpu=in_groups(CPU_GRADS_GROUP), default=in_groups(size)
    )


def start_products(inverse, start, d_y, corrections, d_u):
    """What the gradients of one chunk need of its start state ``S`` and ``T`` (``inverse``,
    None without an erase gate), given ``dY``, ``U`` and ``dU``: ``(d(Q decayed) = dY S,
    dM = tril(dY U^T), dX, d(E decayed), dA)``, the last three from the WY pullback
    (``wy.two_products_bwd``; without an erase gate ``U = X``, so ``dX = dU`` and no ``dA``)."""
    with jax.named_scope(stages.INPUT_GRADS):
        d_q_from_start = d_y @ start
        d_scores = jnp.tril(d_y @ corrections.T)
        if inverse is None:
            return d_q_from_start, d_scores, d_u, None, None
        d_write, d_erase_decayed, d_strict = two_products_bwd(inverse, start, corrections, d_u)
        return d_q_from_start, d_scores, d_write, d_erase_decayed, d_strict


def kept_factors(q, k, v, log_alpha, erase_gate, write_gate, inverse, q_scores, d_y):
    """What the reverse state pass needs of one chunk (``channel.backward_inputs``) from the
    ``T`` and ``M`` the forward kept, in the compute dtype: ``(decays, w, u, K decayed to
    the end, Q decayed from the start, M^T dY)``. Only the decays and the two products with
    ``T`` are formed again."""
    with jax.named_scope(stages.FACTORS_AGAIN):
        decays = chunk_decays(clamped(log_alpha))
        w, u = None, writes(v, erase_gate, write_gate)
        if inverse is not None:
            w, u = inverse @ (gated(k, erase_gate) * decays.from_start), inverse @ u
        return decays, w, u, k * decays.to_end, q * decays.from_start, q_scores.T @ d_y


def decay_grads(q, k, v, log_alpha, erase_gate, write_gate, made, d_k_to_end, d_whole):
    """One chunk's gradients but the scores' share (``level_grads``), from ``made`` of
    ``start_products`` and the reverse state pass's ``d(K decayed to the end)`` and ``d
    exp(G_C)``: through the decayed queries, keys and erase vectors, the writes and the
    decays (``channel_levels.decays_bwd``), which it forms again."""
    with jax.named_scope(stages.INPUT_GRADS):
        decays = chunk_decays(clamped(log_alpha))
        d_q_from_start, _, d_write, d_erase_decayed, _ = made
        d_from_start = d_q_from_start * q
        d_q, d_k = d_q_from_start * decays.from_start, d_k_to_end * decays.to_end
        d_erase_gate = NO_ERASE
        if erases(erase_gate):
            d_from_start = d_from_start + d_erase_decayed * gated(k, erase_gate)
            d_erase = d_erase_decayed * decays.from_start
            d_k_erase, d_erase_gate = gated_bwd(k, erase_gate, d_erase)
            d_k = d_k + d_k_erase
        d_log_alpha = decays_bwd(decays, (d_from_start, d_k_to_end * k, d_whole))
        d_v, d_write_gate = writes_bwd(v, erase_gate, write_gate, d_write)
        if write_gate is None:  # one gate erases and writes
            d_erase_gate, d_write_gate = d_erase_gate + d_write_gate, None
        d_log_alpha = jnp.where(log_alpha > LOG_ALPHA_FLOOR, d_log_alpha, 0)
        return d_q, d_k, d_v, d_log_alpha, d_erase_gate, d_write_gate


def level_grads(q, k, log_alpha, erase_gate, d_scores, d_strict):
    """The scores' share of one chunk's gradients of q, k, log_alpha and the erase gate,
    from ``dM`` and ``dA`` (``start_products``), through every level
    (``channel_levels.scores_levels_bwd``) and ``e = b * k``."""
    with jax.named_scope(stages.INPUT_GRADS):
        if erases(erase_gate):
            rows, d_rows = (q, gated(k, erase_gate)), (d_scores, d_strict)
        else:
            rows, d_rows = (q,), (d_scores,)
        (d_q, *d_erase), d_k, d_log_alpha = scores_levels_bwd(rows, k, clamped(log_alpha), d_rows)
        d_erase_gate = NO_ERASE
        if erases(erase_gate):
            d_k_erase, d_erase_gate = gated_bwd(k, erase_gate, d_erase[0])
            d_k = d_k + d_k_erase
        d_log_alpha = jnp.where(log_alpha > LOG_ALPHA_FLOOR, d_log_alpha, 0)
        return d_q, d_k, d_log_alpha, d_erase_gate


def associative_backward(inputs, kept, resets, d_ys, d_finals):
    """The ``associative`` schedule's backward from the inputs and what its forward kept,
    ``(starts, T, M)``, each a chunk's: every chunk's factors (``kept_factors``), the end
    states' cotangents by the associative scan (``state_scan.end_cotangents``), every chunk's
    reverse state pass, products with its start state and decays' share, batched over the
    chunks; then the scores' share a group at a time, added in place. Returns the inputs'
    gradients, in their dtypes, and the initial states'."""
    # Without the barrier XLA merges stage 1 here with the forward's and keeps it between.
    inputs, (starts, inverses, q_scores) = barrier_off_cpu(inputs, kept)
    q, k, v, *gates = cast_to(starts.dtype, *inputs)
    decays, w, u, k_to_end, q_from_start, d_u_intra = over_chunks(kept_factors)(
        q, k, v, *gates, inverses, q_scores, d_ys
    )
    xs = (starts, w, u, k_to_end, q_from_start, decays.whole, d_u_intra, d_ys)
    factors = (w, u, k_to_end, decays.whole)
    d_ends, d_initial = end_cotangents(state_pass_bwd, xs, factors, d_finals, resets)
    # Off CPU the barrier has XLA form the factors again for the reverse state pass rather
    # than hold every chunk's (five arrays the size of the keys) through the scan.
    inputs, d_ends, (inverses, q_scores) = barrier_off_cpu(inputs, d_ends, (inverses, q_scores))
    q, k, v, *gates = cast_to(starts.dtype, *inputs)
    decays, w, u, k_to_end, q_from_start, d_u_intra = over_chunks(kept_factors)(
        q, k, v, *gates, inverses, q_scores, d_ys
    )
    xs = (starts, w, u, k_to_end, q_from_start, decays.whole, d_u_intra, d_ys)
    _, (corrections, d_u, d_k_to_end, d_whole) = over_chunks(state_pass_bwd)(d_ends, *xs)
    made = over_chunks(start_products)(inverses, starts, d_ys, corrections, d_u)
    # Off CPU the barrier keeps XLA from keeping the decays (two arrays the size of the keys)
    # through the associative scan for decay_grads, which forms them again after it.
    inputs, made = barrier_off_cpu(inputs, made)
    q, k, v, *gates = cast_to(starts.dtype, *inputs)
    d_q, d_k, d_v, d_log_alpha, d_erase_gate, d_write_gate = over_chunks(decay_grads)(
        q, k, v, *gates, made, d_k_to_end, d_whole
    )

    def share_of(q, k, log_alpha, erase_gate, d_scores, d_strict):
        chunk = cast_to(starts.dtype, q, k, log_alpha, erase_gate)
        return level_grads(*chunk, d_scores, d_strict)

    levels_in = (inputs[0], inputs[1], inputs[3], inputs[4], made[1], made[4])
    totals = (d_q, d_k, d_log_alpha, d_erase_gate)
    d_q, d_k, d_log_alpha, d_erase_gate = grads_in_groups(
        share_of, levels_in, totals, size=LEVELS_GROUP
    )
    grads = (d_q, d_k, d_v, d_log_alpha, d_erase_gate, d_write_gate)
    return cast_back(grads, dtypes_of(inputs)), d_initial
