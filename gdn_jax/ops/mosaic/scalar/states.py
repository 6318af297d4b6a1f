"""The gated delta rule's state pass with the outputs (``impl="mosaic_gpu"``, ``op.py``): a
program per (sequence, value head, block of 64 value channels) keeps its block of the
float32 state ``S [64, K]`` on chip (registers between chunks, shared memory through a
chunk's products) from the sequence's first chunk to its last while each chunk's tiles
stream in by TMA, two slots deep (``state_pass.stream_chunks``); per chunk ``U = u - w S^T``,
``Y = diag(exp(g)) Q S^T + A U`` and ``S' = exp(g_C) S + U^T diag(exp(g_C - g)) K``
(``chunked/scalar.py``), writing ``Y`` and, for the backward, the start state as the pieces
its products read. The chunk's attention ``A = Q K^T * Gamma`` and decays come made
(``factors.py``, ``chunk.gate_rows``): a step does only what needs the state.

HBM layouts (``layout.py``): q, k pieces ``[tokens, H, K]``, u pieces ``[tokens, HV, V]``, w
``[tokens, HV, K]``, the attention ``[tokens, HV, C]``, ``gates [GATES, HV, tokens]``,
states ``[N or chunks, HV, V, K]``, ``table [N, 2]`` (each sequence's first chunk and
count).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gdn_jax.ops.mosaic import state_pass, tiles
from gdn_jax.ops.mosaic.limits import CHUNK, VALUE_BLOCK
from gdn_jax.ops.mosaic.scalar import chunk as in_chunk
from gdn_jax.ops.mosaic.tiles import F32


def pass_scratch(count: int, key_dim: int, *, values: str, squares: int) -> tuple[int, dict]:
    """``(slots, scratch)``: the shared memory of a state pass, forward or reverse: the
    chunk's tiles of q, k, w, its attention and the value block of ``values`` (u, or dY)
    in ``slots`` (two, streamed, where one bf16 piece an operand leaves room), the gates,
    ``squares`` ``[C, C]`` operands, the state's pieces, and a barrier a slot."""
    slots = 2 if count == 1 else 1  # two pieces a tile leave no room for a second slot
    tile = (slots, CHUNK, key_dim)
    scratch = dict(
        q=tiles.pieces(count, tile),
        k=tiles.pieces(count, tile),
        w=tiles.pieces(count, tile),
        attn=tiles.pieces(count, (slots, CHUNK, CHUNK)),
        gates=plgpu.SMEM((slots, in_chunk.GATES, CHUNK), F32),
        squares=in_chunk.square_scratch(count, squares),
        state=tiles.pieces(count, (VALUE_BLOCK, key_dim)),
        loaded=plgpu.Barrier(num_arrivals=5 * count + 1, num_barriers=slots),
    )
    scratch[values] = tiles.pieces(count, (slots, CHUNK, VALUE_BLOCK))
    return slots, scratch


def fetch_chunk(hbm, s, chunk, slot, *, head, group, block, values="u"):
    """Start the TMA copies of one chunk's tiles into ``slot``: q, k (key head), w, the
    attention, the value block of ``values`` (u in the forward, dY in the reverse pass),
    and the gates."""
    tokens = pl.ds(chunk * CHUNK, CHUNK)
    channels = pl.ds(block * VALUE_BLOCK, VALUE_BLOCK)
    sources = (
        *(ref.at[tokens, head // group] for ref in (*hbm["q"], *hbm["k"])),
        *(ref.at[tokens, head] for ref in (*hbm["w"], *hbm["attn"])),
        *(ref.at[tokens, head, channels] for ref in hbm[values]),
        hbm["gates"].at[:, head, tokens],
    )
    dsts = (*s["q"].refs, *s["k"].refs, *s["w"].refs, *s["attn"].refs, *s[values].refs)
    dsts += (s["gates"],)
    for src, dst in zip(sources, dsts, strict=True):
        plgpu.copy_gmem_to_smem(src, dst.at[slot], s["loaded"].at[slot])


# The operands that no slot indexes, held with a leading axis of one (``_views``).
_FIXED = ("squares", "state")


def _views(s: dict, zero) -> dict:
    """``s`` with the ``_FIXED`` operands viewed at ``zero[0]``, a 0 read from HBM: a chunk
    step that reads them through views of its own makes their wgmma descriptors where it
    uses them, not hoisted out of the chunk loop by LLVM and held in registers through it
    (ptxas spilled with two pieces an operand)."""
    index = zero[0]
    return dict(s, **{name: s[name].at(index) for name in _FIXED})


def _state_step(out, s, zero, chunk, slot, state, *, head, block):
    """One chunk of the state pass on tiles already in ``slot``: writes the chunk's outputs
    (and start state, where ``out["starts"]`` is there) and returns the state after it.
    Each register tile is stored as soon as it is made and the decays scale ``[C, 64]``
    tiles, not ``[C, K]`` ones, so that few registers are live at once besides the state
    (ptxas's figures, ``benchmarks/mosaic_sm90.py``)."""
    s = _views(s, zero)
    q, k, w, u, attn = (s[name].at(slot) for name in ("q", "k", "w", "u", "attn"))
    decays = in_chunk.chunk_vectors(s["gates"].at[slot])
    values = pl.ds(block * VALUE_BLOCK, VALUE_BLOCK)
    # The state's operand: every wgmma below reads it, and the backward its start state.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    tiles.store(s["state"], state)
    if "carry" in s:  # the float32 state waits in shared memory, not in registers
        s["carry"][...] = state
    if "starts" in out:
        starts = zip(s["state"].refs, out["starts"], strict=True)
        tiles.copy_out(*((src, dst.at[chunk, head, values]) for src, dst in starts))
    corr, corr_to_end = in_chunk.squares(s, 2)
    shape = (CHUNK, VALUE_BLOCK)
    corrections = tiles.load(u) - tiles.product(shape, (w, s["state"].T))  # U = u - w S^T
    tiles.store(corr, corrections)
    tiles.store(corr_to_end, corrections * tiles.by_row(decays.to_end, shape))
    tiles.commit()
    y = tiles.by_row(decays.from_start, shape) * tiles.product(shape, (q, s["state"].T))
    s["y"][...] = y + tiles.product(shape, (attn, corr))
    tokens = pl.ds(chunk * CHUNK, CHUNK)
    tiles.copy_out((s["y"], out["y"].at[tokens, head, values]))
    written = tiles.product(state.shape, (corr_to_end.T, k))
    state = s["carry"][...] if "carry" in s else state
    return tiles.by_row(decays.whole, state.shape) * state + written


def _states_kernel(table, *refs, group: int, slots: int, **s):
    """One sequence, value head and block of value channels over the sequence's chunks."""
    names = ("q", "k", "w", "attn", "u", "gates", "h0", "zero", "y", "finals", "starts")
    hbm = dict(zip(names, refs, strict=False))
    out = {name: hbm.pop(name) for name in names[8:] if name in hbm}
    h0 = hbm.pop("h0")
    seq, head, block = (jax.lax.axis_index(axis) for axis in ("seq", "head", "block"))
    values = pl.ds(block * VALUE_BLOCK, VALUE_BLOCK)
    fetch = functools.partial(fetch_chunk, hbm, s, head=head, group=group, block=block)
    step = functools.partial(_state_step, out, s, hbm["zero"], head=head, block=block)
    start, end = h0.at[seq, head, values], out["finals"].at[seq, head, values]
    state_pass.carry_over_sequence(
        table, fetch, step, start, end, loaded=s["loaded"], slots=slots, zero=hbm["zero"]
    )


def states(table, q, k, w, attn, u, gates, h0, *, keep_starts: bool, interpret):
    """The state pass with the outputs (``attn``: ``factors``'). Returns ``(y [tokens, HV, V], finals [N, HV, V,
    K])`` in float32, and with ``keep_starts`` each chunk's start state as the bf16 pieces
    that its products read, ``[chunks, HV, V, K]`` each."""
    count = len(q)
    tokens, heads, key_dim = q[0].shape
    v_heads, value_dim = u[0].shape[1:]
    slots, scratch = pass_scratch(count, key_dim, values="u", squares=2)
    for name in _FIXED:  # a leading axis of one (_views)
        shape = (1, CHUNK, CHUNK) if name != "state" else (1, VALUE_BLOCK, key_dim)
        scratch[name] = tiles.pieces(len(scratch[name].refs), shape)
    scratch["y"] = tiles.smem((CHUNK, VALUE_BLOCK), F32)
    # The float32 state waits in shared memory through a chunk's products: held in
    # registers beside them, ptxas spilled (two pieces an operand, K = 64, fit as well).
    scratch["carry"] = tiles.smem((VALUE_BLOCK, key_dim), F32)
    out_type = [
        jax.ShapeDtypeStruct((tokens, v_heads, value_dim), F32),
        jax.ShapeDtypeStruct(h0.shape, F32),
    ]
    if keep_starts:
        shape = (tokens // CHUNK, v_heads, value_dim, key_dim)
        out_type.append(tuple(jax.ShapeDtypeStruct(shape, tiles.BF16) for _ in range(count)))
    call = tiles.kernel_call(
        functools.partial(_states_kernel, group=v_heads // heads, slots=slots),
        name="gdn_mosaic_states",
        out_type=tuple(out_type),
        scratch=scratch,
        grid=dict(block=value_dim // VALUE_BLOCK, head=v_heads, seq=h0.shape[0]),
        interpret=interpret,
    )
    zero = jnp.zeros((1,), jnp.int32)  # read in each chunk step: state_pass.stream_chunks
    return call(table, tuple(q), tuple(k), tuple(w), tuple(attn), tuple(u), gates, h0, zero)
