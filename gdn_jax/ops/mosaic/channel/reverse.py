"""The backward kernels of ``impl="mosaic_gpu"`` for the channel-gated rules (KDA, GDN-2):
``ops/chunked/channel.py``'s hand-derived backward as Mosaic GPU kernels of the gated delta rule's
design (``ops/mosaic/scalar/reverse.py``, ``grads.py``), on the kernel contract of ``ops/mosaic/channel/factors.py``, ``states.py``
(``e = b * k`` and ``x = w * v`` formed in XLA, per-channel log-decays ``g``).

1. ``reverse``, a program per (sequence, value head, block of 64 value channels), walks the
   sequence's chunks last to first with its block of the state's cotangent ``dS [64, K]``
   in registers (starting from the final state's), and per chunk writes the cotangent of
   the chunk's end state and carries

       dU = M^T dY + (K * exp(G_C - G)) dS'^T,
       dS = dS' Diag(exp(G_C)) + dY^T (Q * exp(G)) - dU^T w,

   ending with the initial state's cotangent. It reads the forward's factors as they are
   (the decayed queries and keys, ``w``, the scores ``M``, the chunk's decay): the decays
   are per key channel, so the factors carry them and the pass makes none.
2. ``grads`` (``ops/mosaic/channel/grads.py``), a program per (chunk, value head), from the
   chunk's inputs, its scores, start states and end cotangents: every gradient of the
   contract (q, k, e, x and g), the scores' pullback through their halving levels last
   (``ops/mosaic/channel/levels.py``).

``chunk_grads`` runs 2 and sums the gradients of q and k over a key head's value heads.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gdn_jax.ops.mosaic import state_pass, tiles
from gdn_jax.ops.mosaic.limits import CHUNK, VALUE_BLOCK
from gdn_jax.ops.mosaic.tiles import F32

_TILES = ("q_start", "k_end", "w", "scores", "d_y")


def _reverse_scratch(count: int, key_dim: int) -> tuple[int, dict]:
    """``(slots, scratch)``: a chunk's tiles in two slots (the next chunk's stream in while
    this one computes; two bf16 pieces an operand fit too, at the K <= 64 that
    ``limits.refusals`` leaves them), its decay ``[slots, K]``, the state's cotangent as the
    pieces the products read, ``-dU`` and a barrier a slot."""
    slots = 2
    tile = (slots, CHUNK, key_dim)
    return slots, dict(
        q_start=tiles.pieces(count, tile),
        k_end=tiles.pieces(count, tile),
        w=tiles.pieces(count, tile),
        scores=tiles.pieces(count, (slots, CHUNK, CHUNK)),
        d_y=tiles.pieces(count, (slots, CHUNK, VALUE_BLOCK)),
        whole=plgpu.SMEM((slots, key_dim), F32),
        state=tiles.pieces(count, (VALUE_BLOCK, key_dim)),
        negated=tiles.pieces(count, (CHUNK, VALUE_BLOCK)),
        loaded=plgpu.Barrier(num_arrivals=5 * count + 1, num_barriers=slots),
    )


def _fetch(hbm, s, chunk, slot, *, head, block):
    """Start the TMA copies of one chunk's tiles into ``slot``: the value head's factors,
    its scores, the value block of dY and the chunk's decay."""
    tokens = pl.ds(chunk * CHUNK, CHUNK)
    channels = pl.ds(block * VALUE_BLOCK, VALUE_BLOCK)
    sources = (
        *(ref.at[tokens, head] for name in _TILES[:4] for ref in hbm[name]),
        *(ref.at[tokens, head, channels] for ref in hbm["d_y"]),
        hbm["whole"].at[chunk, head],
    )
    dsts = (*(ref for name in _TILES for ref in s[name].refs), s["whole"])
    for src, dst in zip(sources, dsts, strict=True):
        plgpu.copy_gmem_to_smem(src, dst.at[slot], s["loaded"].at[slot])


def _reverse_step(out, s, chunk, slot, d_state, *, head, block):
    """One chunk, last to first: writes the cotangent of its end state and returns that of
    its start state."""
    q_start, k_end, w, scores, d_y = (s[name].at(slot) for name in _TILES)
    values = pl.ds(block * VALUE_BLOCK, VALUE_BLOCK)
    # Read before the step's products, whose commits then order this read before TMA
    # refills the slot: read after the last one, the refill raced it.
    whole = plgpu.load(s["whole"].at[slot], layout=tiles.COLS)
    state_pass.keep_state(s, d_state, [dst.at[chunk, head, values] for dst in out["d_ends"]])
    shape = (CHUNK, VALUE_BLOCK)
    d_u = tiles.product(shape, (k_end, s["state"].T), (scores.T, d_y))
    tiles.store(s["negated"], -d_u)
    faded = tiles.by_col(whole, d_state.shape) * d_state
    return faded + tiles.product(d_state.shape, (d_y.T, q_start), (s["negated"].T, w))


def _reverse_kernel(table, *refs, slots: int, **s):
    """One sequence, value head and value block over the sequence's chunks, last first."""
    names = (*_TILES, "whole", "d_finals", "d_initial", "d_ends")
    hbm = dict(zip(names, refs, strict=True))
    out = {name: hbm.pop(name) for name in names[-3:]}
    seq, head, block = (jax.lax.axis_index(axis) for axis in ("seq", "head", "block"))
    values = pl.ds(block * VALUE_BLOCK, VALUE_BLOCK)
    fetch = functools.partial(_fetch, hbm, s, head=head, block=block)
    step = functools.partial(_reverse_step, out, s, head=head, block=block)
    start, end = (out[name].at[seq, head, values] for name in ("d_finals", "d_initial"))
    state_pass.carry_over_sequence(
        table, fetch, step, start, end, loaded=s["loaded"], slots=slots, reverse=True
    )


def reverse(table, q_start, k_end, w, scores, whole, d_y, d_finals, *, interpret):
    """The reverse state pass on the forward's factors: ``q_start``, ``k_end``, ``w``
    pieces ``[tokens, HV, K]`` (each value head's), ``scores`` pieces ``[tokens, HV, C]``
    (``M``, row ``t`` of its chunk's), ``whole [chunks, HV, K]`` float32, ``d_y`` pieces
    ``[tokens, HV, V]``, ``d_finals [N, HV, V, K]`` float32 and ``table [N, 2]``
    (``ops/mosaic/layout.py``). Returns ``(d_initial [N, HV, V, K] float32, d_ends)``, ``d_ends``
    the pieces of every chunk's end-state cotangent ``[chunks, HV, V, K]``."""
    count = len(q_start)
    tokens, v_heads, key_dim = q_start[0].shape
    value_dim = d_y[0].shape[-1]
    slots, scratch = _reverse_scratch(count, key_dim)
    shape = (tokens // CHUNK, v_heads, value_dim, key_dim)
    out_type = (
        jax.ShapeDtypeStruct(d_finals.shape, F32),
        tuple(jax.ShapeDtypeStruct(shape, tiles.BF16) for _ in range(count)),
    )
    call = tiles.kernel_call(
        functools.partial(_reverse_kernel, slots=slots),
        name="channel_mosaic_reverse",
        out_type=out_type,
        scratch=scratch,
        grid=dict(block=value_dim // VALUE_BLOCK, head=v_heads, seq=d_finals.shape[0]),
        interpret=interpret,
    )
    operands = (q_start, k_end, w, scores, d_y)
    return call(table, *(tuple(x) for x in operands), whole, d_finals)
