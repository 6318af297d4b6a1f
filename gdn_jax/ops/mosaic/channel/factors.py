"""The channel-decay rules' factors kernel (KDA, GDN-2; ``impl="mosaic_gpu"``, ``op.py``), a
program per (chunk, value head): the chunk's scores ``M`` (queries) and ``A`` (erase vectors)
by halving levels (``chunk.channel_scores``), the inverse ``T = (I + A)^{-1}`` by doubling
blocks (``tiles.unit_lower_inverse``), the decays from the chunk's start and to its end, and

    w = T (E * exp(G)),  u = T X,  q_start = Q * exp(G),  k_end = K * exp(G_C - G),

written to HBM as bf16 pieces with ``M``. ``whole = exp(G_C)`` is a sum of each chunk's gates
in XLA.

Two warpgroups a program: each makes every level's decayed operands over half the key
channels, then the main one adds the level to ``M`` and the second to ``A``
(``chunk.channel_scores``); the second makes ``T`` and ``u`` while the main one makes the
decays' factors, then ``w`` with the second's ``T``.

Interfaces (``tokens`` a multiple of the chunk ``C = 64``, laid out by ``layout.token_layout``;
``K`` and ``V`` multiples of 64; "pieces" is a tuple of ``count`` bf16 arrays that sum to the
operand, ``tiles.operand``, ``count`` 1 for bf16 inputs and 2 for float32)::

    factors(q, k, e, x, g, *, keep_inverse, interpret)
        -> Factors(w, u, q_start, k_end, scores, whole, inverse)
      q, k      pieces [tokens, H, K]   key heads; value head h reads key head h // (HV // H)
      e         pieces [tokens, HV, K]  erase vectors b * k
      x         pieces [tokens, HV, V]  writes w * v
      g         float32 [tokens, HV, K] log-decays, clamped at decays.LOG_ALPHA_FLOOR
      w, q_start, k_end pieces [tokens, HV, K];  u pieces [tokens, HV, V]
      scores    pieces [tokens, HV, C]  M of each chunk's rows (row t of a chunk: M[t, :])
      whole     float32 [chunks, HV, K] exp(G_C)
      inverse   pieces [tokens, HV, C]  T of each chunk's rows, with keep_inverse (else None)

The kernel splits ``g`` into the ``SEGMENT_PIECES`` bf16 pieces that its sums read
(``chunk.load_gates``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gdn_jax.ops.mosaic import tiles
from gdn_jax.ops.mosaic.channel import chunk as in_chunk
from gdn_jax.ops.mosaic.limits import CHUNK
from gdn_jax.ops.mosaic.tiles import F32

MAIN, SECOND = 0, 1  # the warpgroups
_BARRIERS = ("mask_ready", "main_operands", "second_operands", "read", "inverse_ready")


class Factors(NamedTuple):
    """What ``factors`` returns (the module docstring gives the layouts)."""

    w: tuple
    u: tuple
    q_start: tuple
    k_end: tuple
    scores: tuple
    whole: jax.Array
    inverse: tuple | None


def chunk_wholes(g):
    """``exp(G_C)`` of every chunk, ``[chunks, HV, K]``: the sum of each chunk's own gates."""
    tokens, heads, key_dim = g.shape
    return jax.numpy.exp(g.astype(F32).reshape(tokens // CHUNK, CHUNK, heads, key_dim).sum(1))


def _decayed(s, key_dim: int) -> None:
    """``q_start``, ``E * exp(G)`` and ``k_end`` into ``s["rows"][0]``, ``s["e"]`` and
    ``s["cols"]``, committed. The chunk's masks (``s["chunk_masks"]``) are written before
    the levels: made here, after the inverse, ptxas spilled at float32 (two pieces)."""

    def block(first, carry):
        keys = in_chunk.key_block(first)
        from_start = in_chunk.chunk_decay(s["chunk_masks"], s["g"].at(*keys), 0)
        for src, dst in ((s["q"], s["rows"][0]), (s["e"], s["e"])):
            tiles.store(dst.at(*keys), tiles.load(src.at(*keys)) * from_start)
        to_end = in_chunk.chunk_decay(s["chunk_masks"], s["g"].at(*keys), 1)
        tiles.store(s["cols"].at(*keys), tiles.load(s["k"].at(*keys)) * to_end)
        return carry

    tiles.over_blocks(key_dim, block, 0)
    tiles.commit()


def _times_inverse(s, src: tiles.Pieces, dst: tiles.Pieces) -> None:
    """``T src`` into ``dst`` (``[C, n]`` operands, ``T`` in ``s["inverse"]``), 64 columns
    at a time, committed."""

    def block(first, carry):
        cols = in_chunk.key_block(first)
        tiles.store(dst.at(*cols), tiles.product(in_chunk.SQUARE, (s["inverse"], src.at(*cols))))
        return carry

    tiles.over_blocks(src.refs[0].shape[1], block, 0)
    tiles.commit()


def _scores(s, side: int, keys):
    """Warpgroup ``side``'s score, ``M`` (main) or ``A`` (second), its share of the levels'
    operands over the key channels ``keys`` (``chunk.channel_scores``)."""
    sync = in_chunk.Sync(s["mask_ready"], (s["main_operands"], s["second_operands"]), s["read"])
    xs, diagonal = (s["q"], s["e"]), (True, False)
    return in_chunk.channel_scores(
        s, xs, s["k"], s["g"], diagonal=diagonal, side=side, keys=keys, sync=sync
    )


def _copy_out(results, tokens, head) -> None:
    """TMA stores of ``(tile, hbm pieces)`` pairs to the program's chunk and value head."""
    tiles.copy_out(
        *((src, dst.at[tokens, head]) for tile, hbm in results
          for src, dst in zip(tile.refs, hbm, strict=True))
    )  # fmt: skip
    plgpu.wait_smem_to_gmem(0)


def _main_side(s, hbm, out, index, keys) -> None:
    """The loads, ``M`` (the levels' operands over the key channels ``keys``), the decays'
    factors ``q_start``, ``E * exp(G)`` and ``k_end``, and ``w`` once the second side has
    made ``T``."""
    (q_hbm, k_hbm, e_hbm, x_hbm, g_hbm), (tokens, head, group) = hbm, index
    w_hbm, _, q_start_hbm, k_end_hbm, scores_hbm, *_ = out
    sources = (
        *(ref.at[tokens, head // group] for ref in (*q_hbm, *k_hbm)),
        *(ref.at[tokens, head] for ref in (*e_hbm, *x_hbm)),
    )
    dsts = tuple(ref for name in ("q", "k", "e", "x") for ref in s[name].refs)
    for src, dst in zip(sources, dsts, strict=True):
        plgpu.copy_gmem_to_smem(src, dst, s["loaded"])
    in_chunk.load_gates(g_hbm.at[tokens, head], s["g"])  # while the tiles load
    in_chunk.write_chunk_masks(s["chunk_masks"])
    plgpu.barrier_wait(s["loaded"])
    scores = _scores(s, MAIN, keys)
    key_dim = s["q"].refs[0].shape[1]
    _decayed(s, key_dim)
    plgpu.barrier_wait(s["inverse_ready"])
    tiles.store(s["off"], scores)  # the inverse's scratch, free once T is made
    _times_inverse(s, s["e"], s["e"])  # w, each block of E * exp(G) read before it is written
    results = ((s["off"], scores_hbm), (s["e"], w_hbm), (s["rows"][0], q_start_hbm))
    results += ((s["cols"], k_end_hbm),)
    _copy_out(results, tokens, head)


def _second_side(s, out, index, keys) -> None:
    """``A`` (the levels' operands over the key channels ``keys``), ``T = (I + A)^{-1}`` and
    ``u = T X``, and ``T`` out where ``out`` has room for it."""
    _, u_hbm, _, _, _, *t_hbm = out
    tokens, head, _ = index
    plgpu.barrier_wait(s["loaded"])
    strict = _scores(s, SECOND, keys)
    inverse = tiles.unit_lower_inverse(strict, s["off"], s["inverse"], s["half"])
    tiles.store(s["inverse"], inverse)
    tiles.hand_over(s["inverse_ready"])
    _times_inverse(s, s["x"], s["x"])  # u, each block of x read before it is written
    _copy_out(((s["x"], u_hbm), *((s["inverse"], t) for t in t_hbm)), tokens, head)


def _factors_kernel(*refs, group: int, **s):
    """One chunk of one value head: its ``w``, ``u``, ``q_start``, ``k_end`` and ``M``, and
    ``T`` where the outputs have room for it, by two warpgroups (``_main_side``,
    ``_second_side``), each making the levels' operands over its share of the key
    channels."""
    hbm, out = refs[:5], refs[5:]
    chunk, head = jax.lax.axis_index("chunk"), jax.lax.axis_index("head")
    index = (pl.ds(chunk * CHUNK, CHUNK), head, group)
    main, second = tiles.key_shares(s["q"].refs[0].shape[1])
    side = jax.lax.axis_index(tiles.WARPGROUP)
    pl.when(side == MAIN)(lambda: _main_side(s, hbm, out, index, main))
    pl.when(side == SECOND)(lambda: _second_side(s, out, index, second))
    tiles.finish_together(s["done"])


def factors(q, k, e, x, g, *, keep_inverse: bool, interpret) -> Factors:
    """The factors of every chunk (module docstring), with ``keep_inverse`` each chunk's
    ``T`` too, pieces ``[tokens, HV, C]`` (for the backward, which would otherwise make it
    again: a pass over the levels and the doubling inverse)."""
    count = len(q)
    tokens, heads, key_dim = q[0].shape
    v_heads, value_dim = x[0].shape[1:]
    tile = (CHUNK, key_dim)
    scratch = dict(
        q=tiles.pieces(count, tile),
        k=tiles.pieces(count, tile),
        e=tiles.pieces(count, tile),
        x=tiles.pieces(count, (CHUNK, value_dim)),
        g=tiles.pieces(tiles.SEGMENT_PIECES, tile),
        masks=(tiles.pieces(1, in_chunk.SQUARE),),
        chunk_masks=(tiles.pieces(1, in_chunk.SQUARE), tiles.pieces(1, in_chunk.SQUARE)),
        rows=(tiles.pieces(count, tile), tiles.pieces(count, tile)),
        cols=tiles.pieces(count, tile),
        off=tiles.pieces(count, in_chunk.SQUARE),
        inverse=tiles.pieces(count, in_chunk.SQUARE),
        half=tiles.pieces(count, in_chunk.SQUARE),
        loaded=plgpu.Barrier(num_arrivals=4 * count),
        **{name: plgpu.Barrier() for name in _BARRIERS},
        done=plgpu.Barrier(num_arrivals=2),
    )
    shapes = [(tokens, v_heads, key_dim), (tokens, v_heads, value_dim)]
    shapes += [shapes[0], shapes[0], (tokens, v_heads, CHUNK)]
    shapes += [(tokens, v_heads, CHUNK)] * keep_inverse
    out_type = tuple(
        tuple(jax.ShapeDtypeStruct(x, tiles.BF16) for _ in range(count)) for x in shapes
    )
    call = tiles.kernel_call(
        functools.partial(_factors_kernel, group=v_heads // heads),
        name="channel_mosaic_factors",
        out_type=out_type,
        scratch=scratch,
        grid=dict(head=v_heads, chunk=tokens // CHUNK),
        interpret=interpret,
        warpgroups=2,
    )
    outs = call(tuple(q), tuple(k), tuple(e), tuple(x), g.astype(F32))
    return Factors(*outs[:5], chunk_wholes(g), outs[5] if keep_inverse else None)
