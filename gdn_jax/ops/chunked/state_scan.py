"""The state pass over chunks as an associative scan: no loop over chunks.

A chunk maps its start state to its end state by an affine map (``chunked.state_pass``):
with the corrections ``U = u - w S^T``,

    S' = S D + U^T K~ = S (D - w^T K~) + u^T K~ = S A + b,

where ``K~`` are the keys decayed to the chunk's end and ``D`` the decay over the chunk
(``exp(g_C) I``, or ``Diag(exp(G_C))`` per channel). Composed in order, ``(A1, b1)`` then
``(A2, b2)`` is ``(A1 A2, b1 A2 + b2)``, an associative product, so the states at chunk
boundaries come from ``jax.lax.associative_scan`` in ``log2`` levels of batched products
instead of one step a chunk: a few dozen kernels on a GPU where a loop launches a few per
chunk (docs/benchmarks.md counts them). The price is ``[K, K]`` products and maps.

The scan runs over pairs of chunks, whose maps come straight from the two chunks' factors:
with ``M = K~1 w2^T [C, C]``,

    A1 A2 = D1 D2 - [w1; w2 D1 - M^T w1]^T [K~1 D2; K~2],
    b1 A2 + b2 = [u1; u2 - M^T u1]^T [K~1 D2; K~2],

one product of ``2C`` rows each, so no chunk's ``[K, K]`` map is ever formed, and the scan
holds half as many. A pair's inner boundary then follows from its start by one chunk step.

A chunk that starts a sequence (``resets``, as in ``blocks.scan_blocks``) starts from that
sequence's initial state, whatever came before: a pair holding one maps every state to its
end from that initial state (``(0, end)``).

Backward, the same scan runs last pair first over the transposed maps: a chunk's start
state's cotangent is ``dS = dS' A^T + E``, ``E`` its own outputs' share
(``chunked.state_pass_bwd`` from a zero ``dS'``), and a chunk's end-state cotangent is the
next chunk's ``dS`` (none across a reset) plus its sequence's final-state cotangent where
it ends one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gdn_jax.ops.chunked import stages
from gdn_jax.ops.chunked.blocks import scan_blocks

over_pairs = jax.vmap


def _compose(first, second):
    a1, b1 = first
    a2, b2 = second
    return a1 @ a2, b1 @ a2 + b2


def _scaled(x, decay):
    """``x [.., K]`` times a decay: a scalar per row block, or one per key channel."""
    return x * (decay if decay.ndim == 0 else decay[None, :])


def _pair_factors(w, u, k_to_end, whole):
    """The two products' operands of a pair's map (module docstring): ``left_w [2C, K]``,
    ``left_u [2C, V]``, ``right [2C, K]`` and ``D1 D2``; arguments ``[2, ...]``, the pair's
    first chunk then its second."""
    inner = k_to_end[0] @ w[1].T  # [C, C]
    left_w = jnp.concatenate([w[0], _scaled(w[1], whole[0]) - inner.T @ w[0]])
    left_u = jnp.concatenate([u[0], u[1] - inner.T @ u[0]])
    right = jnp.concatenate([_scaled(k_to_end[0], whole[1]), k_to_end[1]])
    return left_w, left_u, right, whole[0] * whole[1]


def pair_map(w, u, k_to_end, whole):
    """``(A [K, K], b [V, K])`` of two chunks in order (arguments ``[2, ...]``)."""
    left_w, left_u, right, decay = _pair_factors(w, u, k_to_end, whole)
    key_dim = right.shape[-1]
    diagonal = jnp.eye(key_dim, dtype=right.dtype) * (decay if decay.ndim == 0 else decay[:, None])
    return diagonal - left_w.T @ right, left_u.T @ right


def _pairs(x, num_chunks: int, fill):
    """``x [NC, ...]`` as ``[NC / 2, 2, ...]``, an odd count padded with ``fill``."""
    if num_chunks % 2:
        x = jnp.concatenate([x, jnp.full((1, *x.shape[1:]), fill, x.dtype)])
    return x.reshape(-1, 2, *x.shape[1:])


def _resets(resets, num_chunks: int):
    """``(start_seq, end_seq)``, one sequence over all chunks for None."""
    if resets is not None:
        return resets
    chunk = jnp.arange(num_chunks, dtype=jnp.int32)
    return jnp.where(chunk == 0, 0, -1), jnp.where(chunk == num_chunks - 1, 0, -1)


def _per_chunk(x, seq_of_chunk):
    """``x[seq_of_chunk[n]]`` for each chunk, zero where it is -1."""
    taken = x[jnp.maximum(seq_of_chunk, 0)]
    return jnp.where((seq_of_chunk >= 0).reshape(-1, *[1] * (x.ndim - 1)), taken, 0)


def _at_sequences(per_chunk, seq_of_chunk, default):
    """``default [N, ...]`` with row ``m`` replaced by ``per_chunk[n]`` where
    ``seq_of_chunk[n] == m``; chunks of no sequence (-1) write nothing."""
    target = jnp.where(seq_of_chunk >= 0, seq_of_chunk, default.shape[0])  # out of range
    return default.at[target].set(per_chunk, mode="drop")


def _padded(blocks, factors, num_chunks):
    """The blocks and factors in pairs; an odd count gets a chunk that leaves the state as
    it is (no writes, no erasure, decay 1) and whose outputs are dropped."""
    w, u, k_to_end, whole = factors
    if w is None:
        w = jnp.zeros_like(k_to_end)
    factors = tuple(_pairs(x, num_chunks, fill) for x, fill in
                    zip((w, u, k_to_end, whole), (0, 0, 0, 1), strict=True))  # fmt: skip
    return jax.tree.map(lambda x: _pairs(x, num_chunks, 0), blocks), factors


def _first(tree):
    return jax.tree.map(lambda x: x[:, 0], tree)


def _second(tree):
    return jax.tree.map(lambda x: x[:, 1], tree)


def state_pass_over(step, blocks, factors, initial_states, resets, *, keep_starts, associative):
    """``blocks.scan_blocks(step, blocks, initial_states, resets, keep_starts=...)``, by a
    loop over chunks or (``associative``) by ``scan_forward``."""
    if not associative:
        return scan_blocks(step, blocks, initial_states, resets, keep_starts=keep_starts)
    ys, starts, finals = scan_forward(step, blocks, factors, initial_states, resets)
    return (ys, starts, finals) if keep_starts else (ys, finals)


def scan_forward(step, blocks, factors, initial_states, resets):
    """``blocks.scan_blocks(step, blocks, initial_states, resets, keep_starts=True)`` by
    the associative scan: ``(ys, starts [NC, V, K], finals [N, V, K])``.

    ``step(state, *block) -> (end state, y)`` is a chunk's state pass and ``factors = (w or
    None, u, K~, exp(g_C))`` its map's (module docstring), each with a leading ``NC`` axis.
    Once every start state is known each chunk's outputs come from one batched step.
    """
    num_chunks = factors[1].shape[0]
    start_seq, end_seq = (_pairs(x, num_chunks, -1) for x in _resets(resets, num_chunks))
    pair_blocks, pair_factors = _padded(blocks, factors, num_chunks)
    stepped = over_pairs(lambda s, *b: step(s, *b)[0])
    begins = start_seq >= 0
    inits = [_per_chunk(initial_states, start_seq[:, i]) for i in range(2)]
    # A pair holding a sequence's first chunk ends where that sequence's start leads it.
    middle = stepped(inits[0], *_first(pair_blocks))
    middle = jnp.where(begins[:, 1, None, None], inits[1], middle)
    from_start = stepped(middle, *_second(pair_blocks))
    maps, writes = over_pairs(pair_map)(*pair_factors)
    restarted = (begins[:, 0] | begins[:, 1])[:, None, None]
    maps = jnp.where(restarted, 0, maps)
    writes = jnp.where(restarted, from_start, writes)
    with jax.named_scope(stages.STATE_PASS):
        _, pair_ends = jax.lax.associative_scan(_compose, (maps, writes))
    before = jnp.concatenate([jnp.zeros_like(pair_ends[:1]), pair_ends[:-1]])
    first_starts = jnp.where(begins[:, 0, None, None], inits[0], before)
    first_ends = stepped(first_starts, *_first(pair_blocks))
    second_starts = jnp.where(begins[:, 1, None, None], inits[1], first_ends)
    starts = jnp.stack([first_starts, second_starts], 1).reshape(-1, *first_starts.shape[1:])
    starts = starts[:num_chunks]
    finals = _at_sequences(first_ends, end_seq[:, 0], initial_states)
    finals = _at_sequences(pair_ends, end_seq[:, 1], finals)
    _, ys = jax.vmap(step)(starts, *blocks)
    return ys, starts, finals


def end_cotangents(step_bwd, xs, factors, d_finals, resets):
    """Each chunk's end-state cotangent and the initial states' cotangents, ``(d_ends [NC,
    V, K], d_initial [N, V, K])``: what ``blocks.scan_blocks_backward`` carries, by the
    associative scan. ``step_bwd(d_end, start, *rest) -> (d_start, out)`` is a chunk's
    pullback, ``xs = (starts, *rest)``, and ``factors`` as in ``scan_forward``. With them,
    each chunk's backward needs nothing carried."""
    num_chunks = factors[1].shape[0]
    start_seq, end_seq = (_pairs(x, num_chunks, -1) for x in _resets(resets, num_chunks))
    pair_xs, pair_factors = _padded(xs, factors, num_chunks)
    pulled = over_pairs(lambda d, *x: step_bwd(d, *x)[0])
    cut = start_seq >= 0  # no cotangent flows back across a chunk that starts a sequence
    finals = [_per_chunk(d_finals, end_seq[:, i]) for i in range(2)]
    zero = jnp.zeros_like(finals[0])
    own_second = jnp.where(cut[:, 1, None, None], 0, pulled(zero, *_second(pair_xs)))
    # Into the pair's first chunk's start from its second chunk and the first's final:
    own = pulled(own_second + finals[0], *_first(pair_xs))
    own = jnp.where(cut[:, 0, None, None], 0, own)
    maps = over_pairs(pair_map)(*pair_factors)[0]
    maps_t = jnp.where((cut[:, 0] | cut[:, 1])[:, None, None], 0, jnp.swapaxes(maps, 1, 2))
    # x[p], the end-state cotangent of pair p's second chunk, is x[p + 1] maps_t[p + 1] +
    # own[p + 1] + finals[p]: the scan runs last pair first over these shifted maps.
    next_maps = jnp.concatenate([maps_t[1:], jnp.zeros_like(maps_t[:1])])
    next_own = jnp.concatenate([own[1:], jnp.zeros_like(own[:1])]) + finals[1]
    with jax.named_scope(stages.STATE_PASS_BACKWARD):
        scanned = jax.lax.associative_scan(_compose, (next_maps, next_own), reverse=True)
    second_ends = scanned[1]
    into_first = pulled(second_ends, *_second(pair_xs))
    first_ends = jnp.where(cut[:, 1, None, None], 0, into_first) + finals[0]
    d_ends = jnp.stack([first_ends, second_ends], 1).reshape(-1, *first_ends.shape[1:])
    d_ends = d_ends[:num_chunks]
    return d_ends, _initial_cotangents(step_bwd, d_ends, xs, d_finals, resets)


def _initial_cotangents(step_bwd, d_ends, xs, d_finals, resets):
    """Each sequence's initial-state cotangent, the start-state cotangent of its first
    chunk (only those chunks' pullbacks are formed again: all of them would be two more
    ``[2C, V]`` and ``[2C, K]`` arrays a chunk), or its final state's where it has none."""
    num_chunks, num_seqs = d_ends.shape[0], d_finals.shape[0]
    start_seq = _resets(resets, num_chunks)[0]
    target = jnp.where(start_seq >= 0, start_seq, num_seqs)
    chunks = jnp.arange(num_chunks, dtype=jnp.int32)
    first = jnp.zeros(num_seqs, jnp.int32).at[target].set(chunks, mode="drop")
    has_chunk = jnp.zeros(num_seqs, bool).at[target].set(True, mode="drop")
    taken = jax.tree.map(lambda x: x[first], (d_ends, *xs))
    d_starts, _ = jax.vmap(step_bwd)(*taken)
    return jnp.where(has_chunk[:, None, None], d_starts, d_finals)
