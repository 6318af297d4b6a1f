"""The grads kernel of the channel-gated backward (``ops/mosaic/channel/reverse.py``): a program
per (chunk, value head) from the chunk's inputs, its scores ``M`` and ``T = (I + A)^{-1}`` (the
forward's), the start state ``S`` and end-state cotangent ``dS'`` and dY: every gradient of the
contract.

64 value channels at a time (their tiles of x, dY, ``S`` and ``dS'`` copied in by TMA as the
last block's are done with), with ``U = T (X - (E * exp(G)) S^T)`` and ``dU
= M^T dY + (K * exp(G_C - G)) dS'^T`` (``ops/chunked/channel.py``'s backward)::

    dX = T^T dU,  dM += dY U^T,  dA += -dX U^T,
    d(Q * exp(G)) = dY S,  d(E * exp(G)) = -dX S,  d(K * exp(G_C - G)) = U dS',

the last three and ``M``'s diagonal added to the gradients of q, k and e at once, and what
``G_C`` gets to the last row of g's. Last, ``dM`` and ``dA`` back through the scores' halving
levels, and the gates' gradient from those of q, e and k (``ops/mosaic/channel/levels.py``).
The gradients accumulate in HBM, in the program's own blocks of them: no value block keeps a share of its own, and no ``[C, K]`` float32 tile is
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

_INPUTS = ("q", "k", "e", "x", "g", "scores", "inverse", "d_y", "starts", "d_ends", "zero")
_OUTPUTS = ("d_q", "d_k", "d_e", "d_g", "d_x", "d_scores")
MAIN, SECOND = 0, 1  # the warpgroups


def _scratch(count: int, key_dim: int) -> dict:
    """The chunk's tiles (a value block of x and dY), the chunk's masks, a value block's
    states (``rows``), ``cols`` and three ``[C, C]`` squares: ``u`` (``U``), ``inverse``
    (``T``) and ``m`` (``M``), which the levels' stage takes as scratch; every operand with
    a leading axis of one (``views``)."""

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
        rows=(operand(count, tile), operand(count, tile)),
        cols=operand(count, tile),
        u=operand(count, SQUARE),
        inverse=operand(count, SQUARE),
        m=operand(count, SQUARE),
        loaded=plgpu.Barrier(num_arrivals=5 * count),
        block_loaded=plgpu.Barrier(num_arrivals=4 * count),
        value_ready=plgpu.Barrier(),
        top_done=plgpu.Barrier(),
        done=plgpu.Barrier(num_arrivals=2),
        **(
            dict(second_mask=operand(1, SQUARE), second_cols=operand(count, SQUARE))
            if key_dim > CHUNK
            else {}
        ),
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
        decay = in_chunk.chunk_decay(s["masks"], s["g"].at(*keys), which)
        tiles.store(dst.at(*keys), tiles.load(src.at(*keys)) * decay)
        return carry

    tiles.over_blocks(src.refs[0].shape[1], block, 0)
    tiles.commit()


def _value_stage(s, out, index):
    """One value block: ``U``, ``dU``, ``dX`` (written to ``d_x``). Leaves ``U`` in ``u``,
    ``dX`` in ``x``, the states in ``rows``; the chunk masks (``write_chunk_masks``) must be
    in ``masks``."""
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


def _scores_stage(s, out, index):
    """One value block's ``dY U^T`` and ``-dX U^T``, added to ``dM`` and ``dA``
    (``d_scores``), whole: the levels keep what lies below the diagonal."""
    tokens, head = index
    add(out["d_scores"].at[0, tokens, head], tiles.product(SQUARE, (s["d_y"], s["u"].T)))
    add(out["d_scores"].at[1, tokens, head], -tiles.product(SQUARE, (s["x"], s["u"].T)))


def _decay(s, keys, which: int):
    """``exp(G)`` (``which`` 0) or ``exp(G_C - G)`` (1) of the 64 key channels ``keys``: a
    product of one chunk mask (``write_chunk_masks``) with the gates."""
    return jnp.exp(tiles.product(SQUARE, (s["masks"][which], s["g"].at(*keys))))


def _top_stage(scratch, outputs, keys: tuple[int, int]):
    """One value block's terms of the chunk's decays and of ``M``'s diagonal in the
    gradients of the key channels ``keys = (start, stop)``, 64 at a time, each tile used as
    soon as it is made.
    ``outputs(first)``: the ``d_q, d_k, d_e, d_g`` blocks in HBM. ``d_g``'s gets, on its
    last row, the cotangent of ``G_C`` (``G`` the gates' sums from the chunk's start;
    ``levels_stage`` takes it and what ``G`` gets from q, e and k to the gates)."""
    s = views(scratch, scratch["zero"])
    # dM's diagonal, dY_t . U_t, without a [C, C] mask.
    diagonal = tiles.by_row(jnp.sum(tiles.load(s["d_y"]) * tiles.load(s["u"]), axis=1), SQUARE)

    def block(first, carry):
        s = views(scratch, scratch["zero"])
        start, d_end = s["rows"]
        keys = in_chunk.key_block(first)
        d_q, d_k, d_e, d_g = outputs(first)
        d_k_end = tiles.product(SQUARE, (s["u"], d_end.at(*keys)))  # U dS'
        d_k_end = d_k_end * _decay(s, keys, 1)
        add(d_k, d_k_end + diagonal * tiles.load(s["q"].at(*keys)))
        # G_C gets the sum over the chunk of what G gets from exp(G_C - G), and, as row C - 1
        # of exp(G), d exp(G_C) exp(G_C): both on the last row.
        d_end_sum = jnp.sum(d_k_end * tiles.load(s["k"].at(*keys)), axis=0)
        d_whole = jnp.sum(tiles.load(d_end.at(*keys)) * tiles.load(start.at(*keys)), axis=0)
        from_start = _decay(s, keys, 0)
        d_last = tiles.by_col(d_whole, SQUARE) * from_start + tiles.by_col(d_end_sum, SQUARE)
        add(d_g, token_rows(lambda t: t == CHUNK - 1) * d_last)
        d_q_start = tiles.product(SQUARE, (s["d_y"], start.at(*keys)))  # dY S
        add(d_q, d_q_start * from_start + diagonal * tiles.load(s["k"].at(*keys)))
        d_e_start = -tiles.product(SQUARE, (s["x"], start.at(*keys)))  # -dX S
        add(d_e, d_e_start * from_start)
        return carry

    tiles.over_blocks(keys[1], block, 0, start=keys[0])


def _zero_outputs(out, tokens, head, keys: tuple[int, int]) -> None:
    """Zeros into the program's blocks of the gradients it accumulates, of the key channels
    ``keys``."""
    zero = token_rows(lambda t: t < 0)
    for first in range(*keys, CHUNK):
        for name in ("d_q", "d_k", "d_e", "d_g"):
            out[name].at[tokens, head, pl.ds(first, CHUNK)][...] = zero


def _main_side(scratch, hbm, out, index, keys) -> None:
    """The loads, every value block's stage (``U``, ``dU``, ``dX``) and its terms in the
    gradients of the key channels ``keys``; then the levels of those."""
    chunk, head, group = index
    tokens = pl.ds(chunk * CHUNK, CHUNK)
    s = views(scratch, scratch["zero"])
    inputs = [(hbm[name], s[name]) for name in ("q", "k")]
    inputs = [([ref.at[tokens, head // group] for ref in src], dst) for src, dst in inputs]
    inputs += [
        ([ref.at[tokens, head] for ref in hbm[name]], s[dst])
        for name, dst in (("e", "e"), ("scores", "m"), ("inverse", "inverse"))
    ]
    _copy(inputs, s["loaded"])
    in_chunk.load_gates(hbm["g"].at[tokens, head], s["g"])
    _zero_outputs(out, tokens, head, keys)
    zero = token_rows(lambda t: t < 0)
    for i in range(2):
        out["d_scores"].at[i, tokens, head][...] = zero
    # The chunk's masks, which the value blocks' stages read, once: written in the loop over
    # them, their values were hoisted out of it by LLVM and held in registers through it.
    in_chunk.write_chunk_masks(s["masks"])
    plgpu.barrier_wait(s["loaded"])
    outputs = functools.partial(_outputs, out, tokens, head)

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
        tiles.hand_over(s["value_ready"])  # U, dX, the block's tiles; the masks and gates
        _top_stage(scratch, outputs, keys)
        plgpu.barrier_wait(s["top_done"])  # the other side is done with the block's tiles
        return carry

    tiles.over_blocks(hbm["x"][0].shape[-1], value_block, 0, zero=scratch["zero"][0])
    levels.load_scores(scratch, out, (tokens, head))
    tiles.hand_over(s["value_ready"])  # once more: dM and dA, for the levels
    levels.levels_stage(scratch, outputs, keys, _main_space)
    plgpu.wait_smem_to_gmem(0)


def _second_side(scratch, hbm, out, index, keys) -> None:
    """Every value block's terms in ``dM`` and ``dA`` and in the gradients of the key
    channels ``keys``, once the main side has made the block's ``U`` and ``dX``; then the
    levels of those."""
    chunk, head, _ = index
    tokens = pl.ds(chunk * CHUNK, CHUNK)
    _zero_outputs(out, tokens, head, keys)
    outputs = functools.partial(_outputs, out, tokens, head)

    def value_block(first, carry):
        s = views(scratch, scratch["zero"])
        plgpu.barrier_wait(s["value_ready"])
        _scores_stage(s, out, (tokens, head))
        _top_stage(scratch, outputs, keys)
        tiles.hand_over(s["top_done"])
        return carry

    tiles.over_blocks(hbm["x"][0].shape[-1], value_block, 0, zero=scratch["zero"][0])
    plgpu.barrier_wait(scratch["value_ready"])  # dM and dA; every phase is waited for
    if keys[0] < keys[1]:  # K = 64: the main side's block is the only one
        levels.levels_stage(scratch, outputs, keys, _second_space)


def _outputs(out, tokens, head, first):
    """The blocks in HBM of ``d_q, d_k, d_e, d_g`` of the 64 key channels from ``first``."""
    channels = pl.ds(first, CHUNK)
    return tuple(out[name].at[tokens, head, channels] for name in ("d_q", "d_k", "d_e", "d_g"))


def _main_space(s) -> levels.Space:
    """The main side's scratch for the levels: what the value blocks' stages used."""
    first = in_chunk.key_block(0)
    return levels.Space(
        s["masks"][1], s["m"], s["x"], (s["d_y"], s["rows"][0].at(*first)), s["cols"].at(*first)
    )


def _second_space(s) -> levels.Space:
    """The second side's: the states' and the columns' other halves, and its own two."""
    first, second = in_chunk.key_block(0), in_chunk.key_block(CHUNK)
    rows, cols = s["rows"], s["cols"]
    return levels.Space(
        s["second_mask"], rows[1].at(*first), rows[1].at(*second),
        (rows[0].at(*second), cols.at(*second)), s["second_cols"],
    )  # fmt: skip


def _grads_kernel(*refs, group: int, **scratch):
    """One chunk and value head: every gradient of the contract, by two warpgroups, each
    for its share of the key channels (``_main_side``, ``_second_side``)."""
    hbm = dict(zip(_INPUTS + _OUTPUTS, refs, strict=True))
    out = {name: hbm.pop(name) for name in _OUTPUTS}
    scratch["zero"] = hbm.pop("zero")
    index = (jax.lax.axis_index("chunk"), jax.lax.axis_index("head"), group)
    main, second = tiles.key_shares(scratch["q"].refs[0].shape[-1])
    side = jax.lax.axis_index(tiles.WARPGROUP)
    pl.when(side == MAIN)(lambda: _main_side(scratch, hbm, out, index, main))
    pl.when(side == SECOND)(lambda: _second_side(scratch, hbm, out, index, second))
    tiles.finish_together(scratch["done"])


def grads(q, k, e, x, g, scores, inverse, d_y, starts, d_ends, *, interpret):
    """Every chunk's gradients of the contract: ``q``, ``k`` pieces ``[tokens, H, K]``,
    ``e`` pieces ``[tokens, HV, K]``, ``x`` and ``d_y`` pieces ``[tokens, HV, V]``, ``g`` the
    log-decays, float32 ``[tokens, HV, K]`` (split into pieces in the kernel), ``scores``
    (``M``) and ``inverse`` (``T``, the forward's) pieces ``[tokens, HV, C]``, ``starts``
    and ``d_ends`` pieces ``[chunks, HV, V, K]``. Returns ``(d_q, d_k, d_e, d_g [tokens,
    HV, K], d_x [tokens, HV, V])`` in float32 (those of q and k per value head),
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
        warpgroups=2,
    )
    pieces = tuple(tuple(a) for a in (q, k, e, x))
    rest = tuple(tuple(a) for a in (scores, inverse, d_y, starts, d_ends))
    return call(*pieces, g.astype(F32), *rest, jnp.zeros((1,), jnp.int32))[:5]


def chunk_grads(q, k, e, x, g, scores, inverse, d_y, starts, d_ends, *, interpret):
    """Every chunk's gradients from its start state and end cotangent (the arguments as
    ``channel/grads.grads``'s). Returns ``(d_q, d_k [tokens, H, K], d_e [tokens, HV,
    K], d_x [tokens, HV, V], d_g [tokens, HV, K])``, float32 but ``d_x`` for bf16 operands
    (bf16)."""
    d_q, d_k, d_e, d_g, d_x = grads(
        q, k, e, x, g, scores, inverse, d_y, starts, d_ends, interpret=interpret
    )
    tokens, heads, key_dim = q[0].shape

    def key_heads(d):  # [tokens, HV, K] -> [tokens, H, K]: a key head's value heads
        return d.reshape(tokens, heads, -1, key_dim).sum(2)

    return key_heads(d_q), key_heads(d_k), d_e, d_x, d_g
