"""The gated delta rule's reverse state pass (``impl="mosaic_gpu"``, ``op.py``): a program per
(sequence, value head, block of 64 value channels) walks the sequence's chunks last to first
with its block of the state's cotangent ``dS [64, K]`` on chip (from the final state's;
registers between chunks, shared memory through a chunk's products), and per chunk writes
the cotangent of the chunk's end state and carries

    dU = A^T dY + diag(exp(g_C - g)) K dS'^T,
    dS = exp(g_C) dS' + dY^T diag(exp(g)) Q - dU^T w,

ending with the initial state's cotangent (``chunked/scalar.py``'s hand-derived backward).
The chunk's attention ``A = Q K^T * Gamma`` is the forward's (``factors.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gdn_jax.ops.mosaic import state_pass, tiles
from gdn_jax.ops.mosaic.limits import CHUNK, VALUE_BLOCK
from gdn_jax.ops.mosaic.scalar import chunk as in_chunk
from gdn_jax.ops.mosaic.scalar.states import fetch_chunk, pass_scratch
from gdn_jax.ops.mosaic.tiles import F32


def _reverse_step(out, s, chunk, slot, d_state, *, head, block):
    """One chunk, last to first: writes the cotangent of its end state and returns that of
    its start state. The decays scale ``[C, 64]`` tiles, not ``[C, K]`` ones (registers)."""
    q, k, w, attn, d_y = (s[name].at(slot) for name in ("q", "k", "w", "attn", "d_y"))
    decays = in_chunk.chunk_vectors(s["gates"].at[slot])
    values = pl.ds(block * VALUE_BLOCK, VALUE_BLOCK)
    state_pass.keep_state(s, d_state, [dst.at[chunk, head, values] for dst in out["d_ends"]])
    s["carry"][...] = d_state  # it waits in shared memory, not in registers (spills)
    (negated,) = in_chunk.squares(s, 1)
    shape = (CHUNK, VALUE_BLOCK)
    d_u = tiles.by_row(decays.to_end, shape) * tiles.product(shape, (k, s["state"].T))
    d_u = d_u + tiles.product(shape, (attn.T, d_y))
    tiles.store(negated, -d_u)
    # dY's tile is read no more as it came: it holds dY diag(exp(g)) now.
    tiles.store(d_y, tiles.load(d_y) * tiles.by_row(decays.from_start, shape))
    tiles.commit()
    faded = tiles.by_row(decays.whole, d_state.shape) * s["carry"][...]
    return faded + tiles.product(d_state.shape, (d_y.T, q), (negated.T, w))


def _reverse_kernel(table, *refs, group: int, slots: int, **s):
    """One sequence, value head and value block over the sequence's chunks, last first."""
    names = ("q", "k", "w", "attn", "d_y", "gates", "d_finals", "zero", "d_initial", "d_ends")
    hbm = dict(zip(names, refs, strict=True))
    zero = hbm.pop("zero")
    out = {name: hbm.pop(name) for name in names[6:] if name != "zero"}
    seq, head, block = (jax.lax.axis_index(axis) for axis in ("seq", "head", "block"))
    values = pl.ds(block * VALUE_BLOCK, VALUE_BLOCK)
    fetch = functools.partial(
        fetch_chunk, hbm, s, head=head, group=group, block=block, values="d_y"
    )
    step = functools.partial(_reverse_step, out, s, head=head, block=block)
    start, end = (out[name].at[seq, head, values] for name in ("d_finals", "d_initial"))
    state_pass.carry_over_sequence(
        table, fetch, step, start, end, loaded=s["loaded"], slots=slots, reverse=True, zero=zero
    )


def reverse(table, q, k, w, attn, d_y, gates, d_finals, *, interpret):
    """The reverse state pass: ``d_y`` pieces ``[tokens, HV, V]``, ``d_finals [N, HV, V,
    K]`` float32, the rest as the forward's (``attn``: ``factors``'). Returns ``(d_initial [N, HV, V, K] float32,
    d_ends)``, ``d_ends`` the pieces of every chunk's end-state cotangent ``[chunks, HV, V,
    K]``."""
    count = len(q)
    tokens, heads, key_dim = q[0].shape
    v_heads, value_dim = d_y[0].shape[1:]
    slots, scratch = pass_scratch(count, key_dim, values="d_y", squares=1)
    scratch["carry"] = tiles.smem((VALUE_BLOCK, key_dim), F32)
    shape = (tokens // CHUNK, v_heads, value_dim, key_dim)
    out_type = (
        jax.ShapeDtypeStruct(d_finals.shape, F32),
        tuple(jax.ShapeDtypeStruct(shape, tiles.BF16) for _ in range(count)),
    )
    call = tiles.kernel_call(
        functools.partial(_reverse_kernel, group=v_heads // heads, slots=slots),
        name="gdn_mosaic_reverse",
        out_type=out_type,
        scratch=scratch,
        grid=dict(block=value_dim // VALUE_BLOCK, head=v_heads, seq=d_finals.shape[0]),
        interpret=interpret,
    )
    zero = jnp.zeros((1,), jnp.int32)
    inputs = (tuple(q), tuple(k), tuple(w), tuple(attn), tuple(d_y), gates, d_finals)
    return call(table, *inputs, zero)
