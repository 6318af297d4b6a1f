"""The gated delta rule's grads kernel (``impl="mosaic_gpu"``, ``op.py``), a program per
(chunk, value head, value block): from a chunk's start state and end cotangent (``reverse.py``)
and the inverse ``T`` of its system that the forward kept (``factors.py``) it needs nothing
carried. The chunk's decays again, ``U = u - w S^T``, ``dU``, ``dVb = T^T dU`` and every
input's gradient (``chunked/scalar.py``'s
``chunk_grads``, ``chunked/wy.py``'s ``delta_factors_bwd``, ``chunked/decays.py``'s
``chunk_decays_bwd``). The gradients of q, k and the gates sum over a key head's value heads
and over value blocks: a program writes its share, summed after the kernel.

Two warpgroups share a program, as the field's fastest grads kernels do: the keys' side
loads the chunk and makes what needs only q, k and the gates (the decays, ``Q K^T * Gamma``,
``K K^T``) while the values' side makes ``U`` and then ``dU``, ``dVb`` and dv; the square
cotangents follow on the keys' side, and then each side makes dq and dk over half of the key
channels. Barriers pass each product on (``attn_ready``, ``dvb_ready``, ``squares_ready``,
``rows_ready``), each arrived at by ``tiles.hand_over`` once the whole warpgroup has stored
and fenced what the other reads.

Each stage, and each step of a loop, reads its operands through views of its own at a 0
read from HBM (``_views``), and every loop's trip count adds that 0 (``tiles.over_blocks``):
at 255 registers, wgmma descriptors made once and loops of one trip straight-lined into the
kernel had ptxas spill.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gdn_jax.ops.mosaic import tiles
from gdn_jax.ops.mosaic.limits import CHUNK, VALUE_BLOCK
from gdn_jax.ops.mosaic.scalar import chunk as in_chunk
from gdn_jax.ops.mosaic.scalar.factors import system_scratch
from gdn_jax.ops.mosaic.tiles import F32, Pieces


def _views(raw: dict) -> dict:
    """``raw``'s operands (``Pieces`` with a leading axis of one) viewed at index
    ``raw["zero_ref"][0]``, a 0 read from HBM. Each stage and each loop's step reads its
    operands through views of its own, so their wgmma descriptors are made where they are
    used: LLVM can neither hoist them out of a loop nor share them between stages (held in
    registers from one use to the next, they made ptxas spill)."""
    index = raw["zero_ref"][0]
    return {name: x.at(index) if isinstance(x, Pieces) else x for name, x in raw.items()}


def _load_grads_tiles(hbm, s, *, head, group, block, value_block):
    """Copy one chunk's tiles in and wait for them: q, k, dY (value block), gates, start
    state and end-state cotangent (value block), and the inverse ``T`` the forward made."""
    chunk = jax.lax.axis_index("chunk")
    tokens = pl.ds(chunk * CHUNK, CHUNK)
    values = pl.ds(block * value_block, value_block)
    sources = (
        *(ref.at[tokens, head // group] for ref in (*hbm["q"], *hbm["k"])),
        *(ref.at[tokens, head, values] for ref in hbm["d_y"]),
        *(ref.at[chunk, head, values] for ref in (*hbm["starts"], *hbm["d_ends"])),
        *(ref.at[tokens, head] for ref in hbm["inverses"]),
        hbm["gates"].at[:, head, tokens],
    )
    names = ("q", "k", "d_y", "start", "d_end", "inverse")
    dsts = (*(ref for name in names for ref in s[name].refs), s["gates"])
    for src, dst in zip(sources, dsts, strict=True):
        plgpu.copy_gmem_to_smem(src, dst, s["loaded"])
    in_chunk.write_masks(s)
    plgpu.barrier_wait(s["loaded"])


def _corrections(raw, decays, beta, v_hbm) -> None:
    """``U = T (diag(beta) V - diag(beta exp(g)) K S^T)``, the corrections the chunk wrote
    from its start state ``S`` (``u - w S^T`` without forming ``w`` and ``u``), into
    ``write``, 64 value channels at a time. ``v_hbm(first)``: 64 channels of v from HBM."""
    shape = (CHUNK, CHUNK)

    def block(first, carry):
        s = _views(raw)
        write = s["write"].at(slice(None), pl.ds(first, CHUNK))
        read = tiles.product(shape, (s["k"], s["start"].at(pl.ds(first, CHUNK)).T))  # K S^T
        read = read * tiles.by_row(decays.from_start, shape)
        tiles.store(write, (v_hbm(first) - read) * tiles.by_row(beta, shape))
        tiles.commit()
        tiles.store(write, tiles.product(shape, (s["inverse"], write)))
        tiles.commit()
        return carry

    tiles.over_blocks(raw["write"].refs[0].shape[-1], block, 0, raw["zero"])


def _write_tile(s, dst, tile) -> None:
    """A ``[C, 64]`` float32 tile (WGMMA layout) into ``dst`` in HBM, in ``dst``'s dtype,
    after committing the warpgroup's earlier writes to shared memory. A float32 tile is
    stored straight from registers; a narrower one leaves by TMA from ``s["out_tile"]``: a
    warpgroup's store of a bf16 WGMMA tile writes half sectors (16 bytes a row of 4 lanes),
    which jax >= 0.12's Mosaic GPU refuses to plan."""
    if dst.dtype == F32:
        tiles.commit()
        dst[...] = tile
        return
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous copy has read the tile
    s["out_tile"][...] = tile.astype(dst.dtype)
    tiles.copy_out((s["out_tile"], dst))


def _value_grads(raw, out, decays, beta, index, v_hbm):
    """``dU`` and ``dVb = T^T dU``, 64 value channels at a time: writes dv, leaves ``dVb``
    in ``du`` and returns the share of d beta from the writes, ``rowsum(dVb * V)``.
    ``attn``: ``Q K^T * Gamma`` in shared memory (committed before its first product)."""
    shape = (CHUNK, CHUNK)
    tokens, head, value_start = index

    def block(first, d_beta):
        s = _views(raw)
        attn = s["attn"]
        values = (slice(None), pl.ds(first, CHUNK))
        du, d_y = s["du"].at(*values), s["d_y"].at(*values)
        d_end = s["d_end"].at(pl.ds(first, CHUNK))
        d_u = tiles.by_row(decays.to_end, shape) * tiles.product(shape, (s["k"], d_end.T))
        tiles.store(du, d_u + tiles.product(shape, (attn.T, d_y)))
        tiles.commit()
        d_write = tiles.product(shape, (s["inverse"].T, du))
        d_beta = d_beta + jnp.sum(d_write * v_hbm(first), axis=1)
        tiles.store(du, d_write)
        d_v = out["d_v"].at[tokens, head, pl.ds(value_start + first, CHUNK)]
        _write_tile(s, d_v, d_write * tiles.by_row(beta, shape))
        return d_beta

    return tiles.over_blocks(raw["du"].refs[0].shape[-1], block, beta * 0.0, raw["zero"])


def _square_grads(raw, gram):
    """The ``[C, C]`` cotangents: of ``Q K^T * Gamma`` (into ``sq_attn``), of ``k k^T``
    (into ``sq_gram``) and of the decays within the chunk times them (into ``sq_within``).
    Returns the chunk's decays, made again here rather than kept in registers since the
    attention, and the share of d beta from the system, ``rowsum(dA * Gamma * K K^T)``.
    ``gram``: ``K K^T``, made while the values' side worked."""
    shape = (CHUNK, CHUNK)
    s = _views(raw)
    gates = s["gates"]
    decays = in_chunk.chunk_decays(gates, s)
    within = decays.within
    d_attn = tiles.product(shape, (s["d_y"], s["write"].T)) * within  # dY U^T
    tiles.store(s["sq_attn"], d_attn)
    d_within = d_attn * tiles.product(shape, (s["q"], s["k"].T))
    rows, cols = tiles.iotas(shape)
    d_strict = jnp.where(rows > cols, -tiles.product(shape, (s["du"], s["write"].T)), 0.0)
    d_strict = d_strict * within  # dVb U^T, below the diagonal, times the decays
    d_beta = jnp.sum(d_strict * gram, axis=1)
    beta = tiles.by_row(plgpu.load(gates.at[1], layout=tiles.ROWS), shape)
    tiles.store(s["sq_gram"], d_strict * beta)
    tiles.store(s["sq_within"], d_within + d_strict * beta * gram)
    return decays, d_beta  # the caller hands the tiles over (commits)


def _key_grads(raw, out, decays, beta, index, channels):
    """dq and dk (this program's shares) of the key channels ``channels = (first, end)``,
    64 at a time in two loops (a ``[C, K]`` float32 tile is a quarter of a thread's
    registers at K = 128; ``over_blocks``); returns the rows' ``(d from_start, d to_end, d
    k_proj)`` cotangents over those channels: ``rowsum(dY S * Q)``, ``rowsum(U dS' * K)``
    and ``rowsum(dw_k * K)`` with ``dw_k = -dVb S``."""
    tokens, head, _ = index
    shape = (CHUNK, CHUNK)
    first, end = channels

    def query_block(first, d_from_start):
        s = _views(raw)
        keys = (slice(None), pl.ds(first, CHUNK))
        q, k, start = (s[name].at(*keys) for name in ("q", "k", "start"))
        d_y_start = tiles.product(shape, (s["d_y"], start))
        d_from_start = d_from_start + jnp.sum(d_y_start * tiles.load(q), axis=1)
        d_q = d_y_start * tiles.by_row(decays.from_start, shape)
        d_q = d_q + tiles.product(shape, (s["sq_attn"], k))
        _write_tile(s, out["d_q"].at[tokens, head, keys[1]], d_q)
        return d_from_start

    def key_block(first, sums):
        s = _views(raw)
        keys = (slice(None), pl.ds(first, CHUNK))
        q, k, start, d_end = (s[name].at(*keys) for name in ("q", "k", "start", "d_end"))
        gram = s["sq_gram"]
        d_k = tiles.product(shape, (s["sq_attn"].T, q), (gram, k), (gram.T, k))
        d_erase = -tiles.product(shape, (s["du"], start))
        d_k_proj = jnp.sum(d_erase * tiles.load(k), axis=1)
        d_k = d_k + d_erase * tiles.by_row(beta * decays.from_start, shape)
        d_k_to_end = tiles.product(shape, (s["write"], d_end))  # U dS'
        d_to_end = jnp.sum(d_k_to_end * tiles.load(k), axis=1)
        d_k = d_k + d_k_to_end * tiles.by_row(decays.to_end, shape)
        _write_tile(s, out["d_k"].at[tokens, head, keys[1]], d_k)
        return sums[0] + d_to_end, sums[1] + d_k_proj

    zero = beta * 0.0
    if first == end:  # K = 64: the keys' side takes the one block
        return zero, zero, zero
    d_from_start = tiles.over_blocks(end, query_block, zero, raw["zero"], start=first)
    sums = tiles.over_blocks(end, key_block, (zero, zero), raw["zero"], start=first)
    d_to_end, d_k_proj = sums
    return d_from_start, d_to_end, d_k_proj


def _whole_grad(raw):
    """``sum(dS' * S)``, the cotangent of the chunk's whole decay times it, 64 rows of the
    state at a time: a COLS vector, every entry the sum."""
    shape = (CHUNK, CHUNK)

    def rows_of(i, total):
        s = _views(raw)
        rows = pl.ds(pl.multiple_of(i * CHUNK, CHUNK), CHUNK)
        product = tiles.load(s["d_end"].at(rows)) * tiles.load(s["start"].at(rows))
        return total + jnp.sum(tiles.by_row(jnp.sum(product, axis=1), shape), axis=0)

    blocks = (jnp.int32(0), raw["start"].refs[0].shape[-2] // CHUNK + raw["zero"])
    zero = plgpu.load(_views(raw)["gates"].at[4], layout=tiles.COLS) * 0.0
    return jax.lax.fori_loop(*blocks, rows_of, zero)


def _gate_grads(raw, decays, d_from_start, d_to_end, d_whole):
    """``decays.chunk_decays_bwd`` for the chunk's ``log_alpha`` (COLS): each gate's terms
    summed over the segments that hold it. ``sq_within`` holds the cotangent of the decays
    within the chunk times them; ``ones`` the mask of ``t >= i``; ``d_whole``:
    ``_whole_grad``'s."""
    shape = (CHUNK, CHUNK)
    s = _views(raw)
    # [t, s]: the sum over i < s of row t, a product with the mask's transpose less the
    # term at s (no strict mask in shared memory: the kernel has no room for it).
    rows_before = tiles.product(shape, (s["sq_within"], s["ones"].T)) - tiles.load(s["sq_within"])
    held = rows_before + tiles.by_row(d_from_start * decays.from_start, shape)
    lower = tiles.load(s["ones"])  # (t >= s)
    d_log_alpha = jnp.sum(held * lower, axis=0)
    to_end = tiles.by_row(d_to_end * decays.to_end, shape)
    d_log_alpha = d_log_alpha + jnp.sum(to_end - to_end * lower, axis=0)
    return d_log_alpha + d_whole * plgpu.load(s["gates"].at[4], layout=tiles.COLS)


KEYS, VALUES = 0, 1  # the warpgroups: their sides of the chunk's work


def _keys_side(raw, hbm, out, index, channels, block) -> None:
    """Warpgroup ``KEYS``: loads the chunk, makes its decays and ``Q K^T * Gamma`` for the
    values' side, then the square cotangents, dq and dk over ``channels`` and, once the
    values' side has left its row sums in ``rows``, the gates' gradients."""
    tokens, head, _ = index
    s = _views(raw)
    value_block = s["d_y"].refs[0].shape[-1]
    _load_grads_tiles(hbm, s, head=head, group=raw["group"], block=block, value_block=value_block)
    shape = (CHUNK, CHUNK)
    decays = in_chunk.chunk_decays(s["gates"], s)
    tiles.store(s["attn"], tiles.product(shape, (s["q"], s["k"].T)) * decays.within)
    tiles.hand_over(raw["attn_ready"])
    s = _views(raw)
    gram = tiles.product(shape, (s["k"], s["k"].T))
    plgpu.barrier_wait(raw["dvb_ready"])
    decays, d_beta_system = _square_grads(raw, gram)
    tiles.hand_over(raw["squares_ready"])
    beta = plgpu.load(s["gates"].at[1], layout=tiles.ROWS)
    keys = dict(raw, out_tile=raw.get("out_keys"))
    d_from_start, d_to_end, d_k_proj = _key_grads(keys, out, decays, beta, index, channels)
    plgpu.barrier_wait(raw["rows_ready"])
    d_beta, *theirs = (plgpu.load(raw["rows"].at[i], layout=tiles.ROWS) for i in range(4))
    d_from_start, d_to_end, d_k_proj = (
        mine + other for mine, other in zip((d_from_start, d_to_end, d_k_proj), theirs, strict=True)
    )
    d_whole = plgpu.load(raw["rows"].at[4], layout=tiles.COLS)
    d_log_alpha = _gate_grads(raw, decays, d_from_start + beta * d_k_proj, d_to_end, d_whole)
    d_beta = d_beta + d_beta_system + decays.from_start * d_k_proj
    out["d_gates"].at[0, head, tokens][...] = d_log_alpha
    out["d_gates"].at[1, head, tokens][...] = d_beta
    plgpu.wait_smem_to_gmem(0)


def _values_side(raw, hbm, out, index, channels, block) -> None:
    """Warpgroup ``VALUES``: ``U``, then (once the keys' side has the attention) ``dU``,
    ``dVb`` and dv; ``_whole_grad``; then dq and dk over ``channels``, leaving its sums in
    ``rows``."""
    tokens, head, value_start = index
    plgpu.barrier_wait(raw["loaded"])
    s = _views(raw)
    decays = in_chunk.chunk_vectors(s["gates"])
    beta = plgpu.load(s["gates"].at[1], layout=tiles.ROWS)

    def v_hbm(first):  # v is read twice, straight from HBM: a tile of it would not fit
        values = pl.ds(value_start + first, CHUNK)
        return tiles.load_global([ref.at[tokens, head, values] for ref in hbm["v"]])

    _corrections(raw, decays, beta, v_hbm)
    plgpu.barrier_wait(raw["attn_ready"])
    d_beta = _value_grads(raw, out, decays, beta, index, v_hbm)
    tiles.hand_over(raw["dvb_ready"])  # dVb and U, read by the keys' side's products
    d_whole = _whole_grad(raw)  # while the keys' side makes the square cotangents
    plgpu.barrier_wait(raw["squares_ready"])
    sums = _key_grads(raw, out, decays, beta, index, channels)
    for i, row in enumerate((d_beta, *sums, d_whole)):
        raw["rows"].at[i][...] = row
    tiles.hand_over(raw["rows_ready"])
    plgpu.wait_smem_to_gmem(0)


def _grads_kernel(*refs, group: int, **s):
    """One chunk, value head and value block: every input's gradient (shares of those of
    q, k and the gates), by two warpgroups (``_keys_side``, ``_values_side``)."""
    inputs = ("q", "k", "v", "d_y", "gates", "starts", "d_ends", "inverses", "zero")
    names = (*inputs, "d_q", "d_k", "d_v", "d_gates")
    hbm = dict(zip(names, refs, strict=True))
    # Free once the inverse is read: its scratch holds the square cotangents.
    raw = dict(s, sq_gram=s["off"], sq_within=s["half"], sq_attn=s["inverse"], group=group)
    raw["attn"] = Pieces(s["terms"].refs[: len(s["q"].refs)])  # once the segment sums are done
    out = {name: hbm.pop(name) for name in names[len(inputs) :]}
    raw["zero_ref"] = hbm.pop("zero")
    raw["zero"] = raw["zero_ref"][0]  # a 0 the compiler cannot see: loops of one trip stay loops
    chunk, head, block = (jax.lax.axis_index(axis) for axis in ("chunk", "head", "block"))
    value_block = s["d_y"].refs[0].shape[-1]
    index = (pl.ds(chunk * CHUNK, CHUNK), head, block * value_block)
    shares = dict(d_q=out["d_q"].at[block], d_k=out["d_k"].at[block], d_v=out["d_v"],
                  d_gates=out["d_gates"].at[block])  # fmt: skip
    key_dim = s["q"].refs[0].shape[-1]
    keys_share, values_share = tiles.key_shares(key_dim)  # the keys' side takes an odd block
    side = jax.lax.axis_index(tiles.WARPGROUP)
    args = (raw, hbm, shares, index)
    pl.when(side == KEYS)(lambda: _keys_side(*args, keys_share, block))
    pl.when(side == VALUES)(lambda: _values_side(*args, values_share, block))
    tiles.finish_together(s["done"])


def _out_tiles(d_v_dtype, d_key_dtype) -> dict:
    """The tiles of the TMA stores of outputs narrower than float32 (``_write_tile``): the
    values' side's (dv, and its share of dq and dk), the keys' side's (its share of dq and
    dk). Float32 outputs leave from registers and need none: the widest kernels have no
    shared memory for them."""
    out = {}
    if d_v_dtype != F32:
        out["out_tile"] = tiles.smem((CHUNK, CHUNK), d_v_dtype)
    if d_key_dtype != F32:
        out["out_keys"] = tiles.smem((CHUNK, CHUNK), d_key_dtype)
    return out


def grads(q, k, v, d_y, gates, starts, d_ends, inverses, *, dtypes=(F32, F32), interpret):
    """Every chunk's gradients from its start state and end-state cotangent (pieces
    ``[chunks, HV, V, K]``) and the inverse of its system (``factors``' T, pieces
    ``[tokens, HV, C]``): returns ``(d_q, d_k [blocks, tokens, HV, K], d_v [tokens, HV,
    V], d_gates [blocks, 2, HV, tokens])``, the shares of each value head and block of value
    channels (a whole value head of up to 128 with bf16 operands); ``d_v``, which no two
    programs share, in ``dtypes[1]`` (v's own: the op returns it so). The shares of d_q and
    d_k are float32, or in ``dtypes[0]`` (q's and k's) where no two programs share them
    (one value head a key head, one value block) and the kernel can write that dtype: the
    op then returns them as they are, no float32 copy of either."""
    count = len(q)
    tokens, heads, key_dim = q[0].shape
    v_heads, value_dim = v[0].shape[1:]
    value_block = value_dim if count == 1 and value_dim <= 128 else VALUE_BLOCK
    blocks = value_dim // value_block
    d_key_dtype, d_v_dtype = dtypes
    if blocks > 1 or v_heads > heads or d_key_dtype not in (F32, d_v_dtype):
        d_key_dtype = F32
    state = (value_block, key_dim)
    scratch = dict(
        q=tiles.pieces(count, (CHUNK, key_dim)),
        k=tiles.pieces(count, (CHUNK, key_dim)),
        d_y=tiles.pieces(count, (CHUNK, value_block)),
        start=tiles.pieces(count, state),
        d_end=tiles.pieces(count, state),
        gates=plgpu.SMEM((in_chunk.GATES, CHUNK), F32),
        du=tiles.pieces(count, (CHUNK, value_block)),
        loaded=plgpu.Barrier(num_arrivals=6 * count + 1),
        write=tiles.pieces(count, (CHUNK, value_block)),
        rows=plgpu.SMEM((5, CHUNK), F32),  # the values' side's sums, for the gates
        **{name: plgpu.Barrier() for name in ("attn_ready", "dvb_ready", "squares_ready")},
        rows_ready=plgpu.Barrier(),
        done=plgpu.Barrier(num_arrivals=2),
        **_out_tiles(d_v_dtype, d_key_dtype),
        **system_scratch(count),
    )
    scratch = {  # a leading axis of one, for _views
        name: tiles.pieces(len(x.refs), (1, *x.refs[0].shape)) if isinstance(x, Pieces) else x
        for name, x in scratch.items()
    }
    key_share = jax.ShapeDtypeStruct((blocks, tokens, v_heads, key_dim), d_key_dtype)
    out_type = (
        key_share,
        key_share,
        jax.ShapeDtypeStruct((tokens, v_heads, value_dim), d_v_dtype),
        jax.ShapeDtypeStruct((blocks, 2, v_heads, tokens), F32),
    )
    call = tiles.kernel_call(
        functools.partial(_grads_kernel, group=v_heads // heads),
        name="gdn_mosaic_grads",
        out_type=out_type,
        scratch=scratch,
        grid=dict(block=blocks, head=v_heads, chunk=tokens // CHUNK),
        interpret=interpret,
        warpgroups=2,
    )
    inputs = (tuple(q), tuple(k), tuple(v), tuple(d_y), gates, tuple(starts), tuple(d_ends))
    return call(*inputs, tuple(inverses), jnp.zeros((1,), jnp.int32))
