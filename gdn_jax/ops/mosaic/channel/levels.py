"""The last stage of the channel-gated grads kernel (``ops/mosaic/channel/grads.py``): the scores'
cotangents ``dM`` and ``dA`` back through the halving levels of
``channel/chunk.channel_scores`` to q, k, e and the gates; and what the kernel's
stages share.

The level with half-blocks of ``h`` adds ``L = (X * F) (K * F)^T`` where ``t`` is in the second
half and ``i`` in the first of one ``2h``-block (``X`` the queries for ``M``, the erase vectors
for ``A``; ``F`` the level's factor, ``chunk.level_factor``: ``exp(P)`` on second halves,
``exp(S)`` on first halves). With ``D = dL``, ``dM`` or ``dA`` on those pairs and 0 elsewhere,
it sends ``d(X * F) = D (K * F)`` to the rows and ``d(K * F) = D^T (X * F)`` to the columns, so
``F dX`` to x and ``F dK`` to k. The gates' share follows from x's and k's
(``levels_stage``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from gdn_jax.ops.mosaic import tiles
from gdn_jax.ops.mosaic.channel import chunk as in_chunk
from gdn_jax.ops.mosaic.limits import CHUNK
from gdn_jax.ops.mosaic.tiles import Pieces

SQUARE = in_chunk.SQUARE


def views(s: dict, zero) -> dict:
    """``s`` with every operand (a ``Pieces`` with a leading axis of one, alone or in a
    tuple) viewed at index ``zero[0]`` (a 0 read from HBM). A stage or a loop's step that
    reads its operands through views of its own makes their wgmma descriptors where it uses
    them: LLVM can neither hoist them out of the loop nor merge them with another stage's
    (each then holding registers from one use to the next), which made ptxas spill."""
    index = zero[0]

    def view(x):
        if isinstance(x, Pieces):
            return x.at(index)
        if isinstance(x, tuple) and x and isinstance(x[0], Pieces):
            return tuple(p.at(index) for p in x)
        return x

    return {name: view(x) for name, x in s.items()}


def add(ref, tile) -> None:
    """``ref += tile`` for a float32 ``[C, 64]`` block in HBM that only this program writes
    (each thread reads back what it wrote: the same WGMMA layout)."""
    ref[...] = plgpu.load(ref, layout=tiles.WGMMA, optimized=False) + tile


def token_rows(test):
    """``[C, 64]`` float32: 1 on the rows of the tokens ``t`` where ``test(t)``, else 0, from
    a ``ROWS`` vector (two entries a thread, where a ``[C, C]`` iota would be 32 registers
    that LLVM holds through a loop)."""
    tokens = plgpu.broadcasted_iota(jnp.int32, (CHUNK,), 0, layout=tiles.ROWS)
    return tiles.by_row(jnp.where(test(tokens), 1.0, 0.0), SQUARE)


class Space(NamedTuple):
    """The scratch of one warpgroup's levels (``levels_stage``): the level's ``mask`` (one
    piece), its ``D`` tiles of ``dM`` and ``dA`` (``d_m``, ``d_a``, which ``_gates_stage``
    takes for ``dG`` after the levels), the row factors of q and e (``rows``) and the
    column factors of k (``cols``), all ``[C, C]``."""

    mask: Pieces
    d_m: Pieces
    d_a: Pieces
    rows: tuple[Pieces, Pieces]
    cols: Pieces


def _level(scratch, j, outputs, keys: tuple[int, int], space) -> None:
    """One level's terms, added to ``outputs(first)`` (the ``d_q, d_k, d_e`` blocks in HBM
    of the 64 key channels from ``first``) for the key channels ``keys = (start, stop)``, 64
    at a time: the level's mask and its ``D`` tiles once, then a factor and three products
    a block. ``dM`` and ``dA`` are in ``u`` and ``inverse``; ``space(views)``: the
    warpgroup's ``Space``."""
    s = views(scratch, scratch["zero"])
    at = space(s)
    half = jax.lax.shift_left(jnp.int32(1), j)
    in_chunk.write_level_mask(at.mask, half)
    pairs = in_chunk.level_pairs(half)
    tiles.store(at.d_m, jnp.where(pairs, tiles.load(s["u"]), 0.0))
    tiles.store(at.d_a, jnp.where(pairs, tiles.load(s["inverse"]), 0.0))

    def block(first, carry):
        s = views(scratch, scratch["zero"])
        at = space(s)
        d_q, d_k, d_e = outputs(first)[:3]
        channels = in_chunk.key_block(first)
        factor = in_chunk.level_factor(at.mask, s["g"].at(*channels))
        tiles.store(at.rows[0], tiles.load(s["q"].at(*channels)) * factor)
        tiles.store(at.rows[1], tiles.load(s["e"].at(*channels)) * factor)
        tiles.store(at.cols, tiles.load(s["k"].at(*channels)) * factor)
        terms = ((at.d_m.T, at.rows[0]), (at.d_a.T, at.rows[1]))
        add(d_k, tiles.product(SQUARE, *terms) * factor)
        add(d_q, tiles.product(SQUARE, (at.d_m, at.cols)) * factor)
        add(d_e, tiles.product(SQUARE, (at.d_a, at.cols)) * factor)
        return carry

    tiles.over_blocks(keys[1], block, 0, start=keys[0])


def load_scores(scratch, out, index) -> None:
    """``dM`` and ``dA``, summed over the value blocks in ``out["d_scores"]``, into ``u``
    and ``inverse``, for ``levels_stage``."""
    tokens, head = index
    s = views(scratch, scratch["zero"])
    for i, name in enumerate(("u", "inverse")):
        d_scores = out["d_scores"].at[i, tokens, head]
        tiles.store(s[name], plgpu.load(d_scores, layout=tiles.WGMMA, optimized=False))


def levels_stage(scratch, outputs, keys: tuple[int, int], space) -> None:
    """Every level's terms in the gradients of the key channels ``keys = (start, stop)``
    (``_level``; ``load_scores`` first), then their gates' gradient (``_gates_stage``).
    ``outputs(first)``: the blocks of the gradients in HBM, ``d_q, d_k, d_e, d_g``."""

    def level(j, carry):
        _level(scratch, j, outputs, keys, space)
        return carry

    jax.lax.fori_loop(jnp.int32(0), jnp.int32(in_chunk.LEVELS), level, 0)
    _gates_stage(scratch, outputs, keys, space)


def _gates_stage(scratch, outputs, keys: tuple[int, int], space) -> None:
    """The gates' gradient of the key channels ``keys``, once every other is complete.

    Every decay of the chunk is ``exp`` of a difference of ``G`` (the gates' sums from the
    chunk's start) and multiplies a q, e or k (``exp(G_t - G_i)`` of a score ``x_t k_i``,
    ``exp(G)`` of ``q_start`` and ``E exp(G)``, ``exp(G_C - G)`` of ``k_end``), so the
    cotangent of ``G`` is ``q dq + e de - k dk`` (M's diagonal sends ``q`` and ``k`` the
    same product and cancels), plus what ``G_C`` gets, on the last row, which ``d_g``'s
    block holds from the value blocks' stages. Then ``dg_j = sum_{t >= j} dG_t``: one
    product with the transposed mask of the sums from the chunk's start (``masks[0]``)."""

    def block(first, carry):
        s = views(scratch, scratch["zero"])
        channels = in_chunk.key_block(first)
        d_g = outputs(first)[3]
        d_big_g = plgpu.load(d_g, layout=tiles.WGMMA, optimized=False)
        signs = (1.0, -1.0, 1.0)
        for ref, name, sign in zip(outputs(first)[:3], "qke", signs, strict=True):
            grad = plgpu.load(ref, layout=tiles.WGMMA, optimized=False)
            d_big_g = d_big_g + sign * tiles.load(s[name].at(*channels)) * grad
        summed = space(s).d_a
        tiles.store(summed, d_big_g)
        d_g[...] = tiles.product(SQUARE, (s["masks"][0].T, summed))
        return carry

    tiles.over_blocks(keys[1], block, 0, start=keys[0])
