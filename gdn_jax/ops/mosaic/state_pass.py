"""The state passes' programs of the Mosaic GPU kernels: one program a (sequence, value
head, block of 64 value channels) carries its block of a float32 state, or of a state's
cotangent, on chip from a sequence's first chunk to its last (or last to first) while each
chunk's tiles stream in by TMA. ``ops/mosaic/scalar/factors.py``, ``states.py``, ``ops/mosaic/scalar/reverse.py``, ``grads.py`` and the
channel-decay kernels' passes run their chunk steps through them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gdn_jax.ops.mosaic.tiles import WGMMA, copy_out, store


def keep_state(s: dict, state, ends) -> None:
    """``state [64, K]`` (float32 registers) into ``s["state"]``'s pieces, the operand of the
    chunk's products, and out to the HBM views ``ends`` by TMA, once the previous chunk's
    copy out of those pieces has read them."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    store(s["state"], state)
    copy_out(*zip(s["state"].refs, ends, strict=True))


def stream_chunks(first, count, fetch, step, init, *, loaded, slots: int, reverse=False, zero=None):
    """``step(chunk, slot, carry) -> carry`` over a sequence's ``count`` chunks from
    ``first`` (last to first with ``reverse``), each chunk's tiles copied into ``slot`` by
    ``fetch(chunk, slot)`` (TMA copies arriving on ``loaded.at[slot]``). With two slots the
    next chunk's tiles stream in while this one computes; a slot is refilled only after the
    step that read it has returned (every product awaited).

    ``zero``: an HBM ref holding an int32 0, read in each step and added to a single slot's
    index: slot 0 a constant, every view of it and its wgmma descriptors were invariant,
    hoisted out of the loop by LLVM and held in registers through it (ptxas spilled)."""

    def chunk_at(i):
        return first + count - 1 - i if reverse else first + i

    @pl.when(count > 0)
    def _():
        fetch(chunk_at(0), 0)

    def body(i, carry):
        slot = jax.lax.rem(i, jnp.int32(slots))
        if slots == 1 and zero is not None:
            slot = slot + zero[0]
        if slots > 1:

            @pl.when(i + 1 < count)
            def _():
                fetch(chunk_at(i + 1), 1 - slot)

        plgpu.barrier_wait(loaded.at[slot])
        carry = step(chunk_at(i), slot, carry)
        if slots == 1:

            @pl.when(i + 1 < count)
            def _():
                fetch(chunk_at(i + 1), 0)

        return carry

    return jax.lax.fori_loop(0, count, body, init)


def carry_over_sequence(
    table, fetch, step, start, end, *, loaded, slots: int, reverse=False, zero=None
):
    """The body of a state pass's program (a sequence, value head and block of value
    channels): its block of what it carries, ``[64, K]`` float32 (a state, or a state's
    cotangent), read from ``start`` (an HBM view), ``step`` over the sequence's chunks
    (``stream_chunks``, ``zero`` its), written to ``end``; every copy out awaited."""
    seq = jax.lax.axis_index("seq")
    carried = plgpu.load(start, layout=WGMMA, optimized=False)
    carried = stream_chunks(
        table[seq, 0], table[seq, 1], fetch, step, carried, loaded=loaded, slots=slots,
        reverse=reverse, zero=zero,
    )  # fmt: skip
    end[...] = carried
    plgpu.wait_smem_to_gmem(0)
