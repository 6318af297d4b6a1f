"""What the Mosaic GPU kernels (``chunked_mosaic.py``) do inside one chunk, on one
warpgroup's register tiles and shared-memory operands: the decays of a chunk, the inverse of
its intra-chunk system and the products on the tensor cores.

Every product is a Hopper ``wgmma``: operands in shared memory as bf16, accumulated in
float32. An operand is held as its bf16 *pieces* (``Pieces``): one piece for bf16 inputs
(the operand rounded to bf16, as the field's kernels do), two for float32 inputs (``hi =
bf16(x)``, ``lo = bf16(x - hi)``, about 17 bits of the mantissa), whose products ``hi hi +
hi lo + lo hi`` come within about 1e-5 of the float32 product. The gates' segment sums take
three pieces, which hold a float32 exactly, against a matrix of ones: the log-decays are then
sums of the gates themselves, as ``decays.py``'s are, not differences of running sums, which
a -1e4 reset would round away.

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

CHUNK = 64  # a warpgroup's wgmma rows: the chunk's tokens
F32 = jnp.float32
BF16 = jnp.bfloat16
WGMMA = plgpu.Layout.WGMMA
ROWS = WGMMA.reduce(1)
COLS = WGMMA.reduce(0)
SEGMENT_PIECES = 3  # bf16 pieces that hold a float32 gate exactly
HAS_INTERPRET = hasattr(plgpu, "InterpretGPUParams")  # jax >= 0.11
GATES = 5  # gate_rows: log_alpha, beta, and the decays from the start, to the end and whole
# The named error of every route of a second derivative through the kernels' custom_vjp.
SECOND_ORDER = (
    "{rule}: impl='mosaic_gpu' differentiates once, in reverse mode: its backward is "
    "Mosaic GPU kernels, which JAX cannot differentiate again (forward over reverse, "
    "jax.hessian, a gradient of a gradient); use impl='chunked' for second order"
)


def unsupported_run(compute, chunk_size: int) -> str | None:
    """Why no Mosaic GPU kernel here can run (None: they can): a JAX without Mosaic GPU's
    interpret mode (before 0.11), chunks other than a wgmma's 64 rows, or a compute dtype
    other than float32. The kernels' own limits of K and V come after."""
    if not HAS_INTERPRET:
        return f"needs jax >= 0.11 (Mosaic GPU's interpret mode), got jax {jax.__version__}"
    if chunk_size != CHUNK:
        return f"runs chunks of {CHUNK} tokens (a wgmma's rows), got chunk_size={chunk_size}"
    if compute != F32:
        return f"computes in float32, got inputs whose compute dtype is {compute}"
    return None


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


class Decays(NamedTuple):
    """One chunk's decays (``decays.ChunkDecays``), as register tiles: ``within [C, C]``
    (WGMMA), ``from_start``, ``to_end`` and ``whole`` (every entry ``exp(g_C)``) ``[C]``
    (ROWS)."""

    within: jax.Array
    from_start: jax.Array
    to_end: jax.Array
    whole: jax.Array


def write_masks(s: dict) -> None:
    """The constant ``[C, C]`` tiles that ``chunk_decays`` reads, once a program: ``ones``
    (``t >= i``) and, where ``s`` has room for it, ``strict`` (``t > i``). A chunk loop
    reads its masks from shared memory: made in registers they are loop-invariant, and LLVM
    hoisted them out of the loop, where they held registers through it."""
    rows, cols = iotas((CHUNK, CHUNK))
    s["ones"].refs[0][...] = jnp.where(rows >= cols, 1.0, 0.0).astype(BF16)
    if "strict" in s:
        s["strict"].refs[0][...] = jnp.where(rows > cols, 1.0, 0.0).astype(BF16)
    commit()


def chunk_decays(gates, s: dict) -> Decays:
    """The decays of one chunk from its ``gates [GATES, C]`` (float32, shared memory).

    ``seg[t, i] = sum(log_alpha[i+1 : t+1])`` is the product of the lower-triangular ones
    with ``terms[r, i] = log_alpha[r] (r > i)``, in ``SEGMENT_PIECES`` pieces (exact). The
    decays from the start and to the end and over the chunk, sums of one row of gates each,
    come with the gates (``gate_rows``). ``s``: the masks of ``write_masks`` and the scratch
    ``terms`` (``SEGMENT_PIECES`` ``[C, C]`` bf16 tiles).
    """
    shape = (CHUNK, CHUNK)
    gates_down = by_row(plgpu.load(gates.at[0], layout=ROWS), shape)  # [t, i] = la[t]
    if "strict" in s:
        strict = load(s["strict"])
    else:
        rows, cols = iotas(shape)
        strict = jnp.where(rows > cols, 1.0, 0.0)
    store(s["terms"], gates_down * strict)
    commit()
    seg = product(shape, (s["ones"], s["terms"]))
    # seg is 0 above the diagonal (no term there), so exp meets no inf before the mask.
    within = jnp.exp(seg) * load(s["ones"])
    vectors = (plgpu.load(gates.at[row], layout=ROWS) for row in (2, 3, 4))
    return Decays(within, *vectors)


def gate_rows(log_alpha, beta):
    """The gates of every chunk as the kernels read them, ``[GATES, HV, tokens]`` float32:
    ``log_alpha``, ``beta`` (``[HV, tokens]`` each) and each token's decays from its chunk's
    start, ``exp(g_t)``, and to its end, ``exp(g_C - g_t)``, and the chunk's, ``exp(g_C)``.
    Each is the exp of a sum of the gates of its own segment (a sum from the end of the
    gates shifted by one), never a difference of running sums (``decays.py``)."""
    heads, tokens = log_alpha.shape
    chunks = log_alpha.reshape(heads, tokens // CHUNK, CHUNK)
    from_start = jnp.cumsum(chunks, axis=-1)
    after = jnp.pad(chunks[..., 1:], [(0, 0), (0, 0), (0, 1)])  # log_alpha[t + 1], 0 last
    to_end = jnp.flip(jnp.cumsum(jnp.flip(after, -1), axis=-1), -1)
    whole = jnp.broadcast_to(from_start[..., -1:], chunks.shape)
    decays = (jnp.exp(x).reshape(heads, tokens) for x in (from_start, to_end, whole))
    return jnp.stack([log_alpha, beta, *decays]).astype(F32)


def unit_lower_inverse(strict, off: Pieces, inverse: Pieces, half: Pieces):
    """``(I + strict)^{-1}`` of a strictly lower-triangular ``[C, C]`` tile by doubling
    blocks on the tensor cores (``triangular.py``): with ``D`` the inverse of the diagonal
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


def chunk_system(s: dict, k: Pieces, gates, decays=None) -> tuple[Decays, jax.Array]:
    """The decays and ``beta`` (ROWS) of one chunk whose tiles ``k [C, K]`` and ``gates
    [GATES, C]`` are in shared memory, and the inverse ``T = (I + A)^{-1}`` of its system
    ``A = tril(diag(beta) (K K^T * Gamma), -1)`` (``wy.py``), left in ``s["inverse"]``.
    Scratch in ``s``: the masks (``write_masks``), ``terms``, ``off``, ``inverse``,
    ``half`` ``[C, C]``. ``decays``: the chunk's, where the caller has made them."""
    decays = chunk_decays(gates, s) if decays is None else decays
    beta = plgpu.load(gates.at[1], layout=ROWS)
    shape = (CHUNK, CHUNK)
    rows, cols = iotas(shape)
    gram = product(shape, (k, k.T))
    strict = jnp.where(rows > cols, by_row(beta, shape) * gram * decays.within, 0.0)
    store(s["inverse"], unit_lower_inverse(strict, s["off"], s["inverse"], s["half"]))
    return decays, beta


def scaled_inputs(s: dict, decays: Decays, beta, k: Pieces, v) -> None:
    """``diag(beta exp(g)) K`` into ``s["erase"]`` and ``diag(beta) V`` into ``s["write"]``
    (the right sides of the WY factors), and commit. ``v``: float32 registers."""
    k = load(k)
    store(s["erase"], k * by_row(beta * decays.from_start, k.shape))
    store(s["write"], v * by_row(beta, v.shape))
    commit()


def over_blocks(size: int, body, init):
    """``body(first, carry) -> carry`` for ``first`` over ``0, 64, ..., size - 64`` as a
    loop, not unrolled: ptxas then holds one block's registers at a time (a kernel of
    straight-line code was scheduled into spills)."""

    def step(i, carry):
        return body(pl.multiple_of(i * CHUNK, CHUNK), carry)

    return jax.lax.fori_loop(jnp.int32(0), jnp.int32(size // CHUNK), step, init)


def chunk_factors(s: dict, k: Pieces, v, gates):
    """The WY factors ``w = T diag(beta exp(g)) K [C, K]``, ``u = T diag(beta) V [C, V]``
    (``wy.delta_factors``) of one chunk, written into ``s["erase"]`` and ``s["write"]``
    (and committed); ``v`` is read into registers once the inverse is made, by ``v()``."""
    decays, beta = chunk_system(s, k, gates)
    scaled_inputs(s, decays, beta, k, v())
    w = product(k.refs[0].shape, (s["inverse"], s["erase"]))
    u = product(s["write"].refs[0].shape, (s["inverse"], s["write"]))
    store(s["erase"], w)
    store(s["write"], u)
    commit()


def squares(s: dict, number: int) -> list[Pieces]:
    """``number`` ``[C, C]`` operands of as many pieces as ``s["q"]``, carved from the
    scratch of ``chunk_decays`` (``terms``, then ``extra``), free once the decays are made."""
    count = len(s["q"].refs)
    refs = (*s["terms"].refs, *s["extra"].refs)
    return [Pieces(refs[i * count : (i + 1) * count]) for i in range(number)]


def extra_squares(count: int, number: int) -> Pieces:
    """The ``extra`` scratch that ``squares(s, number)`` needs beside ``terms``."""
    return pieces(max(0, number * count - SEGMENT_PIECES), (CHUNK, CHUNK))


def pieces(count: int, shape) -> Pieces:
    """Scratch for an operand of ``count`` pieces, each a swizzled bf16 tile."""
    return Pieces(tuple(smem(shape) for _ in range(count)))


def operand(x, count: int) -> tuple:
    """``x`` (an XLA array) as its ``count`` bf16 pieces (``split``)."""
    if count == 1:
        return (x.astype(BF16),)
    return tuple(split(x.astype(F32), count))


def kernel_call(body, *, name: str, out_type, scratch, grid: dict, interpret):
    """``plgpu.kernel`` of one warpgroup a program over ``grid`` (axis name: size), in Lane
    semantics (explicit layouts: Mosaic GPU's layout inference, its default from jax 0.11,
    found no solution for these kernels)."""
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        grid=tuple(grid.values()),
        grid_names=tuple(grid),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret_params(interpret),
        kernel_name=name,
    )


def interpret_params(interpret):
    """Pallas's ``interpret=`` for the kernels: None runs them compiled on a GPU and in
    Mosaic GPU's interpret mode anywhere else; True and False force one or the other."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return plgpu.InterpretGPUParams() if interpret else None
