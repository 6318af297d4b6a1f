"""The last stage of the channel-gated grads kernel (``ops/mosaic/channel/grads.py``): the scores'
cotangents ``dM`` and ``dA`` back through the halving levels of
``channel/chunk.channel_scores`` to q, k, e and the gates; and what the kernel's
stages share.

The level with half-blocks of ``h`` adds ``L = (X * R) (K * Cc)^T`` where ``t`` and ``i`` are
the two halves of one ``2h``-block (``X`` the queries for ``M``, the erase vectors for ``A``;
``R = exp(P)`` on second halves, ``Cc = exp(S)`` on first halves, ``P`` and ``S`` the gates'
sums within blocks of ``h`` up to and after a token). With ``D = dL`` (``dM`` or ``dA``
there) it sends ``d(X * R) = D (K * Cc)`` and ``d(K * Cc) = D^T (X * R)``, so to x, k and the
sums; each sum is a mask product with the gates, ``P = B_P g``, so the gates get ``B_P^T dP
+ B_S^T dS``, a product with the transposed masks on the tensor cores. ``D`` is ``dM`` times
the mask of ``i <= t`` within blocks of ``2h``: where ``t`` and ``i`` share a half, the
factors are 0.
"""

from __future__ import annotations

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


def _write_level_masks(masks: tuple[Pieces, Pieces, Pieces], j) -> None:
    """The masks of the level with half-blocks of ``h = 2^j`` (``j`` traced): the sums'
    within blocks of ``h`` (``[t, i] = 1`` where ``i`` is in ``t``'s block, ``i <= t``, and
    ``i > t``) and, in the third, ``i <= t`` within blocks of ``2 h``. Each test depends on
    ``j``, so that LLVM hoists no ``[C, C]`` tile of them out of the loop over the levels."""
    rows, cols = tiles.iotas(SQUARE)
    half = jax.lax.shift_left(jnp.int32(1), j)
    for dst, size, after in zip(masks, (half, half, 2 * half), (False, True, False), strict=True):
        same = (rows & -size) == (cols & -size)
        later = (cols & (size - 1)) > (rows & (size - 1))
        keep = same & (later if after else ~later)
        dst.refs[0][...] = jnp.where(keep, 1.0, 0.0).astype(tiles.BF16)
    tiles.commit()


def _level(s, keys, j, outputs) -> None:
    """One level's terms of the 64 key channels ``keys``, added to ``outputs`` (``d_q, d_k,
    d_e, d_g`` blocks in HBM). ``dM`` and ``dA`` are in ``u`` and ``inverse``; ``m``, ``x``,
    ``d_y`` and the first 64 columns of ``rows[0]`` and ``cols`` are scratch."""
    d_q, d_k, d_e, d_g = outputs
    d_m_level, d_a_level = s["m"], s["x"]
    x_rows = (s["d_y"], s["rows"][0].at(*in_chunk.key_block(0)))
    k_cols = s["cols"].at(*in_chunk.key_block(0))
    masks = s["masks"]
    gates = s["g"].at(*keys)
    half = jax.lax.shift_left(jnp.int32(1), j)
    _write_level_masks((*masks, s["block_mask"]), j)
    block = tiles.load(s["block_mask"])
    tiles.store(d_m_level, tiles.load(s["u"]) * block)
    tiles.store(d_a_level, tiles.load(s["inverse"]) * block)
    second = token_rows(lambda t: (t & half) != 0)
    rows = jnp.exp(tiles.product(SQUARE, (masks[0], gates))) * second  # exp(P), second halves
    tiles.store(x_rows[0], tiles.load(s["q"].at(*keys)) * rows)
    tiles.store(x_rows[1], tiles.load(s["e"].at(*keys)) * rows)
    cols = jnp.exp(tiles.product(SQUARE, (masks[1], gates))) * (1.0 - second)  # exp(S), first
    tiles.store(k_cols, tiles.load(s["k"].at(*keys)) * cols)
    tiles.commit()
    d_k_cols = tiles.product(SQUARE, (d_m_level.T, x_rows[0]), (d_a_level.T, x_rows[1]))
    add(d_k, d_k_cols * cols)
    sums = x_rows  # the sums' cotangents take the row factors' place, read by now
    tiles.store(sums[1], d_k_cols * tiles.load(s["k"].at(*keys)) * cols)
    d_q_rows = tiles.product(SQUARE, (d_m_level, k_cols))
    add(d_q, d_q_rows * rows)
    d_sum = d_q_rows * tiles.load(s["q"].at(*keys))
    d_e_rows = tiles.product(SQUARE, (d_a_level, k_cols))
    add(d_e, d_e_rows * rows)
    tiles.store(sums[0], (d_sum + d_e_rows * tiles.load(s["e"].at(*keys))) * rows)
    tiles.commit()
    add(d_g, tiles.product(SQUARE, (masks[0].T, sums[0]), (masks[1].T, sums[1])))


def levels_stage(scratch, out, outputs, index) -> None:
    """Every level's terms, added to the gradients, 64 key channels at a time (the levels
    inside). ``dM`` and ``dA``, summed over the value blocks in ``out["d_scores"]``, go into
    ``u`` and ``inverse``; ``outputs(first)``: the blocks of the gradients in HBM."""
    tokens, head = index
    s = views(scratch, scratch["zero"])
    for i, name in enumerate(("u", "inverse")):
        d_scores = out["d_scores"].at[i, tokens, head]
        tiles.store(s[name], plgpu.load(d_scores, layout=tiles.WGMMA, optimized=False))
    tiles.commit()

    def key_block(first, carry):
        keys = in_chunk.key_block(first)

        def level(j, carry):
            _level(views(scratch, scratch["zero"]), keys, j, outputs(first))
            return carry

        return jax.lax.fori_loop(jnp.int32(0), jnp.int32(in_chunk.LEVELS), level, carry)

    tiles.over_blocks(s["q"].refs[0].shape[1], key_block, 0)
