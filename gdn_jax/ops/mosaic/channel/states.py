"""The channel-decay rules' state pass with the outputs (KDA, GDN-2; ``impl="mosaic_gpu"``,
``op.py``): a program per (sequence, value head, block of 64 value channels) keeps its block of
the float32 state ``S [64, K]`` on chip from the sequence's first chunk to its last while each
chunk's tiles (``factors.py``'s) stream in by TMA (``state_pass.stream_chunks``); per chunk

    U = u - w S^T,  Y = q_start S^T + M U,  S' = S Diag(whole) + U^T k_end,

writing ``Y`` and, for the backward, the start state as the pieces its products read::

    states(table, q_start, k_end, w, u, scores, whole, h0, *, keep_starts, interpret)
      -> (y float32 [tokens, HV, V], finals float32 [N, HV, V, K][, starts])
      table     int32 [N, 2]            each sequence's first chunk and chunk count
      h0        float32 [N, HV, V, K]   initial states
      starts    pieces [chunks, HV, V, K] (keep_starts) each chunk's start state
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gdn_jax.ops.mosaic import state_pass, tiles
from gdn_jax.ops.mosaic.limits import CHUNK, VALUE_BLOCK
from gdn_jax.ops.mosaic.tiles import F32


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
    dsts = (*(ref for name in names for ref in s[name].refs), s["whole"])
    for src, dst in zip(sources, dsts, strict=True):
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
    whole = plgpu.load(s["whole"].at[slot], layout=tiles.COLS)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last chunk's copies out
    tiles.store(s["state"], state)
    if "carry" in s:  # the float32 state waits in shared memory, not in registers
        s["carry"][...] = state
    if "starts" in out:
        starts = zip(s["state"].refs, out["starts"], strict=True)
        tiles.copy_out(*((src, dst.at[chunk, head, values]) for src, dst in starts))
    shape = (CHUNK, VALUE_BLOCK)
    tiles.store(s["corr"], tiles.load(u) - tiles.product(shape, (w, s["state"].T)))  # U = u - w S^T
    tiles.commit()
    s["y"][...] = tiles.product(shape, (q_start, s["state"].T), (scores, s["corr"]))
    tiles.copy_out((s["y"], out["y"].at[pl.ds(chunk * CHUNK, CHUNK), head, values]))
    written = tiles.product(state.shape, (s["corr"].T, k_end))
    state = s["carry"][...] if "carry" in s else state
    return tiles.by_col(whole, state.shape) * state + written


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
    state_pass.carry_over_sequence(table, fetch, step, start, end, loaded=s["loaded"], slots=slots)


def _states_scratch(count: int, key_dim: int) -> tuple[int, dict]:
    """``(slots, scratch)`` of the state pass: two slots of a chunk's tiles (the next chunk's
    stream in while this one computes; two bf16 pieces an operand fit too, at the K <= 64
    that ``limits.refusals`` leaves them), and the float32 state in shared memory through a
    chunk where one piece an operand leaves room for it."""
    slots = 2
    square = (slots, CHUNK, CHUNK)
    tile = (slots, CHUNK, key_dim)
    scratch = dict(
        q_start=tiles.pieces(count, tile),
        k_end=tiles.pieces(count, tile),
        w=tiles.pieces(count, tile),
        scores=tiles.pieces(count, square),
        u=tiles.pieces(count, (slots, CHUNK, VALUE_BLOCK)),
        whole=plgpu.SMEM((slots, key_dim), F32),
        state=tiles.pieces(count, (VALUE_BLOCK, key_dim)),
        corr=tiles.pieces(count, (CHUNK, VALUE_BLOCK)),
        y=tiles.smem((CHUNK, VALUE_BLOCK), F32),
        loaded=plgpu.Barrier(num_arrivals=5 * count + 1, num_barriers=slots),
    )
    if count == 1:
        scratch["carry"] = tiles.smem((VALUE_BLOCK, key_dim), F32)
    return slots, scratch


def states(table, q_start, k_end, w, u, scores, whole, h0, *, keep_starts: bool, interpret):
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
        out_type.append(tuple(jax.ShapeDtypeStruct(shape, tiles.BF16) for _ in range(count)))
    call = tiles.kernel_call(
        functools.partial(_states_kernel, slots=slots),
        name="channel_mosaic_states",
        out_type=tuple(out_type),
        scratch=scratch,
        grid=dict(block=value_dim // VALUE_BLOCK, head=v_heads, seq=h0.shape[0]),
        interpret=interpret,
    )
    pieces = (tuple(x) for x in (q_start, k_end, w, u, scores))
    return call(table, *pieces, whole.astype(F32), h0)
