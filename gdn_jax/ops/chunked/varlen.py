"""Packed variable-length sequences (``cu_seqlens``) laid out for a block scan.

Sequence ``m`` owns tokens ``cu_seqlens[m] : cu_seqlens[m+1]`` of the packed axis. To run
the chunked form without letting a chunk straddle two sequences, each sequence is moved to
start on a block boundary of a slightly longer axis; the gaps hold inert tokens (zero
inputs, ``log_alpha = 0``, ``beta = 0``) that leave the state as it is. The longer axis has
a static size, ``(T + N * (C - 1)) // C`` blocks, so ``cu_seqlens`` may be traced: packing
can change from batch to batch without recompiling. With blocks of one token (the
recurrent form) the layout is the identity.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Int


class PackedLayout(NamedTuple):
    """Where each packed token sits on the block-aligned axis, and the per-block resets."""

    positions: Int[Array, " T"]
    num_blocks: int
    block_size: int
    resets: tuple[Int[Array, " NC"], Int[Array, " NC"]]

    def scatter(self, x):
        """``x [T, ...]`` onto the aligned axis ``[NC * block_size, ...]``, gaps zero; tokens
        past the last sequence are dropped."""
        size = self.num_blocks * self.block_size
        return jnp.zeros((size, *x.shape[1:]), x.dtype).at[self.positions].set(x, mode="drop")

    def gather(self, y):
        """Back from the aligned axis to the packed ``[T, ...]``, zeros past the last
        sequence."""
        return y.at[self.positions].get(mode="fill", fill_value=0)


def pack_layout(cu_seqlens: Int[Array, " _N1"], seq_len: int, block_size: int) -> PackedLayout:
    """The aligned layout of ``N`` packed sequences over ``seq_len`` tokens."""
    num_seqs = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.astype(jnp.int32)
    lengths = cu[1:] - cu[:-1]
    blocks_per_seq = -(-lengths // block_size)
    first_block = jnp.cumsum(blocks_per_seq, dtype=jnp.int32) - blocks_per_seq
    num_blocks = max(1, (seq_len + num_seqs * (block_size - 1)) // block_size)

    seq, offset = segment_positions(cu, seq_len)
    # A traced cu_seqlens may end before T: the tokens after it belong to no sequence, so
    # they are sent out of range, where the scatter drops them and the gather reads zeros.
    in_sequence = jnp.arange(seq_len, dtype=jnp.int32) < cu[-1]
    size = num_blocks * block_size
    positions = jnp.where(in_sequence, first_block[seq] * block_size + offset, size)

    ids = jnp.arange(num_seqs, dtype=jnp.int32)
    nonempty = lengths > 0

    def mark(blocks):
        # Empty sequences own no block; their index is sent out of range and dropped.
        where = jnp.where(nonempty, blocks, num_blocks)
        return jnp.full(num_blocks, -1, jnp.int32).at[where].set(ids, mode="drop")

    resets = (mark(first_block), mark(first_block + blocks_per_seq - 1))
    return PackedLayout(positions, num_blocks, block_size, resets)


def segment_positions(
    cu_seqlens: Int[Array, " _N1"], seq_len: int
) -> tuple[Int[Array, " T"], Int[Array, " T"]]:
    """For each packed token: the index of its sequence and its position inside it, ``[T]``."""
    t = jnp.arange(seq_len, dtype=jnp.int32)
    cu = cu_seqlens.astype(jnp.int32)
    # Token t belongs to the last sequence starting at or before it: with empty sequences
    # several offsets coincide and the count picks the one that owns t. A count over the
    # [T, N+1] comparisons rather than jnp.searchsorted, which fails inside shard_map when
    # the offsets vary across shards (jax 0.10.2), as the sequence-parallel form's do.
    seq = jnp.sum(cu[None, :] <= t[:, None], axis=1, dtype=jnp.int32) - 1
    return seq, t - cu[seq]


class ChunkLayout(NamedTuple):
    """Tokens ``[T, ...]`` to chunks ``[NC, C, ...]`` and outputs ``[NC, C, V]`` back to
    ``[T, V]``, with the resets of ``blocks.scan_blocks`` (None for one sequence)."""

    to_chunks: Callable
    from_chunks: Callable
    resets: tuple | None


def chunk_layout(seq_len: int, chunk_size: int, cu_seqlens=None) -> ChunkLayout:
    """The chunks of one sequence, its tail padded with inert tokens (zero inputs, so zero
    q, k, v, beta and log_alpha: no decay, no write), or of packed ``cu_seqlens``, each
    sequence starting on a chunk boundary (``pack_layout``)."""
    if cu_seqlens is not None:
        layout = pack_layout(cu_seqlens, seq_len, chunk_size)
        return ChunkLayout(
            lambda x: layout.scatter(x).reshape(-1, chunk_size, *x.shape[1:]),
            lambda y: layout.gather(y.reshape(-1, y.shape[-1])),
            layout.resets,
        )
    num_chunks = -(-seq_len // chunk_size)
    pad = num_chunks * chunk_size - seq_len

    def to_chunks(x):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape(num_chunks, chunk_size, *x.shape[1:])

    def from_chunks(y):
        return y.reshape(num_chunks * chunk_size, -1)[:seq_len]

    return ChunkLayout(to_chunks, from_chunks, None)
