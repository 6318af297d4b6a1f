"""The grads kernel of the channel-gated backward (``mosaic_channel_backward.py``): a program
per (chunk, value head, block of 64 value channels) from the chunk's inputs, its start state
``S`` and end-state cotangent ``dS'`` (those of its value block) and dY.

The chunk's stage 1 is made again (``mosaic_channel_chunk.channel_scores``: ``M`` and ``A``
by halving levels; ``T = (I + A)^{-1}``; the decays), then, with ``U = T (X - (E * exp(G))
S^T)`` and ``dU = M^T dY + (K * exp(G_C - G)) dS'^T`` (``channel_chunked.py``'s backward)::

    dX = T^T dU,  dM = tril(dY U^T),  dA = -tril(dX U^T, -1),
    d(Q * exp(G)) = dY S,  d(E * exp(G)) = -dX S,  d(K * exp(G_C - G)) = U dS'.

The scores go back through their levels coarsest-agnostic (each level is a sum): for the level
with half-blocks of ``h``, ``L = (X * R) (K * Cc)^T`` kept on ``in_level(h)`` sends ``D = dL``
(``dM`` or ``dA`` there) to ``d(X * R) = D (K * Cc)`` and ``d(K * Cc) = D^T (X * R)``, so to
x, k and the level's sums ``P = log R`` and ``S = log Cc``. Each sum is a mask product with
the gates, ``P = B_P g``, so the gates' gradient is ``B_P^T dP + B_S^T dS`` summed over the
levels and the chunk's decays (the top level, ``h = C``), plus ``d exp(G_C) exp(G_C)`` on every
token: each a product with a transposed mask on the tensor cores, no chain of sums.

Every term is linear in the cotangents, so a program writes its value block's share of the
gradients of q, k, e and g; the op sums them (and a key head's value heads) in XLA. The
program's ``[C, 64]`` results leave as soon as they are made, one block of 64 key channels at
a time, into its share in HBM, which the levels add to (no ``[C, K]`` float32 tile is held).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gdn_jax.ops import mosaic_channel_chunk as mcc
from gdn_jax.ops import mosaic_chunk as mc
from gdn_jax.ops.mosaic_chunk import CHUNK, F32, Pieces

VALUE_BLOCK = 64
SQUARE = mcc.SQUARE
_INPUTS = ("q", "k", "e", "x", "g", "d_y", "starts", "d_ends")
_OUTPUTS = ("d_q", "d_k", "d_e", "d_x", "d_g")


def _scratch(count: int, key_dim: int) -> dict:
    """The chunk's tiles, F's scratch of ``channel_scores`` (``masks``, ``rows``, ``cols``),
    which also holds the states and the levels' operands once the scores are made, and four
    ``[C, C]`` squares."""
    tile = (CHUNK, key_dim)
    block = (CHUNK, VALUE_BLOCK)
    return dict(
        q=mc.pieces(count, tile),
        k=mc.pieces(count, tile),
        e=mc.pieces(count, tile),
        g=mc.pieces(mc.SEGMENT_PIECES, tile),
        x=mc.pieces(count, block),
        d_y=mc.pieces(count, block),
        masks=(mc.pieces(1, SQUARE), mc.pieces(1, SQUARE)),
        rows=(mc.pieces(count, tile), mc.pieces(count, tile)),
        cols=mc.pieces(count, tile),
        squares=tuple(mc.pieces(count, SQUARE) for _ in range(4)),
        loaded=plgpu.Barrier(num_arrivals=5 * count + mc.SEGMENT_PIECES),
        states_loaded=plgpu.Barrier(num_arrivals=2 * count),
    )


def _copy_inputs(hbm, s, *, chunk, head, group, block):
    """Start the TMA copies of the chunk's inputs (q and k of the key head, e, x and dY's
    value block, the gates' pieces of the value head)."""
    tokens = pl.ds(chunk * CHUNK, CHUNK)
    values = pl.ds(block * VALUE_BLOCK, VALUE_BLOCK)
    sources = (
        *(ref.at[tokens, head // group] for ref in (*hbm["q"], *hbm["k"])),
        *(ref.at[tokens, head] for ref in (*hbm["e"], *hbm["g"])),
        *(ref.at[tokens, head, values] for ref in (*hbm["x"], *hbm["d_y"])),
    )
    names = ("q", "k", "e", "g", "x", "d_y")
    tiles = (ref for name in names for ref in s[name].refs)
    for src, dst in zip(sources, tiles, strict=True):
        plgpu.copy_gmem_to_smem(src, dst, s["loaded"])


def _copy_states(hbm, s, *, chunk, head, block):
    """Start the TMA copies of the start state and end cotangent of the value block into
    ``rows`` (free once the scores are made)."""
    values = pl.ds(block * VALUE_BLOCK, VALUE_BLOCK)
    mc.commit()  # the warpgroup's writes to ``rows`` before TMA's
    for name, dst in zip(("starts", "d_ends"), s["rows"], strict=True):
        for src, ref in zip(hbm[name], dst.refs, strict=True):
            plgpu.copy_gmem_to_smem(src.at[chunk, head, values], ref, s["states_loaded"])


def _decayed_into(s, dst: Pieces, src: Pieces, which: int) -> None:
    """``src * exp(G)`` (``which`` 0) or ``src * exp(G_C - G)`` (1) into ``dst`` (``[C,
    K]`` operands), committed; the chunk masks must be in ``s["masks"]``."""

    def block(first, carry):
        keys = mcc.key_block(first)
        decay = mcc.chunk_decays(s["masks"], s["g"].at(*keys))[which]
        mc.store(dst.at(*keys), mc.load(src.at(*keys)) * decay)
        return carry

    mc.over_blocks(src.refs[0].shape[1], block, 0)
    mc.commit()


def _value_stage(s, out, index):
    """``U``, ``dU``, ``dX`` (written to ``d_x``), then ``dM`` and ``dA``. Leaves ``dM``,
    ``U``, ``dA``, ``dX`` in squares 0 to 3 and the states in ``rows``."""
    tokens, head, values = index
    sq = s["squares"]
    start, d_end = s["rows"]
    mcc.write_chunk_masks(s["masks"])
    _decayed_into(s, s["cols"], s["e"], 0)  # E * exp(G)
    plgpu.barrier_wait(s["states_loaded"])
    block = (CHUNK, VALUE_BLOCK)
    mc.store(s["x"], mc.load(s["x"]) - mc.product(block, (s["cols"], start.T)))
    mc.commit()
    mc.store(sq[1], mc.product(block, (sq[2], s["x"])))  # U = T (X - (E exp(G)) S^T)
    _decayed_into(s, s["cols"], s["k"], 1)  # K * exp(G_C - G); commits U too
    d_u = mc.product(block, (sq[0].T, s["d_y"]), (s["cols"], d_end.T))
    mc.store(s["x"], d_u)
    mc.commit()
    d_x = mc.product(block, (sq[2].T, s["x"]))
    out["d_x"].at[tokens, head, values][...] = d_x
    mc.store(sq[3], d_x)
    mc.commit()
    rows, cols = mc.iotas(SQUARE)
    mc.store(sq[0], jnp.where(rows >= cols, mc.product(SQUARE, (s["d_y"], sq[1].T)), 0.0))
    mc.store(sq[2], jnp.where(rows > cols, -mc.product(SQUARE, (sq[3], sq[1].T)), 0.0))
    mc.commit()


def _add(ref, tile) -> None:
    """``ref += tile`` for a float32 ``[C, 64]`` block of a share in HBM, which only this
    program writes (each thread reads back what it wrote: the same WGMMA layout)."""
    ref[...] = plgpu.load(ref, layout=mc.WGMMA, optimized=False) + tile


def _top_stage(s, shares):
    """The chunk's decays and the diagonal of ``M``: the first terms of every share, 64 key
    channels at a time. ``shares(first)``: the ``d_q, d_k, d_e, d_g`` blocks in HBM."""
    sq = s["squares"]
    start, d_end = s["rows"]
    rows, cols = mc.iotas(SQUARE)
    diagonal = jnp.sum(jnp.where(rows == cols, mc.load(sq[0]), 0.0), axis=1)
    mcc.write_chunk_masks(s["masks"])

    def block(first, carry):
        keys = mcc.key_block(first)
        q, k, e = (mc.load(s[name].at(*keys)) for name in ("q", "k", "e"))
        from_start, to_end = mcc.chunk_decays(s["masks"], s["g"].at(*keys))
        d_q, d_k, d_e, d_g = shares(first)
        d_q_start = mc.product(SQUARE, (s["d_y"], start.at(*keys)))  # dY S
        d_e_start = -mc.product(SQUARE, (sq[3], start.at(*keys)))  # -dX S
        d_k_end = mc.product(SQUARE, (sq[1], d_end.at(*keys)))  # U dS'
        down = mc.by_row(diagonal, SQUARE)
        d_q[...] = d_q_start * from_start + down * k
        d_e[...] = d_e_start * from_start
        d_k[...] = d_k_end * to_end + down * q
        # The sums' cotangents, where dY (read by the next block) is not: x holds dU no
        # more, cols K exp(G_C - G) no more.
        sums = (s["x"], s["cols"].at(*mcc.key_block(0)))
        mc.store(sums[0], (d_q_start * q + d_e_start * e) * from_start)  # d log exp(G)
        mc.store(sums[1], d_k_end * k * to_end)  # d log exp(G_C - G)
        mc.commit()
        last = jnp.sum(jnp.where(rows == CHUNK - 1, from_start, 0.0), axis=0)  # exp(G_C)
        d_whole = jnp.sum(mc.load(d_end.at(*keys)) * mc.load(start.at(*keys)), axis=0)
        d_g[...] = mc.by_col(d_whole * last, SQUARE) + _gate_product(s, sums)
        return carry

    mc.over_blocks(s["q"].refs[0].shape[1], block, 0)


def _gate_product(s, sums: tuple[Pieces, Pieces]):
    """``B_P^T dP + B_S^T dS``: the sums' cotangents ``sums`` back to the gates through the
    masks of the sums (in ``masks``)."""
    p_mask, s_mask = s["masks"]
    return mc.product(SQUARE, (p_mask.T, sums[0]), (s_mask.T, sums[1]))


def _levels_stage(s, shares):
    """Every level's terms, added to the shares, 64 key channels at a time (the levels
    inside, so that a level's factors are made where they are used)."""
    sq = s["squares"]
    d_m, _, d_a, _ = sq
    d_m_level, d_a_level = sq[1], sq[3]

    def key_block(first, carry):
        keys = mcc.key_block(first)
        x_rows = tuple(rows.at(*mcc.key_block(0)) for rows in s["rows"])
        k_cols = s["cols"].at(*mcc.key_block(0))
        d_q, d_k, d_e, d_g = shares(first)

        def level(j, carry):
            half = jax.lax.shift_left(jnp.int32(1), j)
            mcc.write_sum_masks(s["masks"], half)
            kept = mcc.in_level(half)
            mc.store(d_m_level, jnp.where(kept, mc.load(d_m), 0.0))
            mc.store(d_a_level, jnp.where(kept, mc.load(d_a), 0.0))
            sums = mcc.block_sums(s["masks"], s["g"].at(*keys))
            rows, cols = mcc.level_factors(sums, half)
            q, k, e = (mc.load(s[name].at(*keys)) for name in ("q", "k", "e"))
            mc.store(x_rows[0], q * rows)
            mc.store(x_rows[1], e * rows)
            mc.store(k_cols, k * cols)
            mc.commit()
            d_q_rows = mc.product(SQUARE, (d_m_level, k_cols))
            d_e_rows = mc.product(SQUARE, (d_a_level, k_cols))
            _add(d_q, d_q_rows * rows)
            _add(d_e, d_e_rows * rows)
            mc.store(s["x"], (d_q_rows * q + d_e_rows * e) * rows)
            d_k_cols = mc.product(SQUARE, (d_m_level.T, x_rows[0]), (d_a_level.T, x_rows[1]))
            _add(d_k, d_k_cols * cols)
            mc.store(s["d_y"], d_k_cols * k * cols)
            mc.commit()
            _add(d_g, _gate_product(s, (s["x"], s["d_y"])))
            return carry

        return jax.lax.fori_loop(jnp.int32(0), jnp.int32(mcc.LEVELS), level, carry)

    mc.over_blocks(s["q"].refs[0].shape[1], key_block, 0)


def _grads_kernel(*refs, group: int, **s):
    """One chunk, value head and value block: its shares of every input's gradient."""
    hbm = dict(zip(_INPUTS + _OUTPUTS, refs, strict=True))
    out = {name: hbm.pop(name) for name in _OUTPUTS}
    chunk, head, block = (jax.lax.axis_index(axis) for axis in ("chunk", "head", "block"))
    where = dict(chunk=chunk, head=head, block=block)
    _copy_inputs(hbm, s, group=group, **where)
    plgpu.barrier_wait(s["loaded"])
    sq = s["squares"]
    scores, strict = mcc.channel_scores(s, (s["q"], s["e"]), s["k"], s["g"], diagonal=(True, False))
    mc.store(sq[0], scores)
    _copy_states(hbm, s, **where)  # commits M
    mc.store(sq[2], mc.unit_lower_inverse(strict, sq[1], sq[2], sq[3]))
    tokens = pl.ds(chunk * CHUNK, CHUNK)
    _value_stage(s, out, (tokens, head, pl.ds(block * VALUE_BLOCK, VALUE_BLOCK)))

    def shares(first):
        keys = pl.ds(first, CHUNK)
        return tuple(
            out[name].at[block, tokens, head, keys] for name in ("d_q", "d_k", "d_e", "d_g")
        )

    _top_stage(s, shares)
    _levels_stage(s, shares)


def grads(q, k, e, x, g, d_y, starts, d_ends, *, interpret=None):
    """Every chunk's shares of the gradients: ``q``, ``k`` pieces ``[tokens, H, K]``, ``e``
    pieces ``[tokens, HV, K]``, ``x`` and ``d_y`` pieces ``[tokens, HV, V]``, ``g`` the
    log-decays' ``SEGMENT_PIECES`` pieces ``[tokens, HV, K]``
    (``mosaic_channel_forward.gate_pieces``), ``starts`` and ``d_ends`` pieces ``[chunks,
    HV, V, K]``. Returns float32 ``(d_q, d_k, d_e, d_x, d_g)``: ``d_q``, ``d_k``, ``d_e``,
    ``d_g`` ``[blocks, tokens, HV, K]``, each value block's share (``d_q`` and ``d_k`` of
    the value head, to be summed over a key head's value heads too), ``d_x [tokens, HV,
    V]``."""
    count = len(q)
    tokens, heads, key_dim = q[0].shape
    v_heads, value_dim = x[0].shape[1:]
    blocks = value_dim // VALUE_BLOCK
    share = jax.ShapeDtypeStruct((blocks, tokens, v_heads, key_dim), F32)
    out_type = (share, share, share, jax.ShapeDtypeStruct((tokens, v_heads, value_dim), F32), share)
    call = mc.kernel_call(
        functools.partial(_grads_kernel, group=v_heads // heads),
        name="channel_mosaic_grads",
        out_type=out_type,
        scratch=_scratch(count, key_dim),
        grid=dict(chunk=tokens // CHUNK, head=v_heads, block=blocks),
        interpret=interpret,
    )
    inputs = (q, k, e, x, g, d_y, starts, d_ends)
    return call(*(tuple(a) for a in inputs))
