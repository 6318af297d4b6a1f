"""The chunked gated delta rule as Mosaic GPU kernels for Hopper (``impl="mosaic"``).

Two kernels make the forward, in the shape of the field's fast kernels:

1. ``factors`` over every chunk and value head at once (grid ``(chunks, HV)``): the chunk's
   decays, ``K K^T``, the inverse ``T`` of the intra-chunk system ``I + A`` (``A =
   tril(diag(beta) (K K^T * Gamma), -1)``) by doubling blocks on the tensor cores, and the
   WY factors ``w = T diag(beta exp(g)) K``, ``u = T diag(beta) V`` (``wy.py``), written to
   HBM in the operands' precision.
2. ``states`` over (sequence, value head, block of value channels): one program walks its
   sequence's chunks in order with its block of the float32 state ``S [Vb, K]`` in registers
   from the first chunk to the last, streams each chunk's tiles in with TMA (the next
   chunk's while it computes this one), and per chunk forms ``U = u - w S^T``, the outputs
   ``Y = diag(exp(g)) Q S^T + (Q K^T * Gamma) U`` and ``S' = exp(g_C) S + U^T diag(exp(g_C
   - g)) K``, writing ``Y`` and, when the backward needs them, the chunk's start state.

Both run one warpgroup a program; every product is a wgmma with bf16 operands and float32
accumulation (``mosaic_chunk.py``: float32 inputs as two bf16 pieces each). The backward is
``chunked.py``'s hand-derived one in XLA, from the chunk start states the forward kernel
wrote (``mosaic_backward.py``).

The inputs are laid out in XLA first (``_layout``): the chunks of every sequence in one token
axis (a batch row's tail chunk and packed sequences padded with inert tokens, as
``varlen.py`` does), key and value channels padded with zeros to multiples of 64, the gates
as ``[2, HV, tokens]`` so that a chunk's gates are one TMA box, and a table of each
sequence's first chunk and chunk count.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gdn_jax.ops import mosaic_backward
from gdn_jax.ops import mosaic_chunk as mc
from gdn_jax.ops.decays import LOG_ALPHA_FLOOR
from gdn_jax.ops.mosaic_chunk import CHUNK, F32, Pieces
from gdn_jax.ops.mosaic_layout import token_layout

LANE = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)
# The value channels of one program of the state pass: a wgmma's 64 rows of the state.
VALUE_BLOCK = 64


def interpret_params(interpret):
    """Pallas's ``interpret=`` for the kernels: None runs them compiled on a GPU and in
    Mosaic GPU's interpret mode anywhere else; True and False force one or the other."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return plgpu.InterpretGPUParams() if interpret else None


def _factors_kernel(k_hbm, v_hbm, gates_hbm, w_hbm, u_hbm, *, group: int, **scratch):
    """One chunk of one value head: its WY factors ``w [C, K]`` and ``u [C, V]``.

    HBM refs: ``k`` pieces ``[tokens, H, K]``, ``v`` pieces ``[tokens, HV, V]``, ``gates
    [2, HV, tokens]`` (``log_alpha``, ``beta``); out ``w`` pieces ``[tokens, HV, K]``, ``u``
    pieces ``[tokens, HV, V]``.
    """
    s = scratch
    chunk, head = jax.lax.axis_index("chunk"), jax.lax.axis_index("head")
    tokens = pl.ds(chunk * CHUNK, CHUNK)
    k_in = [ref.at[tokens, head // group] for ref in k_hbm]
    v_in = [ref.at[tokens, head] for ref in v_hbm]
    for src, dst in zip((*k_in, *v_in), (*s["k"].refs, *s["v"].refs), strict=True):
        plgpu.copy_gmem_to_smem(src, dst, s["loaded"])
    plgpu.copy_gmem_to_smem(gates_hbm.at[:, head, tokens], s["gates"], s["loaded"])
    plgpu.barrier_wait(s["loaded"])

    decays = mc.chunk_decays(s["gates"].at[0], s["terms"], s["ones"])
    beta = plgpu.load(s["gates"].at[1], layout=mc.ROWS)
    shape = (CHUNK, CHUNK)
    rows, cols = mc.iotas(shape)
    gram = mc.product(shape, (s["k"], s["k"].T))
    strict = jnp.where(rows > cols, mc.by_row(beta, shape) * gram * decays.within, 0.0)
    inverse = mc.unit_lower_inverse(strict, s["off"], s["inverse"], s["half"])

    k, v = mc.load(s["k"]), mc.load(s["v"])
    mc.store(s["erase"], k * mc.by_row(beta * decays.from_start, k.shape))
    mc.store(s["write"], v * mc.by_row(beta, v.shape))
    mc.store(s["inverse"], inverse)
    mc.commit()
    w = mc.product(k.shape, (s["inverse"], s["erase"]))
    u = mc.product(v.shape, (s["inverse"], s["write"]))
    mc.store(s["erase"], w)
    mc.store(s["write"], u)
    mc.commit()
    for src, dst in zip(s["erase"].refs, w_hbm, strict=True):
        plgpu.copy_smem_to_gmem(src, dst.at[tokens, head])
    for src, dst in zip(s["write"].refs, u_hbm, strict=True):
        plgpu.copy_smem_to_gmem(src, dst.at[tokens, head])
    plgpu.wait_smem_to_gmem(0)


def _pieces(count: int, shape) -> Pieces:
    return Pieces(tuple(mc.smem(shape) for _ in range(count)))


def factors(k, v, gates, *, interpret=None):
    """The WY factors of every chunk: ``k`` pieces ``[tokens, H, K]``, ``v`` pieces
    ``[tokens, HV, V]``, ``gates [2, HV, tokens]`` (float32; ``tokens`` a multiple of the
    chunk, ``K`` and ``V`` of 64). Returns ``(w, u)``, pieces like ``k`` and ``v`` per value
    head."""
    count = len(k)
    tokens, heads, key_dim = k[0].shape
    v_heads, value_dim = v[0].shape[1:]
    square = (CHUNK, CHUNK)
    scratch = dict(
        k=_pieces(count, (CHUNK, key_dim)),
        v=_pieces(count, (CHUNK, value_dim)),
        gates=plgpu.SMEM((2, CHUNK), F32),
        terms=_pieces(mc.SEGMENT_PIECES, square),
        ones=_pieces(1, square),
        off=_pieces(count, square),
        inverse=_pieces(count, square),
        half=_pieces(count, square),
        erase=_pieces(count, (CHUNK, key_dim)),
        write=_pieces(count, (CHUNK, value_dim)),
        loaded=plgpu.Barrier(num_arrivals=2 * count + 1),
    )
    out_type = (
        tuple(jax.ShapeDtypeStruct((tokens, v_heads, key_dim), mc.BF16) for _ in range(count)),
        tuple(jax.ShapeDtypeStruct((tokens, v_heads, value_dim), mc.BF16) for _ in range(count)),
    )
    call = plgpu.kernel(
        functools.partial(_factors_kernel, group=v_heads // heads),
        out_type=out_type,
        scratch_types=scratch,
        grid=(tokens // CHUNK, v_heads),
        grid_names=("chunk", "head"),
        compiler_params=LANE,
        interpret=interpret_params(interpret),
        kernel_name="gdn_mosaic_factors",
    )
    return call(tuple(k), tuple(v), gates)


def _fetch(hbm, s, chunk, slot, *, head, group, block):
    """Start the TMA copies of one chunk's tiles into ``slot``: q, k (key head), w, the
    value block of u, and the gates."""
    tokens = pl.ds(chunk * CHUNK, CHUNK)
    values = pl.ds(block * s["u"].refs[0].shape[-1], s["u"].refs[0].shape[-1])
    sources = (
        *(ref.at[tokens, head // group] for ref in (*hbm["q"], *hbm["k"])),
        *(ref.at[tokens, head] for ref in hbm["w"]),
        *(ref.at[tokens, head, values] for ref in hbm["u"]),
        hbm["gates"].at[:, head, tokens],
    )
    tiles = (*s["q"].refs, *s["k"].refs, *s["w"].refs, *s["u"].refs, s["gates"])
    for src, dst in zip(sources, tiles, strict=True):
        plgpu.copy_gmem_to_smem(src, dst.at[slot], s["loaded"].at[slot])


def _chunk_step(state, hbm, out, s, chunk, slot, *, head, block):
    """One chunk of the state pass on tiles already in ``slot``: writes the chunk's outputs
    (and start state, where ``out["starts"]`` is there) and returns the state after it."""
    q, k, w, u = (s[name].at(slot) for name in ("q", "k", "w", "u"))
    decays = mc.chunk_decays(s["gates"].at[slot, 0], s["terms"], s["ones"])
    value_block, key_dim = state.shape
    values = pl.ds(block * value_block, value_block)
    # The state's operand: every wgmma below reads it, and the backward its start state.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    mc.store(s["state"], state)
    mc.commit()
    if "starts" in out:
        for src, dst in zip(s["state"].refs, out["starts"], strict=True):
            plgpu.copy_smem_to_gmem(src, dst.at[chunk, head, values])
    shape = (CHUNK, value_block)
    corrections = mc.load(u) - mc.product(shape, (w, s["state"].T))
    y_start = mc.product(shape, (q, s["state"].T))
    scores = mc.product((CHUNK, CHUNK), (q, k.T)) * decays.within
    attn, corr = Pieces(s["terms"].refs[:1]), Pieces(s["terms"].refs[1:2])
    if len(q.refs) > 1:  # float32 operands: two pieces each
        attn, corr = Pieces(s["terms"].refs[:2]), Pieces((s["terms"].refs[2], s["extra"]))
    mc.store(attn, scores)
    mc.store(corr, corrections)
    k_to_end = mc.load(k) * mc.by_row(decays.to_end, (CHUNK, key_dim))
    mc.store(k, k_to_end)  # k's tile is read no more this chunk
    mc.commit()
    y = mc.by_row(decays.from_start, shape) * y_start + mc.product(shape, (attn, corr))
    s["y"][...] = y
    mc.commit()
    tokens = pl.ds(chunk * CHUNK, CHUNK)
    plgpu.copy_smem_to_gmem(s["y"], out["y"].at[tokens, head, values])
    faded = mc.by_row(decays.whole, state.shape) * state
    return faded + mc.product(state.shape, (corr.T, k))


def _states_kernel(table, *refs, group: int, keep_starts: bool, **s):
    """One sequence, value head and block of value channels over the sequence's chunks.

    HBM refs: ``table [N, 2]`` (each sequence's first chunk and chunk count), q, k pieces
    ``[tokens, H, K]``, w pieces ``[tokens, HV, K]``, u pieces ``[tokens, HV, V]``, ``gates
    [2, HV, tokens]``, ``h0 [N, HV, V, K]``; out ``y [tokens, HV, V]``, ``finals [N, HV, V,
    K]`` and, with ``keep_starts``, the start state of every chunk as pieces ``[chunks, HV,
    V, K]``.
    """
    names = ("q", "k", "w", "u", "gates", "h0", "y", "finals", "starts")
    hbm = dict(zip(names, refs, strict=False))
    out = {name: hbm.pop(name) for name in names[6:] if name in hbm}
    h0 = hbm.pop("h0")
    seq, head, block = (jax.lax.axis_index(axis) for axis in ("seq", "head", "block"))
    first, count = table[seq, 0], table[seq, 1]
    value_block = s["u"].refs[0].shape[-1]
    values = pl.ds(block * value_block, value_block)
    fetch = functools.partial(_fetch, hbm, s, head=head, group=group, block=block)
    slots = s["u"].refs[0].shape[0]

    @pl.when(count > 0)
    def _():
        fetch(first, 0)

    def step(i, state):
        slot = jax.lax.rem(i, jnp.int32(slots))
        if slots > 1:  # the next chunk's tiles stream in while this one computes

            @pl.when(i + 1 < count)
            def _():
                fetch(first + i + 1, 1 - slot)

        plgpu.barrier_wait(s["loaded"].at[slot])
        new_state = _chunk_step(state, hbm, out, s, first + i, slot, head=head, block=block)
        if slots == 1:

            @pl.when(i + 1 < count)
            def _():
                fetch(first + i + 1, 0)

        return new_state

    initial = plgpu.load(h0.at[seq, head, values], layout=mc.WGMMA, optimized=False)
    final = jax.lax.fori_loop(0, count, step, initial)
    out["finals"].at[seq, head, values][...] = final
    plgpu.wait_smem_to_gmem(0)


def states(table, q, k, w, u, gates, h0, *, keep_starts: bool, interpret=None):
    """The state pass with the outputs: ``table [N, 2]`` int32, q, k pieces ``[tokens, H,
    K]``, w pieces ``[tokens, HV, K]``, u pieces ``[tokens, HV, V]``, ``gates [2, HV,
    tokens]``, ``h0 [N, HV, V, K]`` float32. Returns ``(y [tokens, HV, V], finals [N, HV,
    V, K])`` in float32, and with ``keep_starts`` each chunk's start state as the bf16
    pieces that its products read, ``[chunks, HV, V, K]`` each."""
    count = len(q)
    tokens, heads, key_dim = q[0].shape
    v_heads, value_dim = u[0].shape[1:]
    num_seqs = h0.shape[0]
    value_block = VALUE_BLOCK
    slots = 2 if count == 1 else 1  # two pieces a tile leave no room for a second slot
    square = (CHUNK, CHUNK)
    tile = (slots, CHUNK, key_dim)
    scratch = dict(
        q=_pieces(count, tile),
        k=_pieces(count, tile),
        w=_pieces(count, tile),
        u=_pieces(count, (slots, CHUNK, value_block)),
        gates=plgpu.SMEM((slots, 2, CHUNK), F32),
        terms=_pieces(mc.SEGMENT_PIECES, square),
        ones=_pieces(1, square),
        extra=mc.smem(square),
        state=_pieces(count, (value_block, key_dim)),
        y=mc.smem((CHUNK, value_block), F32),
        loaded=plgpu.Barrier(num_arrivals=4 * count + 1, num_barriers=slots),
    )
    state_type = jax.ShapeDtypeStruct(h0.shape, F32)
    out_type = [jax.ShapeDtypeStruct((tokens, v_heads, value_dim), F32), state_type]
    if keep_starts:
        shape = (tokens // CHUNK, v_heads, value_dim, key_dim)
        out_type.append(tuple(jax.ShapeDtypeStruct(shape, mc.BF16) for _ in range(count)))
    call = plgpu.kernel(
        functools.partial(_states_kernel, group=v_heads // heads, keep_starts=keep_starts),
        out_type=tuple(out_type),
        scratch_types=scratch,
        grid=(num_seqs, v_heads, value_dim // value_block),
        grid_names=("seq", "head", "block"),
        compiler_params=LANE,
        interpret=interpret_params(interpret),
        kernel_name="gdn_mosaic_states",
    )
    return call(table, tuple(q), tuple(k), tuple(w), tuple(u), gates, h0)


def _padded(x, axis: int):
    """``x`` with zero channels along ``axis`` up to a multiple of 64 (a wgmma operand's
    128-byte swizzle of bf16); the zeros reach no other channel in any product."""
    pad = -x.shape[axis] % 64
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _operand(x, count: int) -> tuple:
    """``x`` as its ``count`` bf16 pieces (``mosaic_chunk.split``)."""
    if count == 1:
        return (x.astype(mc.BF16),)
    return tuple(mc.split(x.astype(F32), count))


def kernel_forward(q, k, v, log_alpha, beta, initial_states, table, *, keep_starts, interpret):
    """Both kernels on the token layout: q, k ``[tokens, H, K]``, v ``[tokens, HV, V]`` in
    their dtype, gates ``[tokens, HV]`` and ``initial_states [N, HV, V, K]`` float32.
    Operands are one bf16 piece each when v is bf16, else two. Returns ``(y [tokens, HV,
    V], finals [N, HV, V, K], starts)``, ``starts`` the pieces of every chunk's start state
    (``[chunks, HV, V, K]`` each) or None."""
    key_dim, value_dim = q.shape[-1], v.shape[-1]
    count = 1 if v.dtype == mc.BF16 else 2
    q, k = (_operand(_padded(x, 2), count) for x in (q, k))
    v = _operand(_padded(v, 2), count)
    gates = jnp.stack([log_alpha.T, beta.T]).astype(F32)
    h0 = _padded(_padded(initial_states, 3), 2)
    w, u = factors(k, v, gates, interpret=interpret)
    y, finals, *starts = states(
        table, q, k, w, u, gates, h0, keep_starts=keep_starts, interpret=interpret
    )
    trim = (..., slice(0, value_dim), slice(0, key_dim))
    starts = tuple(x[trim] for x in starts[0]) if keep_starts else None
    return y[..., :value_dim], finals[trim], starts


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _core(q, k, v, log_alpha, beta, initial_states, table, resets, interpret):
    y, finals, _ = kernel_forward(
        q, k, v, log_alpha, beta, initial_states, table, keep_starts=False, interpret=interpret
    )
    return y, finals


def _core_fwd(q, k, v, log_alpha, beta, initial_states, table, resets, interpret):
    y, finals, starts = kernel_forward(
        q, k, v, log_alpha, beta, initial_states, table, keep_starts=True, interpret=interpret
    )
    return (y, finals), ((q, k, v, log_alpha, beta), starts, table, resets)


def _core_bwd(interpret, residuals, cotangents):
    inputs, starts, table, resets = residuals
    d_y, d_finals = cotangents
    starts = sum(x.astype(F32) for x in starts)
    grads = mosaic_backward.xla_backward(inputs, starts, resets, d_y, d_finals)
    return (*grads, None, None)


_core.defvjp(_core_fwd, _core_bwd)


def gated_delta_rule_mosaic(
    q, k, v, gates, initial_states, cu_seqlens, *, chunk_size: int, interpret=None
):
    """The batched chunked gated delta rule by the Mosaic GPU kernels: the prepared inputs
    of ``api.prepare_batched`` (q, k ``[B, T, H, K]`` unscaled, v ``[B, T, HV, V]``, ``gates
    = (log_alpha, beta) [B, T, HV]``, ``initial_states [B or N, HV, V, K]`` float32,
    ``cu_seqlens`` None or ``[N + 1]`` with ``B == 1``). Returns ``(o [B, T, HV, V],
    finals)`` in float32, ``o`` unscaled. ``chunk_size`` must be the kernels' 64 (a wgmma's
    rows); ``interpret`` as ``interpret_params``. Differentiable in reverse mode."""
    if chunk_size != CHUNK:
        raise ValueError(
            f'gated_delta_rule: impl="mosaic" runs chunks of {CHUNK} tokens (a wgmma\'s '
            f"rows), got chunk_size={chunk_size}"
        )
    compute = initial_states.dtype
    if compute != F32:
        raise ValueError(
            f'gated_delta_rule: impl="mosaic" computes in float32, got inputs whose '
            f"compute dtype is {compute}"
        )
    batch, seq_len = q.shape[:2]
    if batch * seq_len == 0:  # no tokens: every sequence ends as it started
        return jnp.zeros((*v.shape[:3], v.shape[3]), compute), initial_states
    log_alpha, beta = (x.astype(compute) for x in gates)
    log_alpha = jnp.maximum(log_alpha, LOG_ALPHA_FLOOR)
    layout = token_layout(batch, seq_len, CHUNK, cu_seqlens)
    inputs = (layout.to_tokens(x) for x in (q, k, v, log_alpha, beta))
    y, finals = _core(*inputs, initial_states, layout.table, layout.resets, interpret)
    return layout.from_tokens(y), finals
