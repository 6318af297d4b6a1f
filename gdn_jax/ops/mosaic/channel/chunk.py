"""What the channel-decay Mosaic GPU kernels (KDA, GDN-2) do inside one chunk: the per-channel
decays of ``chunked/channel_decays.py`` and the scores they weight, on register tiles and
shared-memory operands (``ops/mosaic/tiles.py``'s products, pieces and layouts).

A chunk's log-decays ``g [C, K]`` (float32, one per token and key channel, each ``<= 0``) are
in shared memory as ``SEGMENT_PIECES`` bf16 pieces, which hold them exactly. The halving
levels of ``chunked/channel_decays.py`` need, for half-blocks of ``h`` tokens, the sums within blocks
of ``h``: ``P_h[t]``, the gates of ``t``'s block up to and including ``t``, and ``S_h[t]``,
those after ``t`` in it. They are products of 0/1 masks ``[C, C]`` with the gates' pieces: a
sum of the gates of its own segment, never a difference of running sums, so that a -1e4 reset
rounds nothing after it away. A level needs ``P_h`` only on the second halves of its blocks of
``2h`` and ``S_h`` only on the first, so one mask gives both (``write_level_mask``), and one
``exp`` the level's factor of every row. The blocks of ``C`` (``h = C``) give the chunk's
decays, ``exp(P_C)`` from its start and ``exp(S_C)`` to its end (``write_chunk_masks``).

The scores ``M_ti = sum_c x_tc k_ic exp(G_tc - G_ic)`` (``i <= t``) are the diagonal ``x_t .
k_t`` plus one product a level (``channel_scores``, on two warpgroups, each making the
operands over half the key channels): for half ``h`` the rows ``x_t exp(P_h[t])`` of each
block's second half against the columns ``k_i exp(S_h[i])`` of its first half, kept where
``t`` and ``i`` are the second and the first half of one ``2h``-block (``level_pairs``).
Every ``exp`` is of a sum of gates, ``<= 0``: no level overflows, however strongly a chunk
decays. Elementwise work runs over blocks of 64 key channels (``tiles.over_blocks``) so that
a register tile is ``[64, 64]``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gdn_jax.ops.mosaic import tiles
from gdn_jax.ops.mosaic.limits import CHUNK
from gdn_jax.ops.mosaic.tiles import BF16, Pieces

SQUARE = (CHUNK, CHUNK)
LEVELS = CHUNK.bit_length() - 1  # halving levels of a chunk: half-blocks of 1, 2, ..., C/2


def key_block(first) -> tuple:
    """The index of the 64 key channels from ``first`` of a ``[C, K]`` operand."""
    return (slice(None), pl.ds(first, CHUNK))


def indices():
    """``(rows, cols)``: the token index of each row (``ROWS``) and of each column (``COLS``)
    of a ``[C, C]`` tile, as vectors: a thread holds 2 and 16 of them, where ``[C, C]``
    index tiles held 32 registers each through every loop that LLVM hoisted them out of."""
    return tuple(
        plgpu.broadcasted_iota(jnp.int32, (CHUNK,), 0, layout=layout)
        for layout in (tiles.ROWS, tiles.COLS)
    )


def same_block(size):
    """``[C, C]`` bool: where ``t`` and ``i`` lie in one block of ``size`` tokens (a power
    of two, possibly traced)."""
    rows, cols = indices()
    return tiles.by_row(rows & -size, SQUARE) == tiles.by_col(cols & -size, SQUARE)


def write_sum_masks(masks: tuple[Pieces, Pieces], half) -> None:
    """The masks of the sums within blocks of ``half`` tokens (a power of two, possibly
    traced) into ``masks`` (two ``[C, C]`` operands of one piece), committed: ``[t, j] = 1``
    where ``j`` is in ``t``'s block and ``j <= t`` (``P``), and ``j > t`` (``S``)."""
    rows, cols = indices()
    same = same_block(half)
    upto = tiles.by_col(cols, SQUARE) <= tiles.by_row(rows, SQUARE)
    masks[0].refs[0][...] = jnp.where(same & upto, 1.0, 0.0).astype(BF16)
    masks[1].refs[0][...] = jnp.where(same & ~upto, 1.0, 0.0).astype(BF16)
    tiles.commit()


def write_level_mask(mask: Pieces, half) -> None:
    """The mask of the level with half-blocks of ``half`` tokens (a power of two, possibly
    traced) into ``mask`` (a ``[C, C]`` operand of one piece), committed by the product
    that reads it. Row ``t`` sums the gates of ``t``'s block of ``half`` that its factor
    needs: on a second half of a ``2 half``-block those up to and including ``t`` (``P``),
    on a first half those after ``t`` (``S``). A row is a row factor or a column factor,
    never both (``level_pairs``), so one product gives both sums."""
    rows, cols = indices()
    row, col = tiles.by_row(rows, SQUARE), tiles.by_col(cols, SQUARE)
    upto = col <= row
    second = tiles.by_row((rows & half) != 0, SQUARE)
    keep = same_block(half) & ((second & upto) | (~second & ~upto))
    mask.refs[0][...] = jnp.where(keep, 1.0, 0.0).astype(BF16)


def level_factor(mask: Pieces, gates: Pieces):
    """``exp`` of the sums of ``write_level_mask``'s mask over the gates ``gates`` (a ``[C,
    64]`` view of their pieces): ``exp(P)`` on the second halves, ``exp(S)`` on the first, a
    float32 ``[C, 64]`` tile (WGMMA). Every sum is ``<= 0``: no factor overflows."""
    shape = (CHUNK, gates.refs[0].shape[1])
    return jnp.exp(tiles.product(shape, (mask, gates)))


def level_pairs(half):
    """``[C, C]`` bool: the ``(t, i)`` a level with half-blocks of ``half`` adds to: ``t`` in
    the second half and ``i`` in the first of one ``2 half``-block. Elsewhere its products
    pair a row factor with a row factor (or columns with columns) and are dropped."""
    rows, cols = indices()
    row_block = tiles.by_row(rows & -half, SQUARE)
    col_block = tiles.by_col(cols & -half, SQUARE)
    second = tiles.by_row((rows & half) != 0, SQUARE)
    return second & (row_block - col_block == half)


def _level_operands(s: dict, xs: tuple[Pieces, ...], k: Pieces, gates: Pieces, keys) -> None:
    """The decayed operands of one level over the key channels ``keys = (start, stop)``
    into ``s["rows"]`` (one per ``x``) and ``s["cols"]``: each ``x`` and ``k`` times the
    level's one factor (``level_factor``, its mask in ``s["masks"][0]``)."""

    def block(first, carry):
        channels = key_block(first)
        factor = level_factor(s["masks"][0], gates.at(*channels))
        for x, dst in zip(xs, s["rows"], strict=True):
            tiles.store(dst.at(*channels), tiles.load(x.at(*channels)) * factor)
        tiles.store(s["cols"].at(*channels), tiles.load(k.at(*channels)) * factor)
        return carry

    tiles.over_blocks(keys[1], block, 0, start=keys[0])


class Sync(NamedTuple):
    """The barriers of ``channel_scores``' two warpgroups (one arrival each): ``mask`` (the
    level's mask is written), ``operands`` (each side's share of the level's operands is
    stored) and ``read`` (the second side's product has read them)."""

    mask: object
    operands: tuple
    read: object


def channel_scores(s: dict, xs, k: Pieces, gates: Pieces, *, diagonal, side: int, keys, sync):
    """One of two warpgroups' share of the scores ``M_ti = sum_c x_tc k_ic exp(G_tc - G_ic)``
    of ``xs = (x_0, x_1)`` against ``k`` (``[C, K]`` operands): warpgroup ``side`` makes
    every level's decayed operands over its key channels ``keys = (start, stop)`` and the
    score of ``xs[side]``, ``i <= t`` where ``diagonal[side]``, else ``i < t`` (the WY
    system's ``A``), 0 elsewhere, a float32 ``[C, C]`` tile (WGMMA). ``gates``: the
    chunk's log-decays ``[C, K]`` in ``SEGMENT_PIECES`` pieces. Scratch in ``s``:
    ``masks`` (its first, a ``[C, C]`` operand of one piece, which side 0 writes), ``rows``
    (one ``[C, K]`` operand per ``x``) and ``cols`` (``[C, K]``); ``sync``: a ``Sync``.
    Side 0 must have every operand loaded before it calls this; a level's operands are
    written over only once the other side's product has read them."""
    x = xs[side]
    if diagonal[side]:
        total = jnp.where(same_block(1), tiles.product(SQUARE, (x, k.T)), 0.0)
    else:
        total = tiles.by_row(indices()[0].astype(jnp.float32) * 0.0, SQUARE)  # WGMMA layout

    def level(j, total):
        half = jax.lax.shift_left(jnp.int32(1), j)
        if side == 0:
            write_level_mask(s["masks"][0], half)
            tiles.hand_over(sync.mask)
        else:
            plgpu.barrier_wait(sync.mask)
        _level_operands(s, xs, k, gates, keys)
        tiles.hand_over(sync.operands[side])
        plgpu.barrier_wait(sync.operands[1 - side])
        kept = level_pairs(half)
        total = total + jnp.where(kept, tiles.product(SQUARE, (s["rows"][side], s["cols"].T)), 0.0)
        if side == 0:
            plgpu.barrier_wait(sync.read)  # before the next level's mask and operands
        else:
            plgpu.barrier_arrive(sync.read)
        return total

    return jax.lax.fori_loop(jnp.int32(0), jnp.int32(LEVELS), level, total)


def load_gates(g_hbm, gates: Pieces) -> None:
    """The chunk's log-decays ``g_hbm`` (a float32 ``[C, K]`` block in HBM) into ``gates``,
    their ``SEGMENT_PIECES`` bf16 pieces, 64 key channels at a time: split here, no array
    of the pieces is made in HBM (three bf16 copies of g, 192 MiB of KDA's peak at B=4,
    T=4096, H=16, K=128)."""

    def block(first, carry):
        keys = key_block(first)
        tile = plgpu.load(g_hbm.at[keys], layout=tiles.WGMMA, optimized=False)
        tiles.store(gates.at(*keys), tile)
        return carry

    tiles.over_blocks(g_hbm.shape[1], block, 0)


def write_chunk_masks(masks: tuple[Pieces, Pieces]) -> None:
    """The masks of the sums over the whole chunk (``write_sum_masks`` for ``half = C``):
    from its start through ``t``, and after ``t`` to its end."""
    write_sum_masks(masks, CHUNK)


def chunk_decay(masks: tuple[Pieces, Pieces], gates: Pieces, which: int):
    """``exp(G_t)`` (``which=0``, from the chunk's start) or ``exp(G_C - G_t)`` (``which=1``,
    to its end) of the 64 key channels of ``gates`` (a ``[C, 64]`` view of the pieces), a
    float32 ``[C, 64]`` tile (WGMMA), with the masks of ``write_chunk_masks`` in ``masks``.
    One product: a caller that uses one decay before it makes the other holds one tile."""
    shape = (CHUNK, gates.refs[0].shape[1])
    return jnp.exp(tiles.product(shape, (masks[which], gates)))


def chunk_decays(masks: tuple[Pieces, Pieces], gates: Pieces):
    """``(from_start, to_end)``: both of ``chunk_decay``."""
    return chunk_decay(masks, gates, 0), chunk_decay(masks, gates, 1)
