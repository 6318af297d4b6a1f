"""What the gated delta rule's Mosaic GPU kernels do inside one chunk (scalar decay a token
and value head): the decays of a chunk, the inverse of its intra-chunk system and the WY
factors, on one warpgroup's tiles (``tiles.py``).

The gates' segment sums take ``SEGMENT_PIECES`` pieces against a matrix of ones: the
log-decays are then sums of the gates themselves, as ``chunked/decays.py``'s are, not
differences of running sums, which a -1e4 reset would round away.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from gdn_jax.ops.mosaic import tiles
from gdn_jax.ops.mosaic.limits import CHUNK
from gdn_jax.ops.mosaic.tiles import BF16, F32, Pieces

GATES = 5  # gate_rows: log_alpha, beta, and the decays from the start, to the end and whole


class Decays(NamedTuple):
    """One chunk's decays (``decays.ChunkDecays``), as register tiles: ``within [C, C]``
    (WGMMA), ``from_start``, ``to_end`` and ``whole`` (every entry ``exp(g_C)``) ``[C]``
    (tiles.ROWS)."""

    within: jax.Array
    from_start: jax.Array
    to_end: jax.Array
    whole: jax.Array


def write_masks(s: dict) -> None:
    """The constant ``[C, C]`` tiles that ``chunk_decays`` reads, once a program: ``ones``
    (``t >= i``) and, where ``s`` has room for it, ``strict`` (``t > i``). A chunk loop
    reads its masks from shared memory: made in registers they are loop-invariant, and LLVM
    hoisted them out of the loop, where they held registers through it."""
    rows, cols = tiles.iotas((CHUNK, CHUNK))
    s["ones"].refs[0][...] = jnp.where(rows >= cols, 1.0, 0.0).astype(BF16)
    if "strict" in s:
        s["strict"].refs[0][...] = jnp.where(rows > cols, 1.0, 0.0).astype(BF16)
    tiles.commit()


def chunk_decays(gates, s: dict) -> Decays:
    """The decays of one chunk from its ``gates [GATES, C]`` (float32, shared memory).

    ``seg[t, i] = sum(log_alpha[i+1 : t+1])`` is the tiles.product of the lower-triangular ones
    with ``terms[r, i] = log_alpha[r] (r > i)``, in ``tiles.SEGMENT_PIECES`` tiles.pieces (exact). The
    decays from the start and to the end and over the chunk, sums of one row of gates each,
    come with the gates (``gate_rows``). ``s``: the masks of ``write_masks`` and the scratch
    ``terms`` (``tiles.SEGMENT_PIECES`` ``[C, C]`` bf16 tiles).
    """
    shape = (CHUNK, CHUNK)
    gates_down = tiles.by_row(plgpu.load(gates.at[0], layout=tiles.ROWS), shape)  # [t, i] = la[t]
    if "strict" in s:
        strict = tiles.load(s["strict"])
    else:
        rows, cols = tiles.iotas(shape)
        strict = jnp.where(rows > cols, 1.0, 0.0)
    tiles.store(s["terms"], gates_down * strict)
    tiles.commit()
    seg = tiles.product(shape, (s["ones"], s["terms"]))
    # seg is 0 above the diagonal (no term there), so exp meets no inf before the mask.
    within = jnp.exp(seg) * tiles.load(s["ones"])
    vectors = (plgpu.load(gates.at[row], layout=tiles.ROWS) for row in (2, 3, 4))
    return Decays(within, *vectors)


def chunk_vectors(gates) -> Decays:
    """A chunk's decays from its start, to its end and whole, as ``gate_rows`` made them
    (``[GATES, C]`` float32, shared memory); ``within`` None (the attention has it)."""
    rows = (plgpu.load(gates.at[row], layout=tiles.ROWS) for row in (2, 3, 4))
    return Decays(None, *rows)


def gate_rows(log_alpha, beta):
    """The gates of every chunk as the kernels read them, ``[GATES, HV, tokens]`` float32:
    ``log_alpha``, ``beta`` (``[HV, tokens]`` each) and each token's decays from its chunk's
    start, ``exp(g_t)``, and to its end, ``exp(g_C - g_t)``, and the chunk's, ``exp(g_C)``.
    Each is the exp of a sum of the gates of its own segment (a sum from the end of the
    gates shifted by one), never a difference of running sums (``chunked/decays.py``)."""
    heads, tokens = log_alpha.shape
    chunks = log_alpha.reshape(heads, tokens // CHUNK, CHUNK)
    from_start = jnp.cumsum(chunks, axis=-1)
    after = jnp.pad(chunks[..., 1:], [(0, 0), (0, 0), (0, 1)])  # log_alpha[t + 1], 0 last
    to_end = jnp.flip(jnp.cumsum(jnp.flip(after, -1), axis=-1), -1)
    whole = jnp.broadcast_to(from_start[..., -1:], chunks.shape)
    decays = (jnp.exp(x).reshape(heads, tokens) for x in (from_start, to_end, whole))
    return jnp.stack([log_alpha, beta, *decays]).astype(F32)


def chunk_system(s: dict, k: Pieces, gates, decays=None) -> tuple[Decays, jax.Array]:
    """The decays and ``beta`` (tiles.ROWS) of one chunk whose tiles ``k [C, K]`` and ``gates
    [GATES, C]`` are in shared memory, and the inverse ``T = (I + A)^{-1}`` of its system
    ``A = tril(diag(beta) (K K^T * Gamma), -1)`` (``chunked/wy.py``), left in ``s["inverse"]``.
    Scratch in ``s``: the masks (``write_masks``), ``terms``, ``off``, ``inverse``,
    ``half`` ``[C, C]``. ``decays``: the chunk's, where the caller has made them."""
    decays = chunk_decays(gates, s) if decays is None else decays
    beta = plgpu.load(gates.at[1], layout=tiles.ROWS)
    shape = (CHUNK, CHUNK)
    rows, cols = tiles.iotas(shape)
    gram = tiles.product(shape, (k, k.T))
    strict = jnp.where(rows > cols, tiles.by_row(beta, shape) * gram * decays.within, 0.0)
    tiles.store(s["inverse"], tiles.unit_lower_inverse(strict, s["off"], s["inverse"], s["half"]))
    return decays, beta


def scaled_inputs(s: dict, decays: Decays, beta, k: Pieces, v) -> None:
    """``diag(beta exp(g)) K`` into ``s["erase"]`` and ``diag(beta) V`` into ``s["write"]``
    (the right sides of the WY factors), and tiles.commit. ``v``: float32 registers."""
    k = tiles.load(k)
    tiles.store(s["erase"], k * tiles.by_row(beta * decays.from_start, k.shape))
    tiles.store(s["write"], v * tiles.by_row(beta, v.shape))
    tiles.commit()


def chunk_factors(s: dict, k: Pieces, v, gates, decays=None):
    """The WY factors ``w = T diag(beta exp(g)) K [C, K]``, ``u = T diag(beta) V [C, V]``
    (``wy.delta_factors``) of one chunk, written into ``s["erase"]`` and ``s["write"]``
    (and committed); ``v`` is read into registers once the inverse is made, by ``v()``.
    ``decays``: the chunk's, where the caller has made them."""
    decays, beta = chunk_system(s, k, gates, decays)
    scaled_inputs(s, decays, beta, k, v())
    w = tiles.product(k.refs[0].shape, (s["inverse"], s["erase"]))
    u = tiles.product(s["write"].refs[0].shape, (s["inverse"], s["write"]))
    tiles.store(s["erase"], w)
    tiles.store(s["write"], u)
    tiles.commit()


def squares(s: dict, number: int) -> list[Pieces]:
    """``number`` ``[C, C]`` operands of as many pieces as ``s["q"]``, carved from the
    scratch ``s["squares"]`` (``square_scratch``)."""
    count = len(s["q"].refs)
    refs = s["squares"].refs
    return [Pieces(refs[i * count : (i + 1) * count]) for i in range(number)]


def square_scratch(count: int, number: int) -> Pieces:
    """The scratch of ``squares(s, number)`` for operands of ``count`` pieces."""
    return tiles.pieces(number * count, (CHUNK, CHUNK))
