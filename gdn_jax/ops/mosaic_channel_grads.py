"""The grads kernels of the channel-gated backward (``mosaic_channel_backward.py``).

``grads``, a program per (chunk, value head, block of 64 value channels), from the chunk's
inputs, its scores ``M`` (the forward's factors), its start state ``S`` and end-state
cotangent ``dS'`` (those of its value block) and dY: the chunk's system ``A`` again
(``mosaic_channel_chunk.channel_scores``), ``T = (I + A)^{-1}``, the decays, then, with ``U =
T (X - (E * exp(G)) S^T)`` and ``dU = M^T dY + (K * exp(G_C - G)) dS'^T``
(``channel_chunked.py``'s backward)::

    dX = T^T dU,  dM = dY U^T,  dA = -dX U^T,
    d(Q * exp(G)) = dY S,  d(E * exp(G)) = -dX S,  d(K * exp(G_C - G)) = U dS'.

It writes ``dX``, ``dM`` and ``dA`` and the terms of the chunk's decays and of ``M``'s
diagonal in every gradient: the decays' cotangents back to the gates by products with the
transposed masks of their sums (``exp(G) = exp(B_P g)``: ``dg = B_P^T dP``, and ``exp(G_C)``
is the last row of ``exp(G)``). The levels of the scores go back in ``mosaic_channel_levels``.

Every term is linear in the cotangents, so a program writes its value block's share; the op
sums the shares (and a key head's value heads) in XLA. A program's ``[C, 64]`` results leave
for HBM as soon as they are made, one block of 64 key channels at a time.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from gdn_jax.ops import mosaic_channel_chunk as mcc
from gdn_jax.ops import mosaic_chunk as mc
from gdn_jax.ops.mosaic_chunk import CHUNK, F32, Pieces

VALUE_BLOCK = 64
SQUARE = mcc.SQUARE
_INPUTS = ("q", "k", "e", "x", "g", "scores", "d_y", "starts", "d_ends")
_OUTPUTS = ("d_q", "d_k", "d_e", "d_g", "d_x", "d_scores")


def _scratch(count: int, key_dim: int) -> dict:
    """The chunk's tiles, the scratch of ``channel_scores`` (``masks``, ``rows``, ``cols``),
    which also holds the states once the system's scores are made, and three ``[C, C]``
    squares: ``u`` (the inverse's scratch, then ``U``), ``inverse`` (``T``) and ``m`` (the
    inverse's scratch, then ``M``, then ``dX``); every operand with a leading axis of one
    (``views``)."""

    def operand(number, shape):
        return mc.pieces(number, (1, *shape))

    tile = (CHUNK, key_dim)
    block = (CHUNK, VALUE_BLOCK)
    return dict(
        q=operand(count, tile),
        k=operand(count, tile),
        e=operand(count, tile),
        g=operand(mc.SEGMENT_PIECES, tile),
        x=operand(count, block),
        d_y=operand(count, block),
        masks=(operand(1, SQUARE), operand(1, SQUARE)),
        rows=(operand(count, tile), operand(count, tile)),
        cols=operand(count, tile),
        u=operand(count, SQUARE),
        inverse=operand(count, SQUARE),
        m=operand(count, SQUARE),
        loaded=plgpu.Barrier(num_arrivals=5 * count + mc.SEGMENT_PIECES),
        states_loaded=plgpu.Barrier(num_arrivals=2 * count),
        m_loaded=plgpu.Barrier(num_arrivals=count),
    )


def views(s: dict, zero) -> dict:
    """``s`` with every operand (a ``Pieces`` with a leading axis of one, alone or in a
    tuple) viewed at index ``zero[0]`` (a 0 read from HBM). A stage or a loop's step that
    reads its operands through views of its own makes their wgmma descriptors where it uses
    them: LLVM cannot hoist them out of the loop or merge them with another stage's (each
    holding registers from one use to the next), which made ptxas spill."""
    index = zero[0]

    def view(x):
        if isinstance(x, Pieces):
            return x.at(index)
        if isinstance(x, tuple) and x and isinstance(x[0], Pieces):
            return tuple(p.at(index) for p in x)
        return x

    return {name: view(x) for name, x in s.items()}


def _copy_inputs(hbm, s, *, chunk, head, group, block):
    """Start the TMA copies of the chunk's inputs (q and k of the key head, e and the
    gates' pieces of the value head, x and dY's value block)."""
    tokens = pl.ds(chunk * CHUNK, CHUNK)
    values = pl.ds(block * VALUE_BLOCK, VALUE_BLOCK)
    sources = (
        *(ref.at[tokens, head // group] for ref in (*hbm["q"], *hbm["k"])),
        *(ref.at[tokens, head] for ref in (*hbm["e"], *hbm["g"])),
        *(ref.at[tokens, head, values] for ref in (*hbm["x"], *hbm["d_y"])),
    )
    names = ("q", "k", "e", "g", "x", "d_y")
    tiles = (ref for name in names for ref in s[name].refs)
    for src, dst in zip(sources, tiles, strict=True):
        plgpu.copy_gmem_to_smem(src, dst, s["loaded"])


def _copy_states(hbm, s, *, chunk, head, block):
    """Start the TMA copies of the start state and end cotangent of the value block into
    ``rows`` (free once the scores are made)."""
    values = pl.ds(block * VALUE_BLOCK, VALUE_BLOCK)
    mc.commit()  # the warpgroup's writes to ``rows`` before TMA's
    for name, dst in zip(("starts", "d_ends"), s["rows"], strict=True):
        for src, ref in zip(hbm[name], dst.refs, strict=True):
            plgpu.copy_gmem_to_smem(src.at[chunk, head, values], ref, s["states_loaded"])


def _copy_scores(hbm, s, *, chunk, head):
    """Start the TMA copies of ``M`` into ``m`` (free once the inverse is made)."""
    mc.commit()  # the inverse's writes to ``m`` before TMA's
    for src, ref in zip(hbm["scores"], s["m"].refs, strict=True):
        plgpu.copy_gmem_to_smem(src.at[pl.ds(chunk * CHUNK, CHUNK), head], ref, s["m_loaded"])


def _decayed_into(s, dst: Pieces, src: Pieces, which: int) -> None:
    """``src * exp(G)`` (``which`` 0) or ``src * exp(G_C - G)`` (1) into ``dst`` (``[C,
    K]`` operands), committed; the chunk masks must be in ``s["masks"]``."""

    def block(first, carry):
        keys = mcc.key_block(first)
        decay = mcc.chunk_decays(s["masks"], s["g"].at(*keys))[which]
        mc.store(dst.at(*keys), mc.load(src.at(*keys)) * decay)
        return carry

    mc.over_blocks(src.refs[0].shape[1], block, 0)
    mc.commit()


def _value_stage(s, out, index):
    """``U``, ``dU``, ``dX`` (written to ``d_x``), then ``dM = dY U^T`` and ``dA = -dX
    U^T`` (written to ``d_scores``), whole: the levels keep what lies below the diagonal.
    Leaves ``U`` and ``dX`` in ``u`` and ``m`` and the states in ``rows``."""
    tokens, head, values, value_block = index
    start, d_end = s["rows"]
    mcc.write_chunk_masks(s["masks"])
    _decayed_into(s, s["cols"], s["e"], 0)  # E * exp(G)
    plgpu.barrier_wait(s["states_loaded"])
    block = (CHUNK, VALUE_BLOCK)
    mc.store(s["x"], mc.load(s["x"]) - mc.product(block, (s["cols"], start.T)))
    mc.commit()
    mc.store(s["u"], mc.product(block, (s["inverse"], s["x"])))  # U = T (X - (E exp(G)) S^T)
    _decayed_into(s, s["cols"], s["k"], 1)  # K * exp(G_C - G); commits U too
    plgpu.barrier_wait(s["m_loaded"])
    d_u = mc.product(block, (s["m"].T, s["d_y"]), (s["cols"], d_end.T))
    mc.store(s["x"], d_u)
    mc.commit()
    d_x = mc.product(block, (s["inverse"].T, s["x"]))
    out["d_x"].at[tokens, head, values][...] = d_x
    mc.store(s["m"], d_x)
    mc.commit()
    d_scores = out["d_scores"]
    d_scores.at[value_block, 0, tokens, head][...] = mc.product(SQUARE, (s["d_y"], s["u"].T))
    d_scores.at[value_block, 1, tokens, head][...] = -mc.product(SQUARE, (s["m"], s["u"].T))


def token_rows(test):
    """``[C, 64]`` float32: 1 on the rows of the tokens ``t`` where ``test(t)``, else 0, from
    a ``ROWS`` vector (two entries a thread, where a ``[C, C]`` iota would be 32 registers
    that LLVM holds through a loop)."""
    tokens = plgpu.broadcasted_iota(jnp.int32, (CHUNK,), 0, layout=mc.ROWS)
    return mc.by_row(jnp.where(test(tokens), 1.0, 0.0), SQUARE)


def _decay(s, keys, which: int):
    """``exp(G)`` (``which`` 0) or ``exp(G_C - G)`` (1) of the 64 key channels ``keys``: a
    product of one chunk mask (``write_chunk_masks``) with the gates."""
    return jnp.exp(mc.product(SQUARE, (s["masks"][which], s["g"].at(*keys))))


def _top_stage(scratch, shares):
    """The chunk's decays and the diagonal of ``M``: the first terms of every share, 64 key
    channels at a time, each tile used as soon as it is made. ``shares(first)``: the ``d_q,
    d_k, d_e, d_g`` blocks in HBM."""
    s = views(scratch, scratch["zero"])
    # dM's diagonal, dY_t . U_t, without a [C, C] mask.
    diagonal = mc.by_row(jnp.sum(mc.load(s["d_y"]) * mc.load(s["u"]), axis=1), SQUARE)
    mcc.write_chunk_masks(s["masks"])

    def block(first, carry):
        s = views(scratch, scratch["zero"])
        start, d_end = s["rows"]
        # The sums' cotangents go where dY (read by the next block) is not: x holds dU no
        # more, cols K exp(G_C - G) no more.
        sums = (s["x"], s["cols"].at(*mcc.key_block(0)))
        keys = mcc.key_block(first)
        d_q, d_k, d_e, d_g = shares(first)
        from_start = _decay(s, keys, 0)
        d_q_start = mc.product(SQUARE, (s["d_y"], start.at(*keys)))  # dY S
        d_q[...] = d_q_start * from_start + diagonal * mc.load(s["k"].at(*keys))
        d_sum = d_q_start * mc.load(s["q"].at(*keys))
        d_e_start = -mc.product(SQUARE, (s["m"], start.at(*keys)))  # -dX S
        d_e[...] = d_e_start * from_start
        d_sum = d_sum + d_e_start * mc.load(s["e"].at(*keys))
        # exp(G_C) is row C - 1 of exp(G): d exp(G_C) joins that row's cotangent.
        d_whole = jnp.sum(mc.load(d_end.at(*keys)) * mc.load(start.at(*keys)), axis=0)
        last = token_rows(lambda t: t == CHUNK - 1) * mc.by_col(d_whole, SQUARE)
        mc.store(sums[0], (d_sum + last) * from_start)
        to_end = _decay(s, keys, 1)
        d_k_end = mc.product(SQUARE, (s["u"], d_end.at(*keys)))  # U dS'
        d_k[...] = d_k_end * to_end + diagonal * mc.load(s["q"].at(*keys))
        mc.store(sums[1], d_k_end * mc.load(s["k"].at(*keys)) * to_end)
        mc.commit()
        d_g[...] = gate_product(s, sums)
        return carry

    mc.over_blocks(s["q"].refs[0].shape[1], block, 0)


def gate_product(s, sums: tuple[Pieces, Pieces]):
    """``B_P^T dP + B_S^T dS``: the sums' cotangents ``sums`` back to the gates through the
    masks of the sums (the first two of ``masks``)."""
    p_mask, s_mask = s["masks"][:2]
    return mc.product(SQUARE, (p_mask.T, sums[0]), (s_mask.T, sums[1]))


def _grads_kernel(*refs, group: int, **scratch):
    """One chunk, value head and value block: its shares of every input's gradient but the
    levels' terms."""
    hbm = dict(zip(_INPUTS + ("zero",) + _OUTPUTS, refs, strict=True))
    out = {name: hbm.pop(name) for name in _OUTPUTS}
    scratch["zero"] = hbm.pop("zero")
    s = views(scratch, scratch["zero"])
    chunk, head, block = (jax.lax.axis_index(axis) for axis in ("chunk", "head", "block"))
    where = dict(chunk=chunk, head=head, block=block)
    _copy_inputs(hbm, s, group=group, **where)
    plgpu.barrier_wait(s["loaded"])
    one_row = dict(s, rows=s["rows"][:1])
    (strict,) = mcc.channel_scores(one_row, (s["e"],), s["k"], s["g"], diagonal=False)
    _copy_states(hbm, s, **where)
    mc.store(s["inverse"], mc.unit_lower_inverse(strict, s["u"], s["inverse"], s["m"]))
    _copy_scores(hbm, s, chunk=chunk, head=head)
    tokens = pl.ds(chunk * CHUNK, CHUNK)
    index = (tokens, head, pl.ds(block * VALUE_BLOCK, VALUE_BLOCK), block)
    _value_stage(views(scratch, scratch["zero"]), out, index)

    def shares(first):
        keys = pl.ds(first, CHUNK)
        return tuple(out[name].at[block, tokens, head, keys] for name in _OUTPUTS[:4])

    _top_stage(scratch, shares)


def grads(q, k, e, x, g, scores, d_y, starts, d_ends, *, interpret=None):
    """Every chunk's shares of the gradients but the levels' terms: ``q``, ``k`` pieces
    ``[tokens, H, K]``, ``e`` pieces ``[tokens, HV, K]``, ``x`` and ``d_y`` pieces ``[tokens,
    HV, V]``, ``g`` the log-decays' ``SEGMENT_PIECES`` pieces ``[tokens, HV, K]``
    (``mosaic_channel_forward.gate_pieces``), ``scores`` (``M``) pieces ``[tokens, HV, C]``,
    ``starts`` and ``d_ends`` pieces ``[chunks, HV, V, K]``. Returns float32 ``(d_q, d_k,
    d_e, d_g, d_x, d_scores)``: ``d_q``, ``d_k``, ``d_e``, ``d_g`` ``[blocks, tokens, HV,
    K]``, each value block's share, ``d_x [tokens, HV, V]`` and ``d_scores [blocks, 2,
    tokens, HV, C]`` (the shares of ``dM`` and ``dA``, whole: only what lies below the
    diagonal counts)."""
    count = len(q)
    tokens, heads, key_dim = q[0].shape
    v_heads, value_dim = x[0].shape[1:]
    blocks = value_dim // VALUE_BLOCK
    share = jax.ShapeDtypeStruct((blocks, tokens, v_heads, key_dim), F32)
    out_type = (
        share,
        share,
        share,
        share,
        jax.ShapeDtypeStruct((tokens, v_heads, value_dim), F32),
        jax.ShapeDtypeStruct((blocks, 2, tokens, v_heads, CHUNK), F32),
    )
    call = mc.kernel_call(
        functools.partial(_grads_kernel, group=v_heads // heads),
        name="channel_mosaic_grads",
        out_type=out_type,
        scratch=_scratch(count, key_dim),
        grid=dict(chunk=tokens // CHUNK, head=v_heads, block=blocks),
        interpret=interpret,
    )
    inputs = (q, k, e, x, g, scores, d_y, starts, d_ends)
    return call(*(tuple(a) for a in inputs), jnp.zeros((1,), jnp.int32))
