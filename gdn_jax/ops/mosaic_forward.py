"""The forward kernels of ``impl="mosaic_gpu"`` (``chunked_mosaic.py``): the WY factors of every
chunk, then the state pass with the outputs.

1. ``factors``, a program per (chunk, value head): the chunk's decays, ``K K^T``, the inverse
   ``T`` of its intra-chunk system by doubling blocks on the tensor cores and the WY factors
   ``w = T diag(beta exp(g)) K``, ``u = T diag(beta) V`` (``mosaic_chunk.chunk_factors``),
   written to HBM as bf16 pieces.
2. ``states``, a program per (sequence, value head, block of 64 value channels): its block of
   the float32 state ``S [64, K]`` stays on chip (registers between chunks, shared memory
   through a chunk's products) from the sequence's first chunk to its last while each
   chunk's tiles stream in by TMA, two slots deep (``mosaic_pass.stream_chunks``); per
   chunk ``U = u - w S^T``, ``Y = diag(exp(g)) Q S^T + (Q K^T * Gamma) U`` and ``S' =
   exp(g_C) S + U^T diag(exp(g_C - g)) K`` (``chunked.py``), writing ``Y`` and, for the
   backward, the start state as the pieces its products read.

HBM layouts (``mosaic_layout.py``): q, k pieces ``[tokens, H, K]``, v, u pieces ``[tokens,
HV, V]``, w ``[tokens, HV, K]``, ``gates [GATES, HV, tokens]`` (``mosaic_chunk.gate_rows``),
states ``[N or chunks, HV, V, K]``, ``table [N, 2]`` (each sequence's first chunk and count).
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gdn_jax.ops import mosaic_chunk as mc
from gdn_jax.ops import mosaic_pass
from gdn_jax.ops.mosaic_chunk import CHUNK, F32

# The value channels of one program of the state pass: a wgmma's 64 rows of the state.
VALUE_BLOCK = 64


def _factors_kernel(k_hbm, v_hbm, gates_hbm, w_hbm, u_hbm, *, group: int, **s):
    """One chunk of one value head: its ``w [C, K]`` and ``u [C, V]``."""
    chunk, head = jax.lax.axis_index("chunk"), jax.lax.axis_index("head")
    tokens = pl.ds(chunk * CHUNK, CHUNK)
    sources = (
        *(ref.at[tokens, head // group] for ref in k_hbm),
        *(ref.at[tokens, head] for ref in v_hbm),
        gates_hbm.at[:, head, tokens],
    )
    for src, dst in zip(sources, (*s["k"].refs, *s["v"].refs, s["gates"]), strict=True):
        plgpu.copy_gmem_to_smem(src, dst, s["loaded"])
    mc.write_masks(s)
    plgpu.barrier_wait(s["loaded"])
    mc.chunk_factors(s, s["k"], lambda: mc.load(s["v"]), s["gates"])
    mc.copy_out(
        *((src, dst.at[tokens, head]) for src, dst in zip(s["erase"].refs, w_hbm, strict=True)),
        *((src, dst.at[tokens, head]) for src, dst in zip(s["write"].refs, u_hbm, strict=True)),
    )
    plgpu.wait_smem_to_gmem(0)


def factor_scratch(count: int, key_dim: int, value_dim: int) -> dict:
    """The scratch of ``mosaic_chunk.chunk_factors`` for operands of ``count`` pieces (the
    strict mask is made in registers: one chunk a program, no loop to hoist it out of)."""
    square = (CHUNK, CHUNK)
    return dict(
        terms=mc.pieces(mc.SEGMENT_PIECES, square),
        ones=mc.pieces(1, square),
        off=mc.pieces(count, square),
        inverse=mc.pieces(count, square),
        half=mc.pieces(count, square),
        erase=mc.pieces(count, (CHUNK, key_dim)),
        write=mc.pieces(count, (CHUNK, value_dim)),
    )


def factors(k, v, gates, *, interpret=None):
    """The WY factors of every chunk: ``k`` pieces ``[tokens, H, K]``, ``v`` pieces
    ``[tokens, HV, V]``, ``gates [GATES, HV, tokens]`` float32 (``tokens`` a multiple of the
    chunk, ``K`` and ``V`` of 64). Returns ``(w, u)``, pieces like ``k`` and ``v`` per value
    head."""
    count = len(k)
    tokens, heads, key_dim = k[0].shape
    v_heads, value_dim = v[0].shape[1:]
    scratch = dict(
        k=mc.pieces(count, (CHUNK, key_dim)),
        v=mc.pieces(count, (CHUNK, value_dim)),
        gates=plgpu.SMEM((mc.GATES, CHUNK), F32),
        loaded=plgpu.Barrier(num_arrivals=2 * count + 1),
        **factor_scratch(count, key_dim, value_dim),
    )
    shapes = ((tokens, v_heads, key_dim), (tokens, v_heads, value_dim))
    out_type = tuple(tuple(jax.ShapeDtypeStruct(x, mc.BF16) for _ in range(count)) for x in shapes)
    call = mc.kernel_call(
        functools.partial(_factors_kernel, group=v_heads // heads),
        name="gdn_mosaic_factors",
        out_type=out_type,
        scratch=scratch,
        grid=dict(chunk=tokens // CHUNK, head=v_heads),
        interpret=interpret,
    )
    return call(tuple(k), tuple(v), gates)


def pass_scratch(count: int, key_dim: int, *, values: str, squares: int) -> tuple[int, dict]:
    """``(slots, scratch)``: the shared memory of a state pass, forward or reverse: the
    chunk's tiles of q, k, w and the value block of ``values`` (u, or dY) in ``slots``
    (two, streamed, where one bf16 piece an operand leaves room), the gates, the squares
    of the decays and the system, ``squares`` more, the state's pieces, and a barrier a
    slot."""
    slots = 2 if count == 1 else 1  # two pieces a tile leave no room for a second slot
    square = (CHUNK, CHUNK)
    tile = (slots, CHUNK, key_dim)
    scratch = dict(
        q=mc.pieces(count, tile),
        k=mc.pieces(count, tile),
        w=mc.pieces(count, tile),
        gates=plgpu.SMEM((slots, mc.GATES, CHUNK), F32),
        terms=mc.pieces(mc.SEGMENT_PIECES, square),
        ones=mc.pieces(1, square),
        strict=mc.pieces(1, square),
        extra=mc.extra_squares(count, squares),
        state=mc.pieces(count, (VALUE_BLOCK, key_dim)),
        loaded=plgpu.Barrier(num_arrivals=4 * count + 1, num_barriers=slots),
    )
    scratch[values] = mc.pieces(count, (slots, CHUNK, VALUE_BLOCK))
    return slots, scratch


def fetch_chunk(hbm, s, chunk, slot, *, head, group, block, values="u"):
    """Start the TMA copies of one chunk's tiles into ``slot``: q, k (key head), w, the
    value block of ``values`` (u in the forward, dY in the reverse pass), and the gates."""
    tokens = pl.ds(chunk * CHUNK, CHUNK)
    channels = pl.ds(block * VALUE_BLOCK, VALUE_BLOCK)
    sources = (
        *(ref.at[tokens, head // group] for ref in (*hbm["q"], *hbm["k"])),
        *(ref.at[tokens, head] for ref in hbm["w"]),
        *(ref.at[tokens, head, channels] for ref in hbm[values]),
        hbm["gates"].at[:, head, tokens],
    )
    tiles = (*s["q"].refs, *s["k"].refs, *s["w"].refs, *s[values].refs, s["gates"])
    for src, dst in zip(sources, tiles, strict=True):
        plgpu.copy_gmem_to_smem(src, dst.at[slot], s["loaded"].at[slot])


def _state_step(out, s, chunk, slot, state, *, head, block):
    """One chunk of the state pass on tiles already in ``slot``: writes the chunk's outputs
    (and start state, where ``out["starts"]`` is there) and returns the state after it.
    Each register tile is stored as soon as it is made and the decays scale ``[C, 64]``
    tiles, not ``[C, K]`` ones, so that few registers are live at once besides the state
    (ptxas's figures, ``benchmarks/mosaic_sm90.py``)."""
    q, k, w, u = (s[name].at(slot) for name in ("q", "k", "w", "u"))
    decays = mc.chunk_decays(s["gates"].at[slot], s)
    values = pl.ds(block * VALUE_BLOCK, VALUE_BLOCK)
    # The state's operand: every wgmma below reads it, and the backward its start state.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    mc.store(s["state"], state)
    if "carry" in s:  # the float32 state waits in shared memory, not in registers
        s["carry"][...] = state
    if "starts" in out:
        starts = zip(s["state"].refs, out["starts"], strict=True)
        mc.copy_out(*((src, dst.at[chunk, head, values]) for src, dst in starts))
    attn, corr, corr_to_end = mc.squares(s, 3)
    mc.store(attn, mc.product((CHUNK, CHUNK), (q, k.T)) * decays.within)
    shape = (CHUNK, VALUE_BLOCK)
    corrections = mc.load(u) - mc.product(shape, (w, s["state"].T))  # U = u - w S^T
    mc.store(corr, corrections)
    mc.store(corr_to_end, corrections * mc.by_row(decays.to_end, shape))
    mc.commit()
    y = mc.by_row(decays.from_start, shape) * mc.product(shape, (q, s["state"].T))
    s["y"][...] = y + mc.product(shape, (attn, corr))
    tokens = pl.ds(chunk * CHUNK, CHUNK)
    mc.copy_out((s["y"], out["y"].at[tokens, head, values]))
    written = mc.product(state.shape, (corr_to_end.T, k))
    state = s["carry"][...] if "carry" in s else state
    return mc.by_row(decays.whole, state.shape) * state + written


def _states_kernel(table, *refs, group: int, slots: int, **s):
    """One sequence, value head and block of value channels over the sequence's chunks."""
    names = ("q", "k", "w", "u", "gates", "h0", "y", "finals", "starts")
    hbm = dict(zip(names, refs, strict=False))
    out = {name: hbm.pop(name) for name in names[6:] if name in hbm}
    h0 = hbm.pop("h0")
    seq, head, block = (jax.lax.axis_index(axis) for axis in ("seq", "head", "block"))
    values = pl.ds(block * VALUE_BLOCK, VALUE_BLOCK)
    fetch = functools.partial(fetch_chunk, hbm, s, head=head, group=group, block=block)
    step = functools.partial(_state_step, out, s, head=head, block=block)
    mc.write_masks(s)
    start, end = h0.at[seq, head, values], out["finals"].at[seq, head, values]
    mosaic_pass.carry_over_sequence(table, fetch, step, start, end, loaded=s["loaded"], slots=slots)


def states(table, q, k, w, u, gates, h0, *, keep_starts: bool, interpret=None):
    """The state pass with the outputs. Returns ``(y [tokens, HV, V], finals [N, HV, V,
    K])`` in float32, and with ``keep_starts`` each chunk's start state as the bf16 pieces
    that its products read, ``[chunks, HV, V, K]`` each."""
    count = len(q)
    tokens, heads, key_dim = q[0].shape
    v_heads, value_dim = u[0].shape[1:]
    slots, scratch = pass_scratch(count, key_dim, values="u", squares=3)
    scratch["y"] = mc.smem((CHUNK, VALUE_BLOCK), F32)
    if count == 1:  # room for the state in shared memory through a chunk's products
        scratch["carry"] = mc.smem((VALUE_BLOCK, key_dim), F32)
    out_type = [
        jax.ShapeDtypeStruct((tokens, v_heads, value_dim), F32),
        jax.ShapeDtypeStruct(h0.shape, F32),
    ]
    if keep_starts:
        shape = (tokens // CHUNK, v_heads, value_dim, key_dim)
        out_type.append(tuple(jax.ShapeDtypeStruct(shape, mc.BF16) for _ in range(count)))
    call = mc.kernel_call(
        functools.partial(_states_kernel, group=v_heads // heads, slots=slots),
        name="gdn_mosaic_states",
        out_type=tuple(out_type),
        scratch=scratch,
        grid=dict(seq=h0.shape[0], head=v_heads, block=value_dim // VALUE_BLOCK),
        interpret=interpret,
    )
    return call(table, tuple(q), tuple(k), tuple(w), tuple(u), gates, h0)
