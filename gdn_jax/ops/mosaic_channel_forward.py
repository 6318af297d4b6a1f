"""The forward kernels of ``impl="mosaic_gpu"`` for the channel-decay rules (KDA, GDN-2;
``channel_mosaic.py``): the factors of every chunk, then the state pass with the outputs.

1. ``factors``, a program per (chunk, value head): the chunk's scores ``M`` (queries) and
   ``A`` (erase vectors) by halving levels (``mosaic_channel_chunk.channel_scores``), the
   inverse ``T = (I + A)^{-1}`` by doubling blocks (``mosaic_chunk.unit_lower_inverse``),
   the decays from the chunk's start and to its end, and

       w = T (E * exp(G)),  u = T X,  q_start = Q * exp(G),  k_end = K * exp(G_C - G),

   written to HBM as bf16 pieces with ``M``. ``whole = exp(G_C)`` is a sum of each chunk's
   gates in XLA.
2. ``states``, a program per (sequence, value head, block of 64 value channels): its block of
   the float32 state ``S [64, K]`` stays on chip from the sequence's first chunk to its last
   while each chunk's tiles stream in by TMA (``mosaic_pass.stream_chunks``); per chunk

       U = u - w S^T,  Y = q_start S^T + M U,  S' = S Diag(whole) + U^T k_end,

   writing ``Y`` and, for the backward, the start state as the pieces its products read.

Interfaces (``tokens`` a multiple of the chunk ``C = 64``, laid out by
``mosaic_layout.token_layout``; ``K`` and ``V`` multiples of 64; "pieces" is a tuple of
``count`` bf16 arrays that sum to the operand, ``mosaic_chunk.operand``, ``count`` 1 for bf16
inputs and 2 for float32, the same for every operand of a call)::

    factors(q, k, e, x, g, *, interpret=None) -> Factors(w, u, q_start, k_end, scores, whole)
      q, k      pieces [tokens, H, K]   key heads; value head h reads key head h // (HV // H)
      e         pieces [tokens, HV, K]  erase vectors b * k
      x         pieces [tokens, HV, V]  writes w * v
      g         float32 [tokens, HV, K] log-decays, clamped at decays.LOG_ALPHA_FLOOR
      w, q_start, k_end pieces [tokens, HV, K];  u pieces [tokens, HV, V]
      scores    pieces [tokens, HV, C]  M of each chunk's rows (row t of a chunk: M[t, :])
      whole     float32 [chunks, HV, K] exp(G_C)

    states(table, q_start, k_end, w, u, scores, whole, h0, *, keep_starts, interpret=None)
      -> (y float32 [tokens, HV, V], finals float32 [N, HV, V, K][, starts])
      table     int32 [N, 2]            each sequence's first chunk and chunk count
      h0        float32 [N, HV, V, K]   initial states
      starts    pieces [chunks, HV, V, K] (keep_starts) each chunk's start state

``gate_pieces(g)`` is ``g`` as the ``SEGMENT_PIECES`` bf16 pieces that the kernels' sums read.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gdn_jax.ops import mosaic_channel_chunk as mcc
from gdn_jax.ops import mosaic_chunk as mc
from gdn_jax.ops import mosaic_pass
from gdn_jax.ops.mosaic_chunk import CHUNK, F32
from gdn_jax.ops.mosaic_forward import VALUE_BLOCK


class Factors(NamedTuple):
    """What ``factors`` returns (the module docstring gives the layouts)."""

    w: tuple
    u: tuple
    q_start: tuple
    k_end: tuple
    scores: tuple
    whole: jax.Array


def gate_pieces(g) -> tuple:
    """The log-decays ``g`` (float32) as ``SEGMENT_PIECES`` bf16 pieces, which hold it
    exactly."""
    return tuple(mc.split(g.astype(F32), mc.SEGMENT_PIECES))


def chunk_wholes(g):
    """``exp(G_C)`` of every chunk, ``[chunks, HV, K]``: the sum of each chunk's own gates."""
    tokens, heads, key_dim = g.shape
    return jax.numpy.exp(g.astype(F32).reshape(tokens // CHUNK, CHUNK, heads, key_dim).sum(1))


def _decayed(s, key_dim: int) -> None:
    """``q_start``, ``E * exp(G)`` and ``k_end`` into ``s["rows"][0]``, ``s["e"]`` and
    ``s["cols"]``, committed. The chunk's masks (``s["chunk_masks"]``) are written before
    the levels: made here, after the inverse, ptxas spilled at float32 (two pieces)."""

    def block(first, carry):
        keys = mcc.key_block(first)
        from_start = mcc.chunk_decay(s["chunk_masks"], s["g"].at(*keys), 0)
        for src, dst in ((s["q"], s["rows"][0]), (s["e"], s["e"])):
            mc.store(dst.at(*keys), mc.load(src.at(*keys)) * from_start)
        to_end = mcc.chunk_decay(s["chunk_masks"], s["g"].at(*keys), 1)
        mc.store(s["cols"].at(*keys), mc.load(s["k"].at(*keys)) * to_end)
        return carry

    mc.over_blocks(key_dim, block, 0)
    mc.commit()


def _times_inverse(s, src: mc.Pieces, dst: mc.Pieces) -> None:
    """``T src`` into ``dst`` (``[C, n]`` operands, ``T`` in ``s["inverse"]``), 64 columns
    at a time, committed."""

    def block(first, carry):
        cols = mcc.key_block(first)
        mc.store(dst.at(*cols), mc.product(mcc.SQUARE, (s["inverse"], src.at(*cols))))
        return carry

    mc.over_blocks(src.refs[0].shape[1], block, 0)
    mc.commit()


def _factors_kernel(q_hbm, k_hbm, e_hbm, x_hbm, g_hbm, *out, group: int, **s):
    """One chunk of one value head: its ``w``, ``u``, ``q_start``, ``k_end`` and ``M``."""
    w_hbm, u_hbm, q_start_hbm, k_end_hbm, scores_hbm = out
    chunk, head = jax.lax.axis_index("chunk"), jax.lax.axis_index("head")
    tokens = pl.ds(chunk * CHUNK, CHUNK)
    sources = (
        *(ref.at[tokens, head // group] for ref in (*q_hbm, *k_hbm)),
        *(ref.at[tokens, head] for ref in (*e_hbm, *x_hbm, *g_hbm)),
    )
    names = ("q", "k", "e", "x", "g")
    tiles = tuple(ref for name in names for ref in s[name].refs)
    for src, dst in zip(sources, tiles, strict=True):
        plgpu.copy_gmem_to_smem(src, dst, s["loaded"])
    mcc.write_chunk_masks(s["chunk_masks"])  # while the tiles load
    plgpu.barrier_wait(s["loaded"])
    # One score a pass over the levels: both at once held more registers than ptxas had.
    (scores,) = mcc.channel_scores(s, (s["q"],), s["k"], s["g"])
    mc.store(s["off"], scores)
    mc.copy_out(*((src, dst.at[tokens, head]) for src, dst in zip(s["off"].refs, scores_hbm)))
    (strict,) = mcc.channel_scores(s, (s["e"],), s["k"], s["g"], diagonal=False)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the inverse writes over ``off``
    inverse = mc.unit_lower_inverse(strict, s["off"], s["inverse"], s["half"])
    mc.store(s["inverse"], inverse)
    key_dim = s["q"].refs[0].shape[1]
    _times_inverse(s, s["x"], s["x"])  # u, each block of x read before it is written
    _decayed(s, key_dim)
    _times_inverse(s, s["e"], s["e"])  # w, each block of E * exp(G) read before it is written
    results = ((s["e"], w_hbm), (s["x"], u_hbm), (s["rows"][0], q_start_hbm), (s["cols"], k_end_hbm))
    mc.copy_out(
        *(
            (src, dst.at[tokens, head])
            for tile, hbm in results
            for src, dst in zip(tile.refs, hbm, strict=True)
        )
    )
    plgpu.wait_smem_to_gmem(0)


def factors(q, k, e, x, g, *, interpret=None) -> Factors:
    """The factors of every chunk (module docstring)."""
    count = len(q)
    tokens, heads, key_dim = q[0].shape
    v_heads, value_dim = x[0].shape[1:]
    tile = (CHUNK, key_dim)
    scratch = dict(
        q=mc.pieces(count, tile),
        k=mc.pieces(count, tile),
        e=mc.pieces(count, tile),
        x=mc.pieces(count, (CHUNK, value_dim)),
        g=mc.pieces(mc.SEGMENT_PIECES, tile),
        masks=(mc.pieces(1, mcc.SQUARE), mc.pieces(1, mcc.SQUARE)),
        chunk_masks=(mc.pieces(1, mcc.SQUARE), mc.pieces(1, mcc.SQUARE)),
        rows=(mc.pieces(count, tile),),
        cols=mc.pieces(count, tile),
        off=mc.pieces(count, mcc.SQUARE),
        inverse=mc.pieces(count, mcc.SQUARE),
        half=mc.pieces(count, mcc.SQUARE),
        loaded=plgpu.Barrier(num_arrivals=4 * count + mc.SEGMENT_PIECES),
    )
    shapes = [(tokens, v_heads, key_dim), (tokens, v_heads, value_dim)]
    shapes += [shapes[0], shapes[0], (tokens, v_heads, CHUNK)]
    out_type = tuple(tuple(jax.ShapeDtypeStruct(x, mc.BF16) for _ in range(count)) for x in shapes)
    call = mc.kernel_call(
        functools.partial(_factors_kernel, group=v_heads // heads),
        name="channel_mosaic_factors",
        out_type=out_type,
        scratch=scratch,
        grid=dict(chunk=tokens // CHUNK, head=v_heads),
        interpret=interpret,
    )
    outs = call(tuple(q), tuple(k), tuple(e), tuple(x), gate_pieces(g))
    return Factors(*outs, chunk_wholes(g))


def _fetch(hbm, s, chunk, slot, *, head, block):
    """Start the TMA copies of one chunk's tiles into ``slot``."""
    tokens = pl.ds(chunk * CHUNK, CHUNK)
    channels = pl.ds(block * VALUE_BLOCK, VALUE_BLOCK)
    sources = (
        *(
            ref.at[tokens, head]
            for name in ("q_start", "k_end", "w", "scores")
            for ref in hbm[name]
        ),
        *(ref.at[tokens, head, channels] for ref in hbm["u"]),
        hbm["whole"].at[chunk, head],
    )
    names = ("q_start", "k_end", "w", "scores", "u")
    tiles = (*(ref for name in names for ref in s[name].refs), s["whole"])
    for src, dst in zip(sources, tiles, strict=True):
        plgpu.copy_gmem_to_smem(src, dst.at[slot], s["loaded"].at[slot])


def _state_step(out, s, chunk, slot, state, *, head, block):
    """One chunk on tiles already in ``slot``: writes its outputs (and start state, where
    ``out["starts"]`` is there) and returns the state after it."""
    q_start, k_end, w, scores, u = (
        s[name].at(slot) for name in ("q_start", "k_end", "w", "scores", "u")
    )
    values = pl.ds(block * VALUE_BLOCK, VALUE_BLOCK)
    # Read before the step's products, whose commits then order this read before TMA
    # refills the slot: read after the last one, the refill raced it.
    whole = plgpu.load(s["whole"].at[slot], layout=mc.COLS)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last chunk's copies out
    mc.store(s["state"], state)
    if "carry" in s:  # the float32 state waits in shared memory, not in registers
        s["carry"][...] = state
    if "starts" in out:
        starts = zip(s["state"].refs, out["starts"], strict=True)
        mc.copy_out(*((src, dst.at[chunk, head, values]) for src, dst in starts))
    shape = (CHUNK, VALUE_BLOCK)
    mc.store(s["corr"], mc.load(u) - mc.product(shape, (w, s["state"].T)))  # U = u - w S^T
    mc.commit()
    s["y"][...] = mc.product(shape, (q_start, s["state"].T), (scores, s["corr"]))
    mc.copy_out((s["y"], out["y"].at[pl.ds(chunk * CHUNK, CHUNK), head, values]))
    written = mc.product(state.shape, (s["corr"].T, k_end))
    state = s["carry"][...] if "carry" in s else state
    return mc.by_col(whole, state.shape) * state + written


def _states_kernel(table, *refs, slots: int, **s):
    """One sequence, value head and block of value channels over the sequence's chunks."""
    names = ("q_start", "k_end", "w", "u", "scores", "whole", "h0", "y", "finals", "starts")
    hbm = dict(zip(names, refs, strict=False))
    out = {name: hbm.pop(name) for name in names[7:] if name in hbm}
    h0 = hbm.pop("h0")
    seq, head, block = (jax.lax.axis_index(axis) for axis in ("seq", "head", "block"))
    values = pl.ds(block * VALUE_BLOCK, VALUE_BLOCK)
    fetch = functools.partial(_fetch, hbm, s, head=head, block=block)
    step = functools.partial(_state_step, out, s, head=head, block=block)
    start, end = h0.at[seq, head, values], out["finals"].at[seq, head, values]
    mosaic_pass.carry_over_sequence(table, fetch, step, start, end, loaded=s["loaded"], slots=slots)


def _states_scratch(count: int, key_dim: int) -> tuple[int, dict]:
    """``(slots, scratch)`` of the state pass: two slots of a chunk's tiles where one piece
    an operand leaves room, and the float32 state in shared memory through a chunk."""
    slots = 2 if count == 1 else 1
    square = (slots, CHUNK, CHUNK)
    tile = (slots, CHUNK, key_dim)
    scratch = dict(
        q_start=mc.pieces(count, tile),
        k_end=mc.pieces(count, tile),
        w=mc.pieces(count, tile),
        scores=mc.pieces(count, square),
        u=mc.pieces(count, (slots, CHUNK, VALUE_BLOCK)),
        whole=plgpu.SMEM((slots, key_dim), F32),
        state=mc.pieces(count, (VALUE_BLOCK, key_dim)),
        corr=mc.pieces(count, (CHUNK, VALUE_BLOCK)),
        y=mc.smem((CHUNK, VALUE_BLOCK), F32),
        loaded=plgpu.Barrier(num_arrivals=5 * count + 1, num_barriers=slots),
    )
    if count == 1:
        scratch["carry"] = mc.smem((VALUE_BLOCK, key_dim), F32)
    return slots, scratch


def states(table, q_start, k_end, w, u, scores, whole, h0, *, keep_starts: bool, interpret=None):
    """The state pass with the outputs (module docstring)."""
    count = len(q_start)
    tokens, v_heads, key_dim = q_start[0].shape
    value_dim = u[0].shape[-1]
    slots, scratch = _states_scratch(count, key_dim)
    out_type = [
        jax.ShapeDtypeStruct((tokens, v_heads, value_dim), F32),
        jax.ShapeDtypeStruct(h0.shape, F32),
    ]
    if keep_starts:
        shape = (tokens // CHUNK, v_heads, value_dim, key_dim)
        out_type.append(tuple(jax.ShapeDtypeStruct(shape, mc.BF16) for _ in range(count)))
    call = mc.kernel_call(
        functools.partial(_states_kernel, slots=slots),
        name="channel_mosaic_states",
        out_type=tuple(out_type),
        scratch=scratch,
        grid=dict(seq=h0.shape[0], head=v_heads, block=value_dim // VALUE_BLOCK),
        interpret=interpret,
    )
    pieces = (tuple(x) for x in (q_start, k_end, w, u, scores))
    return call(table, *pieces, whole.astype(F32), h0)
