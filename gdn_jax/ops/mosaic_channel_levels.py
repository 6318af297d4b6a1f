"""The levels kernel of the channel-gated backward (``mosaic_channel_backward.py``): the
scores' cotangents ``dM`` and ``dA`` (``mosaic_channel_grads``, summed over value blocks) back
through the halving levels of ``mosaic_channel_chunk.channel_scores`` to q, k, e and the
gates, a program per (chunk, value head).

The level with half-blocks of ``h`` adds ``L = (X * R) (K * Cc)^T`` where ``t`` and ``i`` are
the two halves of one ``2h``-block (``X`` the queries for ``M``, the erase vectors for ``A``;
``R = exp(P)`` on second halves, ``Cc = exp(S)`` on first halves, ``P`` and ``S`` the gates'
sums within blocks of ``h`` before and after a token). With ``D = dL`` (``dM`` or ``dA``
there) it sends ``d(X * R) = D (K * Cc)`` and ``d(K * Cc) = D^T (X * R)``, so to x, k and the
sums; each sum is a mask product with the gates, ``P = B_P g``, so the gates get ``B_P^T dP
+ B_S^T dS``, a product with the transposed masks on the tensor cores. ``D`` is ``dM`` times
the mask of ``i <= t`` within blocks of ``2h``: where ``t`` and ``i`` share a half, the
factors are 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gdn_jax.ops import mosaic_channel_chunk as mcc
from gdn_jax.ops import mosaic_channel_grads as mcg
from gdn_jax.ops import mosaic_chunk as mc
from gdn_jax.ops.mosaic_chunk import CHUNK, F32

SQUARE = mcc.SQUARE
_OUTPUTS = ("d_q", "d_k", "d_e", "d_g")


def _add(ref, tile) -> None:
    """``ref += tile`` for a float32 ``[C, 64]`` block of an output in HBM, which only this
    program writes (each thread reads back what it wrote: the same WGMMA layout)."""
    ref[...] = plgpu.load(ref, layout=mc.WGMMA, optimized=False) + tile


def _write_level_masks(s, j, z) -> None:
    """The masks of the level with half-blocks of ``h = 2^j`` (``j`` traced): the sums'
    within blocks of ``h`` (``[t, i] = 1`` where ``i`` is in ``t``'s block, ``i <= t``, and
    ``i > t``) and, in the third, ``i <= t`` within blocks of ``2 h``, which keeps a level's
    products where that level puts them (below the diagonal; where ``t`` and ``i`` share a
    half of the block, the factors are 0). Each test depends on ``j``, so that LLVM hoists
    no ``[C, C]`` tile of them out of the loop over the levels."""
    rows, cols = mc.iotas(SQUARE)
    half = jax.lax.shift_left(jnp.int32(1), j)
    masks = (*(mask.at(z) for mask in s["masks"]), s["block_mask"])
    for dst, size, after in zip(masks, (half, half, 2 * half), (False, True, False), strict=True):
        same = (rows & -size) == (cols & -size)
        later = (cols & (size - 1)) > (rows & (size - 1))
        keep = same & (later if after else ~later)
        dst.refs[0][...] = jnp.where(keep, 1.0, 0.0).astype(mc.BF16)
    mc.commit()


def _levels_stage(s, outputs):
    """Every level's terms, added to the outputs, 64 key channels at a time (the levels
    inside, so that a level's factors are made where they are used). ``outputs(first)``:
    the ``d_q, d_k, d_e, d_g`` blocks in HBM."""

    def key_block(first, carry):
        keys = mcc.key_block(first)
        d_q, d_k, d_e, d_g = outputs(first)
        zero = mcg.token_rows(lambda t: t < 0)
        for ref in (d_q, d_k, d_e, d_g):
            ref[...] = zero

        def level(j, carry):
            # Every operand of a product is viewed at an index read from HBM each level (a
            # 0): its wgmma descriptors are made in the loop, where LLVM had hoisted them out
            # of it and ptxas spilled the registers that held them through it.
            z = s["zero"][0]
            d_m_level, d_a_level = (x.at(z) for x in s["level_scores"])
            x_rows = tuple(x.at(z) for x in s["x_rows"])
            k_cols = s["k_cols"].at(z)
            masks = tuple(x.at(z) for x in s["masks"])
            gates = s["g"].at(z).at(*keys)
            half = jax.lax.shift_left(jnp.int32(1), j)
            _write_level_masks(s, j, z)
            block = mc.load(s["block_mask"])
            mc.store(d_m_level, mc.load(s["d_m"]) * block)
            mc.store(d_a_level, mc.load(s["d_a"]) * block)
            second = mcg.token_rows(lambda t: (t & half) != 0)
            p_sums = mc.product(SQUARE, (masks[0], gates))
            rows = jnp.exp(p_sums) * second  # exp(P) on the second halves
            mc.store(x_rows[0], mc.load(s["q"].at(*keys)) * rows)
            mc.store(x_rows[1], mc.load(s["e"].at(*keys)) * rows)
            s_sums = mc.product(SQUARE, (masks[1], gates))
            cols = jnp.exp(s_sums) * (1.0 - second)  # exp(S) on the first halves
            mc.store(k_cols, mc.load(s["k"].at(*keys)) * cols)
            mc.commit()
            d_k_cols = mc.product(SQUARE, (d_m_level.T, x_rows[0]), (d_a_level.T, x_rows[1]))
            _add(d_k, d_k_cols * cols)
            # The sums' cotangents take the row factors' place, read by now.
            sums = x_rows
            mc.store(sums[1], d_k_cols * mc.load(s["k"].at(*keys)) * cols)
            d_q_rows = mc.product(SQUARE, (d_m_level, k_cols))
            _add(d_q, d_q_rows * rows)
            d_sum = d_q_rows * mc.load(s["q"].at(*keys))
            d_e_rows = mc.product(SQUARE, (d_a_level, k_cols))
            _add(d_e, d_e_rows * rows)
            mc.store(sums[0], (d_sum + d_e_rows * mc.load(s["e"].at(*keys))) * rows)
            mc.commit()
            _add(d_g, mc.product(SQUARE, (masks[0].T, sums[0]), (masks[1].T, sums[1])))
            return carry

        return jax.lax.fori_loop(jnp.int32(0), jnp.int32(mcc.LEVELS), level, carry)

    mc.over_blocks(s["q"].refs[0].shape[1], key_block, 0)


def _levels_kernel(*refs, group: int, **s):
    """One chunk and value head: every level's terms of the gradients of q, k, e and g."""
    names = ("q", "k", "e", "g", "d_m", "d_a", "zero", *_OUTPUTS)
    hbm = dict(zip(names, refs, strict=True))
    out = {name: hbm.pop(name) for name in _OUTPUTS}
    s = dict(s, zero=hbm.pop("zero"))
    chunk, head = jax.lax.axis_index("chunk"), jax.lax.axis_index("head")
    tokens = pl.ds(chunk * CHUNK, CHUNK)
    sources = (
        *(ref.at[tokens, head // group] for ref in (*hbm["q"], *hbm["k"])),
        *(ref.at[tokens, head] for name in ("e", "g", "d_m", "d_a") for ref in hbm[name]),
    )
    names = ("q", "k", "e", "g", "d_m", "d_a")
    tiles = (ref.at[0] if name == "g" else ref for name in names for ref in s[name].refs)
    for src, dst in zip(sources, tiles, strict=True):
        plgpu.copy_gmem_to_smem(src, dst, s["loaded"])
    plgpu.barrier_wait(s["loaded"])

    def outputs(first):
        keys = pl.ds(first, CHUNK)
        return tuple(out[name].at[tokens, head, keys] for name in _OUTPUTS)

    _levels_stage(s, outputs)


def levels(q, k, e, g, d_m, d_a, *, interpret=None):
    """The levels' terms of every chunk's gradients: ``q``, ``k`` pieces ``[tokens, H, K]``,
    ``e`` pieces ``[tokens, HV, K]``, ``g`` the gates' ``SEGMENT_PIECES`` pieces ``[tokens,
    HV, K]``, ``d_m`` and ``d_a`` (the scores' cotangents, summed over value blocks) pieces
    ``[tokens, HV, C]``. Returns float32 ``(d_q, d_k, d_e, d_g)`` ``[tokens, HV, K]`` (those
    of q and k per value head)."""
    count = len(q)
    tokens, heads, key_dim = q[0].shape
    v_heads = e[0].shape[1]
    tile = (CHUNK, key_dim)
    square = functools.partial(mc.pieces, count, (1, *SQUARE))
    scratch = dict(
        q=mc.pieces(count, tile),
        k=mc.pieces(count, tile),
        e=mc.pieces(count, tile),
        g=mc.pieces(mc.SEGMENT_PIECES, (1, *tile)),
        d_m=mc.pieces(count, SQUARE),
        d_a=mc.pieces(count, SQUARE),
        masks=(mc.pieces(1, (1, *SQUARE)), mc.pieces(1, (1, *SQUARE))),
        block_mask=mc.pieces(1, SQUARE),
        level_scores=(square(), square()),
        x_rows=(square(), square()),
        k_cols=square(),
        loaded=plgpu.Barrier(num_arrivals=5 * count + mc.SEGMENT_PIECES),
    )
    share = jax.ShapeDtypeStruct((tokens, v_heads, key_dim), F32)
    call = mc.kernel_call(
        functools.partial(_levels_kernel, group=v_heads // heads),
        name="channel_mosaic_levels",
        out_type=(share,) * 4,
        scratch=scratch,
        grid=dict(chunk=tokens // CHUNK, head=v_heads),
        interpret=interpret,
    )
    zero = jnp.zeros((1,), jnp.int32)
    return call(*(tuple(a) for a in (q, k, e, g, d_m, d_a)), zero)
