"""The gated delta rule's factors kernel (``impl="mosaic_gpu"``, ``op.py``), a program per
(chunk, value head): the chunk's decays, ``K K^T``, the inverse ``T`` of its intra-chunk
system by doubling blocks on the tensor cores, the WY factors ``w = T diag(beta exp(g))
K``, ``u = T diag(beta) V`` (``chunk.chunk_factors``) and the chunk's attention ``Q K^T *
Gamma``, written to HBM as bf16 pieces, and for the backward ``T`` too (its grads kernel
reads it rather than making it again). The state passes read the attention: what does not
depend on the state is made here, every chunk at once, not in their sequential steps.

The scaled inputs and then ``w`` and ``u`` take the tiles of k and v, which the products
have read by then: at about 90 KB of shared memory a program, two programs share an SM.

HBM layouts (``layout.py``): q, k pieces ``[tokens, H, K]``, v, u pieces ``[tokens, HV,
V]``, w ``[tokens, HV, K]``, the attention and T ``[tokens, HV, C]``, ``gates [GATES, HV,
tokens]`` (``chunk.gate_rows``).
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gdn_jax.ops.mosaic import tiles
from gdn_jax.ops.mosaic.limits import CHUNK
from gdn_jax.ops.mosaic.scalar import chunk as in_chunk
from gdn_jax.ops.mosaic.tiles import F32, Pieces


def _factors_kernel(q_hbm, k_hbm, v_hbm, gates_hbm, w_hbm, u_hbm, attn_hbm, *t_hbm, group, **s):
    """One chunk of one value head: its ``w [C, K]``, ``u [C, V]`` and attention ``[C,
    C]`` (and ``T [C, C]`` into ``t_hbm``, where given)."""
    chunk, head = jax.lax.axis_index("chunk"), jax.lax.axis_index("head")
    tokens = pl.ds(chunk * CHUNK, CHUNK)
    sources = (
        *(ref.at[tokens, head // group] for ref in (*q_hbm, *k_hbm)),
        *(ref.at[tokens, head] for ref in v_hbm),
        gates_hbm.at[:, head, tokens],
    )
    dsts = (*s["q"].refs, *s["k"].refs, *s["v"].refs, s["gates"])
    for src, dst in zip(sources, dsts, strict=True):
        plgpu.copy_gmem_to_smem(src, dst, s["loaded"])
    in_chunk.write_masks(s)
    plgpu.barrier_wait(s["loaded"])
    # The attention first, into the segment sums' tiles once the decays are made: held
    # through the inverse, the decays within the chunk made ptxas spill (two pieces).
    decays = in_chunk.chunk_decays(s["gates"], s)
    attn = Pieces(s["terms"].refs[: len(s["q"].refs)])
    tiles.store(attn, tiles.product((CHUNK, CHUNK), (s["q"], s["k"].T)) * decays.within)
    s = dict(s, erase=s["k"], write=s["v"])
    in_chunk.chunk_factors(s, s["k"], lambda: tiles.load(s["v"]), s["gates"], decays)
    pairs = [(s["erase"], w_hbm), (s["write"], u_hbm), (attn, attn_hbm)]
    pairs += [(s["inverse"], t) for t in t_hbm]
    tiles.copy_out(
        *((src, dst.at[tokens, head]) for tile, hbm in pairs
          for src, dst in zip(tile.refs, hbm, strict=True))
    )  # fmt: skip
    plgpu.wait_smem_to_gmem(0)


def system_scratch(count: int) -> dict:
    """The scratch of ``scalar/chunk.chunk_system`` for operands of ``count`` pieces (the
    strict mask is made in registers: one chunk a program, no loop to hoist it out of)."""
    square = (CHUNK, CHUNK)
    return dict(
        terms=tiles.pieces(tiles.SEGMENT_PIECES, square),
        ones=tiles.pieces(1, square),
        off=tiles.pieces(count, square),
        inverse=tiles.pieces(count, square),
        half=tiles.pieces(count, square),
    )


def factors(q, k, v, gates, *, keep_inverse: bool, interpret):
    """The WY factors and the attention of every chunk: ``q``, ``k`` pieces ``[tokens, H,
    K]``, ``v`` pieces ``[tokens, HV, V]``, ``gates [GATES, HV, tokens]`` float32 (``tokens``
    a multiple of the chunk, ``K`` and ``V`` of 64). Returns ``(w, u, attn)``, pieces like
    ``k`` and ``v`` per value head and ``[tokens, HV, C]``, and with ``keep_inverse`` ``(w,
    u, attn, T)``, T's pieces ``[tokens, HV, C]``."""
    count = len(k)
    tokens, heads, key_dim = k[0].shape
    v_heads, value_dim = v[0].shape[1:]
    scratch = dict(
        q=tiles.pieces(count, (CHUNK, key_dim)),
        k=tiles.pieces(count, (CHUNK, key_dim)),
        v=tiles.pieces(count, (CHUNK, value_dim)),
        gates=plgpu.SMEM((in_chunk.GATES, CHUNK), F32),
        loaded=plgpu.Barrier(num_arrivals=3 * count + 1),
        **system_scratch(count),
    )
    shapes = ((tokens, v_heads, key_dim), (tokens, v_heads, value_dim))
    shapes += ((tokens, v_heads, CHUNK),) * (2 if keep_inverse else 1)
    out_type = tuple(
        tuple(jax.ShapeDtypeStruct(x, tiles.BF16) for _ in range(count)) for x in shapes
    )
    call = tiles.kernel_call(
        functools.partial(_factors_kernel, group=v_heads // heads),
        name="gdn_mosaic_factors",
        out_type=out_type,
        scratch=scratch,
        grid=dict(head=v_heads, chunk=tokens // CHUNK),
        interpret=interpret,
    )
    return call(tuple(q), tuple(k), tuple(v), gates)
