"""The tile primitives of the Mosaic GPU kernels, on one warpgroup's register tiles and
shared-memory operands: operands as bf16 pieces, stores, fences, the products on the tensor
cores, layouts, the inverse of a unit lower-triangular tile, and the kernel call.

Every product is a Hopper ``wgmma``: operands in shared memory as bf16, accumulated in
float32. An operand is held as its bf16 *pieces* (``Pieces``): one piece for bf16 inputs
(the operand rounded to bf16, as the field's kernels do), two for float32 inputs (``hi =
bf16(x)``, ``lo = bf16(x - hi)``, about 17 bits of the mantissa), whose products ``hi hi +
hi lo + lo hi`` come within about 1e-5 of the float32 product. Gate sums take
``SEGMENT_PIECES`` pieces, which hold a float32 exactly.

A wgmma and a TMA store read shared memory through the async proxy: ``product`` and
``copy_out``, the only places that issue them, fence the warpgroup's stores first.

Register tiles have a layout: ``WGMMA`` for ``[64 m, n]`` tiles (a wgmma accumulator's),
``ROWS`` for a vector with one entry a row of such a tile, ``COLS`` one entry a column. A
vector is read from shared memory in whichever of the two a product needs, so no tile is
ever transposed in registers; a transposed operand is a transposed view of shared memory.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gdn_jax.ops.mosaic import by_platform, limits
from gdn_jax.ops.mosaic.limits import CHUNK

F32 = jnp.float32


BF16 = jnp.bfloat16


WGMMA = plgpu.Layout.WGMMA


ROWS = WGMMA.reduce(1)


COLS = WGMMA.reduce(0)


WARPGROUP = "warpgroup"  # the axis of a warp-specialised kernel's warpgroups


def key_shares(key_dim: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The key channels ``(start, stop)`` of each of two warpgroups that share them by
    blocks of 64, the first taking the odd block (at ``K = 64``, all of them)."""
    middle = key_dim - key_dim // CHUNK // 2 * CHUNK
    return (0, middle), (middle, key_dim)


SEGMENT_PIECES = 3  # bf16 pieces that hold a float32 gate exactly


def swizzled(dtype) -> tuple:
    """The shared-memory transforms of a ``[rows, n]`` tile that TMA and wgmma read: 128-byte
    swizzle over tiles of 8 rows by 128 bytes (``n`` a multiple of 64 bf16 or 32 float32)."""
    return (
        plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(128),
    )


def smem(shape, dtype=BF16):
    """A swizzled shared-memory tile."""
    return plgpu.SMEM(shape, dtype, transforms=swizzled(dtype))


class Pieces(NamedTuple):
    """An operand in shared memory: the refs of its bf16 pieces, largest first."""

    refs: tuple

    @property
    def T(self) -> Pieces:  # noqa: N802 (the transposed view, as an array's .T)
        return Pieces(tuple(ref.T for ref in self.refs))

    def at(self, *index) -> Pieces:
        return Pieces(tuple(ref.at[index] for ref in self.refs))


def piece_count(v_dtype) -> int:
    """How many bf16 pieces every operand of the kernels takes for values of ``v_dtype``:
    one for bf16 (the field's kernels' precision), two for any other (about float32's)."""
    return 1 if v_dtype == BF16 else 2


def split(x, count: int) -> list:
    """``x`` (float32) as ``count`` bf16 pieces that sum to it, largest first."""
    pieces = []
    for _ in range(count - 1):
        piece = x.astype(BF16)
        pieces.append(piece)
        x = x - piece.astype(F32)
    return [*pieces, x.astype(BF16)]


def store(pieces: Pieces, x) -> None:
    """``x [m, n]`` (float32, WGMMA layout) into ``pieces``; ``commit`` before a product
    reads it."""
    for ref, piece in zip(pieces.refs, split(x, len(pieces.refs)), strict=True):
        ref[...] = piece


def commit() -> None:
    """Make the warpgroup's writes to shared memory visible to the tensor cores and TMA."""
    plgpu.commit_smem()


def copy_out(*pairs) -> None:
    """TMA stores of shared-memory tiles to HBM, ``(src, dst)`` each, after one commit: TMA
    reads through the async proxy too (``product``), so every store out fences first."""
    commit()
    for src, dst in pairs:
        plgpu.copy_smem_to_gmem(src, dst)


def _sum(parts):
    total = None
    for part in parts:
        total = part if total is None else total + part
    return total


def load(pieces: Pieces):
    """The float32 sum of an operand's pieces, as a WGMMA-layout tile."""
    return _sum(ref[...].astype(F32) for ref in pieces.refs)


def load_global(refs):
    """The float32 sum of an operand's pieces read straight from HBM (no shared memory),
    as a WGMMA-layout tile."""
    return _sum(plgpu.load(ref, layout=WGMMA, optimized=False).astype(F32) for ref in refs)


def mma(acc, a: Pieces, b: Pieces) -> None:
    """Issue ``acc += a @ b`` over the pieces whose product is above the pieces' precision:
    ``i + j < max(len(a), len(b))`` (one piece: one product; ``hi, lo`` by ``hi, lo``:
    three; three pieces against an exact operand of one: three)."""
    count = max(len(a.refs), len(b.refs))
    for i, a_ref in enumerate(a.refs):
        for j, b_ref in enumerate(b.refs):
            if i + j < count:
                plgpu.wgmma(acc, a_ref, b_ref)


def product(shape, *terms):
    """``sum(a @ b for a, b in terms)`` as a float32 ``[m, n]`` tile (WGMMA layout), each a
    wgmma over the pieces, awaited.

    It commits first: a wgmma reads shared memory through the async proxy, so a tile the
    warpgroup stored from registers is visible to it only after a proxy fence. Fencing here,
    in the one place that issues wgmma, means no caller can forget it (a store of the
    inverse read by the next product without one gave stale tiles on the hardware, which
    interpret mode cannot show)."""
    commit()

    def run(acc):
        for a, b in terms:
            mma(acc, a, b)
        return acc[...]

    return pl.run_scoped(run, plgpu.ACC(shape, F32))


def iotas(shape):
    """``(rows, cols)``: each entry's row and column index, ``[m, n]`` int32 tiles."""
    return tuple(plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=WGMMA) for axis in (0, 1))


def by_row(vector, shape):
    """A ``ROWS`` vector ``[m]`` down the rows of an ``[m, n]`` tile: ``x[t, i] = v[t]``."""
    return jax.lax.broadcast_in_dim(vector, shape, (0,))


def by_col(vector, shape):
    """A ``COLS`` vector ``[n]`` across the columns of an ``[m, n]`` tile: ``x[t, i] =
    v[i]``."""
    return jax.lax.broadcast_in_dim(vector, shape, (1,))


def unit_lower_inverse(strict, off: Pieces, inverse: Pieces, half: Pieces):
    """``(I + strict)^{-1}`` of a strictly lower-triangular ``[C, C]`` tile by doubling
    blocks on the tensor cores (``chunked/triangular.py``): with ``D`` the inverse of the diagonal
    blocks of size ``s`` and ``L`` the blocks just below them in blocks of ``2 s``,

        D' = D - D (L D),

    which is ``[[X11, 0], [-X22 A21 X11, X22]]`` block by block. Blocks of 1 are 1 and those
    of 2 need no product. ``off``, ``inverse`` and ``half`` are scratch ``[C, C]`` operands.
    """
    shape = strict.shape
    rows, cols = iotas(shape)
    apart = rows ^ cols  # < s exactly when (t, i) share a diagonal block of size s
    eye = jnp.where(rows == cols, 1.0, 0.0)

    def level(i, d):  # blocks of 2^i into blocks of 2^(i+1); a loop (see over_blocks)
        size = jax.lax.shift_left(jnp.int32(1), i)
        below = (apart >= size) & (apart < 2 * size)
        store(off, jnp.where(below, strict, 0.0))
        store(inverse, d)
        commit()
        store(half, product(shape, (off, inverse)))
        commit()
        return d - product(shape, (inverse, half))

    d = eye - jnp.where(apart < 2, strict, 0.0)
    return jax.lax.fori_loop(jnp.int32(1), jnp.int32(shape[0].bit_length() - 1), level, d)


def over_blocks(size: int, body, init, zero=None, start: int = 0):
    """``body(first, carry) -> carry`` for ``first`` over ``start, start + 64, ..., size -
    64`` as a loop, not unrolled: ptxas then holds one block's registers at a time (a kernel
    of straight-line code was scheduled into spills). ``zero``: an int32 0 the compiler
    cannot see (read from HBM), added to the trip count so that a loop of one trip stays a
    loop too, rather than being straight-lined into the code around it."""

    def step(i, carry):
        return body(pl.multiple_of(start + i * CHUNK, CHUNK), carry)

    trips = (size - start) // CHUNK
    trips = jnp.int32(trips) if zero is None else trips + zero
    return jax.lax.fori_loop(jnp.int32(0), trips, step, init)


def pieces(count: int, shape) -> Pieces:
    """Scratch for an operand of ``count`` pieces, each a swizzled bf16 tile."""
    return Pieces(tuple(smem(shape) for _ in range(count)))


def operand(x, count: int) -> tuple:
    """``x`` (an XLA array) as its ``count`` bf16 pieces (``split``)."""
    if count == 1:
        return (x.astype(BF16),)
    return tuple(split(x.astype(F32), count))


def hand_over(barrier) -> None:
    """Arrive at ``barrier`` (one arrival a warpgroup) once every thread of the warpgroup has
    stored what another warpgroup will read after waiting on it. One thread arrives for the
    warpgroup, and its release orders only its own stores: ``commit``'s warpgroup barrier
    puts the other threads' stores before it, and its fence makes them visible to the
    reader's wgmma and TMA too."""
    commit()
    plgpu.barrier_arrive(barrier)


def finish_together(done) -> None:
    """Every warpgroup of the program arrives at ``done`` (a barrier of one arrival a
    warpgroup) and waits for the others: a warpgroup that left the kernel while another
    still issued wgmma ended some runs of the field's kernels in an illegal instruction
    (sm_90, jax 0.11.2)."""
    plgpu.barrier_arrive(done)
    plgpu.barrier_wait(done)


def kernel_call(body, *, name: str, out_type, scratch, grid: dict, interpret, warpgroups=1):
    """``plgpu.kernel`` of ``warpgroups`` warpgroups a program over ``grid`` (axis name:
    size), in Lane semantics (explicit layouts: Mosaic GPU's layout inference, its default
    from jax 0.11, found no solution for these kernels). With more than one, the body reads
    its own as ``jax.lax.axis_index(WARPGROUP)`` and ends in ``finish_together``.

    The grid's last axis is CUDA's x, the only one past 65,535 programs (Pallas reverses
    the grid): it is what grows with the input, chunks or sequences (``limits.GRID_X``).

    ``interpret``: False compiles the kernel, True (or an ``InterpretGPUParams``) runs it in
    Mosaic GPU's interpret mode, None leaves the choice to the platform the program is
    lowered for (``dispatch.kernel_interpret``): compiled for CUDA, interpreted for any
    other.

    ``approx_math``: ``exp`` is ``ex2.approx`` of ``x log2(e)``, two instructions where
    libdevice's ``expf`` is eight (a fifth of the channel kernels' instructions), within a
    few float32 ulps: far inside the float32 row of the tolerance table."""

    def build(params):
        return plgpu.kernel(
            body,
            out_type=out_type,
            scratch_types=scratch,
            grid=tuple(grid.values()),
            grid_names=tuple(grid),
            compiler_params=plgpu.CompilerParams(
                lowering_semantics=plgpu.LoweringSemantics.Lane, approx_math=True
            ),
            interpret=params,
            kernel_name=name,
            **({} if warpgroups == 1 else dict(num_threads=warpgroups, thread_name=WARPGROUP)),
        )

    def refusal():
        return limits.interpreter_refusal(name, warpgroups)

    if interpret is None:
        return lambda *args: by_platform.call(
            build(None), build(_params(True)), *args, refusal=refusal
        )
    if interpret is not False and (reason := refusal()) is not None:
        raise RuntimeError(reason)
    return build(_params(interpret))


def _params(interpret):
    if interpret is True:
        return plgpu.InterpretGPUParams()
    return interpret or None
