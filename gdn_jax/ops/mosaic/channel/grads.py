"""The grads kernel of the channel-gated backward (``ops/mosaic/channel/reverse.py``): a program
per (chunk, value head) from the chunk's inputs, its scores ``M`` (the forward's factors),
the start state ``S`` and end-state cotangent ``dS'`` and dY: every gradient of the contract.

The chunk's system ``A`` again (``channel/chunk.channel_scores``) and ``T = (I +
A)^{-1}``; then, 64 value channels at a time (their tiles of x, dY, ``S`` and ``dS'`` copied
in by TMA as the last block's are done with), with ``U = T (X - (E * exp(G)) S^T)`` and ``dU
= M^T dY + (K * exp(G_C - G)) dS'^T`` (``ops/chunked/channel.py``'s backward)::

    dX = T^T dU,  dM += dY U^T,  dA += -dX U^T,
    d(Q * exp(G)) = dY S,  d(E * exp(G)) = -dX S,  d(K * exp(G_C - G)) = U dS',

the last three and ``M``'s diagonal added to the gradients of q, k, e and g at once (the
decays' cotangents back to the gates by products with the transposed masks of their sums:
``exp(G) = exp(B_P g)``, ``dg = B_P^T dP``; ``exp(G_C)`` is the last row of ``exp(G)``).
Last, ``dM`` and ``dA`` back through the scores' halving levels
(``ops/mosaic/channel/levels.py``). The gradients accumulate in HBM, in the program's own
blocks of them: no value block keeps a share of its own, and no ``[C, K]`` float32 tile is
held (each ``[C, 64]`` result leaves as soon as it is made).

Each stage, and each step of a loop, reads its operands through views of its own at an index
read from HBM (``views``): their wgmma descriptors are then made where they are used.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gdn_jax.ops.mosaic import tiles
from gdn_jax.ops.mosaic.channel import chunk as in_chunk
from gdn_jax.ops.mosaic.channel import levels
from gdn_jax.ops.mosaic.channel.levels import SQUARE, add, token_rows, views
from gdn_jax.ops.mosaic.limits import CHUNK, VALUE_BLOCK
from gdn_jax.ops.mosaic.tiles import F32, Pieces

_INPUTS = ("q", "k", "e", "x", "g", "scores", "d_y", "starts", "d_ends", "zero")
_OUTPUTS = ("d_q", "d_k", "d_e", "d_g", "d_x", "d_scores")


def _scratch(count: int, key_dim: int) -> dict:
    """The chunk's tiles (a value block of x and dY), the scratch of ``channel_scores``
    (``masks``, ``rows``, ``cols``), which also holds a value block's states once the
    system's scores are made, the levels' ``block_mask`` and three ``[C, C]`` squares:
    ``u`` (the inverse's scratch, then ``U``), ``inverse`` (``T``) and ``m`` (the inverse's
    scratch, then ``M``); every operand with a leading axis of one (``views``)."""

    def operand(number, shape):
        return tiles.pieces(number, (1, *shape))

    tile = (CHUNK, key_dim)
    block = (CHUNK, VALUE_BLOCK)
    return dict(
        q=operand(count, tile),
        k=operand(count, tile),
        e=operand(count, tile),
        g=operand(tiles.SEGMENT_PIECES, tile),
        x=operand(count, block),
        d_y=operand(count, block),
        masks=(operand(1, SQUARE), operand(1, SQUARE)),
        block_mask=operand(1, SQUARE),
        rows=(operand(count, tile), operand(count, tile)),
        cols=operand(count, tile),
        u=operand(count, SQUARE),
        inverse=operand(count, SQUARE),
        m=operand(count, SQUARE),
        loaded=plgpu.Barrier(num_arrivals=3 * count + tiles.SEGMENT_PIECES),
        m_loaded=plgpu.Barrier(num_arrivals=count),
        block_loaded=plgpu.Barrier(num_arrivals=4 * count),
    )


def _copy(pairs, barrier) -> None:
    """Start the TMA copies ``(source, pieces)`` arriving on ``barrier``."""
    tiles.commit()  # the warpgroup's last writes to the tiles before TMA's
    for src, dst in pairs:
        for src_ref, dst_ref in zip(src, dst.refs, strict=True):
            plgpu.copy_gmem_to_smem(src_ref, dst_ref, barrier)


def _decayed_into(s, dst: Pieces, src: Pieces, which: int) -> None:
    """``src * exp(G)`` (``which`` 0) or ``src * exp(G_C - G)`` (1) into ``dst`` (``[C,
    K]`` operands), committed; the chunk masks must be in ``s["masks"]``."""

    def block(first, carry):
        keys = in_chunk.key_block(first)
        decay = in_chunk.chunk_decays(s["masks"], s["g"].at(*keys))[which]
        tiles.store(dst.at(*keys), tiles.load(src.at(*keys)) * decay)
        return carry

    tiles.over_blocks(src.refs[0].shape[1], block, 0)
    tiles.commit()


def _value_stage(s, out, index):
    """One value block: ``U``, ``dU``, ``dX`` (written to ``d_x``), then ``dY U^T`` and
    ``-dX U^T`` added to ``dM`` and ``dA`` (``d_scores``), whole: the levels keep what lies
    below the diagonal. Leaves ``U`` in ``u``, ``dX`` in ``x``, the states in ``rows``; the
    chunk masks (``write_chunk_masks``) must be in ``masks``."""
    tokens, head, values = index
    start, d_end = s["rows"]
    _decayed_into(s, s["cols"], s["e"], 0)  # E * exp(G)
    plgpu.barrier_wait(s["block_loaded"])
    block = (CHUNK, VALUE_BLOCK)
    tiles.store(s["x"], tiles.load(s["x"]) - tiles.product(block, (s["cols"], start.T)))
    tiles.commit()
    tiles.store(s["u"], tiles.product(block, (s["inverse"], s["x"])))  # U = T (X - (E exp(G)) S^T)
    _decayed_into(s, s["cols"], s["k"], 1)  # K * exp(G_C - G); commits U too
    d_u = tiles.product(block, (s["m"].T, s["d_y"]), (s["cols"], d_end.T))
    tiles.store(s["x"], d_u)
    tiles.commit()
    d_x = tiles.product(block, (s["inverse"].T, s["x"]))
    if "d_x" in s:  # bf16 leaves by TMA: a warpgroup's bf16 store to HBM is half sectors
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last block's copy out
        s["d_x"][...] = d_x.astype(s["d_x"].dtype)
        tiles.copy_out((s["d_x"], out["d_x"].at[tokens, head, values]))
    else:
        out["d_x"].at[tokens, head, values][...] = d_x
    tiles.store(s["x"], d_x)
    tiles.commit()
    add(out["d_scores"].at[0, tokens, head], tiles.product(SQUARE, (s["d_y"], s["u"].T)))
    add(out["d_scores"].at[1, tokens, head], -tiles.product(SQUARE, (s["x"], s["u"].T)))


def _decay(s, keys, which: int):
    """``exp(G)`` (``which`` 0) or ``exp(G_C - G)`` (1) of the 64 key channels ``keys``: a
    product of one chunk mask (``write_chunk_masks``) with the gates."""
    return jnp.exp(tiles.product(SQUARE, (s["masks"][which], s["g"].at(*keys))))


def _top_stage(scratch, outputs):
    """One value block's terms of the chunk's decays and of ``M``'s diagonal in every
    gradient, 64 key channels at a time, each tile used as soon as it is made.
    ``outputs(first)``: the ``d_q, d_k, d_e, d_g`` blocks in HBM."""
    s = views(scratch, scratch["zero"])
    # dM's diagonal, dY_t . U_t, without a [C, C] mask.
    diagonal = tiles.by_row(jnp.sum(tiles.load(s["d_y"]) * tiles.load(s["u"]), axis=1), SQUARE)

    def block(first, carry):
        s = views(scratch, scratch["zero"])
        start, d_end = s["rows"]
        # The sums' cotangents, one at a time, where K exp(G_C - G) was.
        sums = s["cols"].at(*in_chunk.key_block(0))
        p_mask, s_mask = s["masks"]
        keys = in_chunk.key_block(first)
        d_q, d_k, d_e, d_g = outputs(first)
        from_start = _decay(s, keys, 0)
        d_q_start = tiles.product(SQUARE, (s["d_y"], start.at(*keys)))  # dY S
        add(d_q, d_q_start * from_start + diagonal * tiles.load(s["k"].at(*keys)))
        d_sum = d_q_start * tiles.load(s["q"].at(*keys))
        d_e_start = -tiles.product(SQUARE, (s["x"], start.at(*keys)))  # -dX S
        add(d_e, d_e_start * from_start)
        d_sum = d_sum + d_e_start * tiles.load(s["e"].at(*keys))
        # exp(G_C) is row C - 1 of exp(G): d exp(G_C) joins that row's cotangent.
        d_whole = jnp.sum(tiles.load(d_end.at(*keys)) * tiles.load(start.at(*keys)), axis=0)
        last = token_rows(lambda t: t == CHUNK - 1) * tiles.by_col(d_whole, SQUARE)
        tiles.store(sums, (d_sum + last) * from_start)
        tiles.commit()
        d_gates = tiles.product(SQUARE, (p_mask.T, sums))  # B_P^T dP
        to_end = _decay(s, keys, 1)
        d_k_end = tiles.product(SQUARE, (s["u"], d_end.at(*keys)))  # U dS'
        add(d_k, d_k_end * to_end + diagonal * tiles.load(s["q"].at(*keys)))
        tiles.store(sums, d_k_end * tiles.load(s["k"].at(*keys)) * to_end)
        tiles.commit()
        add(d_g, d_gates + tiles.product(SQUARE, (s_mask.T, sums)))  # + B_S^T dS
        return carry

    tiles.over_blocks(s["q"].refs[0].shape[1], block, 0)


def _zero_outputs(out, tokens, head, key_dim: int) -> None:
    """Zeros into the program's blocks of the gradients it accumulates."""
    zero = token_rows(lambda t: t < 0)
    for first in range(0, key_dim, CHUNK):
        for name in ("d_q", "d_k", "d_e", "d_g"):
            out[name].at[tokens, head, pl.ds(first, CHUNK)][...] = zero
    for i in range(2):
        out["d_scores"].at[i, tokens, head][...] = zero


def _grads_kernel(*refs, group: int, **scratch):
    """One chunk and value head: every gradient of the contract."""
    hbm = dict(zip(_INPUTS + _OUTPUTS, refs, strict=True))
    out = {name: hbm.pop(name) for name in _OUTPUTS}
    scratch["zero"] = hbm.pop("zero")
    chunk, head = jax.lax.axis_index("chunk"), jax.lax.axis_index("head")
    tokens = pl.ds(chunk * CHUNK, CHUNK)
    s = views(scratch, scratch["zero"])
    inputs = [(hbm[name], s[name]) for name in ("q", "k")]
    inputs = [([ref.at[tokens, head // group] for ref in src], dst) for src, dst in inputs]
    inputs += [([ref.at[tokens, head] for ref in hbm[name]], s[name]) for name in ("e", "g")]
    _copy(inputs, s["loaded"])
    key_dim = s["q"].refs[0].shape[1]
    _zero_outputs(out, tokens, head, key_dim)
    plgpu.barrier_wait(s["loaded"])
    one_row = dict(s, rows=s["rows"][:1])
    (strict,) = in_chunk.channel_scores(one_row, (s["e"],), s["k"], s["g"], diagonal=False)
    tiles.store(s["inverse"], tiles.unit_lower_inverse(strict, s["u"], s["inverse"], s["m"]))
    _copy([([ref.at[tokens, head] for ref in hbm["scores"]], s["m"])], s["m_loaded"])
    # The chunk's masks, which the value blocks' stages read, once: written in the loop over
    # them, their values were hoisted out of it by LLVM and held in registers through it.
    in_chunk.write_chunk_masks(s["masks"])
    plgpu.barrier_wait(s["m_loaded"])

    def outputs(first):
        keys = pl.ds(first, CHUNK)
        return tuple(out[name].at[tokens, head, keys] for name in ("d_q", "d_k", "d_e", "d_g"))

    def value_block(first, carry):
        s = views(scratch, scratch["zero"])
        values = pl.ds(first, VALUE_BLOCK)
        pairs = [([r.at[tokens, head, values] for r in hbm[n]], s[n]) for n in ("x", "d_y")]
        pairs += [
            ([r.at[chunk, head, values] for r in hbm[name]], dst)
            for name, dst in zip(("starts", "d_ends"), s["rows"], strict=True)
        ]
        _copy(pairs, s["block_loaded"])
        _value_stage(s, out, (tokens, head, values))
        _top_stage(scratch, outputs)
        return carry

    tiles.over_blocks(hbm["x"][0].shape[-1], value_block, 0)
    levels.levels_stage(scratch, out, outputs, (tokens, head))
    plgpu.wait_smem_to_gmem(0)


def grads(q, k, e, x, g, scores, d_y, starts, d_ends, *, interpret):
    """Every chunk's gradients of the contract: ``q``, ``k`` pieces ``[tokens, H, K]``,
    ``e`` pieces ``[tokens, HV, K]``, ``x`` and ``d_y`` pieces ``[tokens, HV, V]``, ``g`` the
    log-decays' ``SEGMENT_PIECES`` pieces ``[tokens, HV, K]``
    (``channel/factors.gate_pieces``), ``scores`` (``M``) pieces ``[tokens, HV, C]``,
    ``starts`` and ``d_ends`` pieces ``[chunks, HV, V, K]``. Returns ``(d_q, d_k, d_e, d_g
    [tokens, HV, K], d_x [tokens, HV, V])`` in float32 (those of q and k per value head),
    ``d_x`` in bf16 for operands of one bf16 piece (bf16 inputs)."""
    count = len(q)
    tokens, heads, key_dim = q[0].shape
    v_heads, value_dim = x[0].shape[1:]
    grad = jax.ShapeDtypeStruct((tokens, v_heads, key_dim), F32)
    out_type = (
        *(grad,) * 4,
        jax.ShapeDtypeStruct((tokens, v_heads, value_dim), F32 if count > 1 else tiles.BF16),
        jax.ShapeDtypeStruct((2, tokens, v_heads, CHUNK), F32),  # dM, dA: the kernel's own
    )
    scratch = _scratch(count, key_dim)
    if count == 1:  # bf16 inputs: dX in bf16 (the op returns d v in v's dtype)
        scratch["d_x"] = tiles.smem((CHUNK, VALUE_BLOCK), tiles.BF16)
    call = tiles.kernel_call(
        functools.partial(_grads_kernel, group=v_heads // heads),
        name="channel_mosaic_grads",
        out_type=out_type,
        scratch=scratch,
        grid=dict(head=v_heads, chunk=tokens // CHUNK),
        interpret=interpret,
    )
    inputs = (q, k, e, x, g, scores, d_y, starts, d_ends)
    return call(*(tuple(a) for a in inputs), jnp.zeros((1,), jnp.int32))[:5]


def chunk_grads(q, k, e, x, g, scores, d_y, starts, d_ends, *, interpret):
    """Every chunk's gradients from its start state and end cotangent (the arguments as
    ``channel/grads.grads``'s). Returns ``(d_q, d_k [tokens, H, K], d_e [tokens, HV,
    K], d_x [tokens, HV, V], d_g [tokens, HV, K])``, float32 but ``d_x`` for bf16 operands
    (bf16)."""
    d_q, d_k, d_e, d_g, d_x = grads(q, k, e, x, g, scores, d_y, starts, d_ends, interpret=interpret)
    tokens, heads, key_dim = q[0].shape

    def key_heads(d):  # [tokens, HV, K] -> [tokens, H, K]: a key head's value heads
        return d.reshape(tokens, heads, -1, key_dim).sum(2)

    return key_heads(d_q), key_heads(d_k), d_e, d_x, d_g
