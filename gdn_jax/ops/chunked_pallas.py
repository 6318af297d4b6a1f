"""The chunked gated delta rule as one Pallas kernel over the batch's own layout
(``impl="pallas"``), beside the XLA form it accelerates (``chunked.py``).

Each program of the grid ``(B, HV, V / block_v)`` owns one sequence, one value head and a
block of the value channels, and walks its sequence's chunks in order with the state block
``S [block_v, K]`` held on chip from the first chunk to the last. It reads each chunk's
tiles straight from ``q, k [B, T, H, K]``, ``v [B, T, HV, V]`` and the gates ``[B, T, HV]``
(no transposed copies) and does the whole of ``chunked.py``'s three stages per chunk:

1. the decays from the segment sums of the log-gates (``decays.py``), the intra-chunk
   system ``I + strict`` with ``strict = tril(diag(beta) (K K^T * Gamma), -1)`` and its
   inverse ``T`` by forward substitution, and the WY factors ``w = T diag(beta exp(g)) K``,
   ``u = T diag(beta) V`` (``wy.py``);
2. the state pass: ``U = u - w S^T``, ``S' = exp(g_C) S + U^T diag(exp(g_C - g)) K``;
3. the outputs ``Y = diag(exp(g)) Q S^T + (Q K^T * Gamma) U``.

It also writes each chunk's start state, the one residual the backward needs besides the
inputs. The backward is a second kernel, on a grid of its own value blocks (each writes its
share of the gradients of q, k and the gates, which sum over the value channels, added up
after it). It walks the chunks last to first carrying its block of the state's cotangent
``dS`` on chip, and does per chunk what ``chunked.chunk_backward`` does: stage 1 again, the
reverse state pass, then every input's gradient from the chunk's start state. Its sums and
products are the XLA form's, term for term (``chunked.py``, ``wy.py``, ``decays.py`` give
the derivations).

On a GPU the kernels run through Pallas's Triton backend, which also serves Ampere and
emits Hopper's wgmma for the products, float32 ones as three TF32 passes (about float32's
accuracy; ``Launch.products``). JAX deprecated that backend in 0.11 (a ``DeprecationWarning``
at each lowering, removal announced), so this form stays opt-in until a Mosaic GPU form has
been measured beside it. Anywhere else the kernels run in Pallas's interpret mode (a slow,
faithful execution of the same body in XLA, every product at full precision), so a program
written for ``impl="pallas"`` runs on a host without a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from gdn_jax.ops import pallas_chunk, stages
from gdn_jax.ops.decays import LOG_ALPHA_FLOOR
from gdn_jax.ops.varlen import chunk_layout, pack_layout


@dataclasses.dataclass(frozen=True)
class Launch:
    """How the kernels are launched on a GPU. ``block_v`` and ``backward_block_v`` are the
    value channels of a forward and a backward program (None: the whole value head). With
    several backward blocks a value head's gradients of q, k and the gates are summed after
    the kernel from each block's share (one more ``[B, T, HV, K]`` array for q and for k a
    block). The warps are Triton's per program, and there is no software pipelining of the
    chunk loop (each chunk's loads depend on nothing carried). ``products``: the float32
    products' operands, three TF32 passes (Hopper's wgmma, about float32's accuracy) or
    Triton's IEEE float32 (scalar FMAs).

    The defaults come from the kernels compiled for sm_90a without a GPU
    (``benchmarks/triton_sm90.py``; docs/benchmarks.md): IEEE products spill heavily, a
    backward program of a whole value head of 128 needs more shared memory than a Hopper
    block has, and eight warps spill less than four. Not yet timed on a GPU:
    ``benchmarks/gpu_check.py --pallas-launch`` times launches there.
    """

    block_v: int = 64
    forward_warps: int = 8
    backward_block_v: int | None = 64
    backward_warps: int = 8
    num_stages: int = 1
    products: Literal["tf32x3", "ieee"] = "tf32x3"


LAUNCH = Launch()


def _forward_kernel(
    starts_seq_ref, ends_seq_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, h0_ref, _finals_in,
    y_ref, finals_ref, chunk_starts_ref, *, chunk: int, num_chunks: int, precision,
):  # fmt: skip
    """One program: one sequence, value head and value block over all its chunks.

    Refs: ``starts_seq, ends_seq [NC]`` (the resets of ``blocks.scan_blocks``), ``q, k [Tc,
    K]``, ``v [Tc, block_v]``, ``g, beta [Tc]``, ``h0 [N, block_v, K]``; out ``y [Tc,
    block_v]``, ``finals [N, block_v, K]`` (aliased to ``h0``'s copy, so that a sequence with
    no tokens keeps its initial state), ``chunk_starts [NC, block_v, K]``.
    """
    compute = h0_ref.dtype

    def one_chunk(n, state):
        first = starts_seq_ref[n]
        state = jnp.where(first >= 0, h0_ref[jnp.maximum(first, 0)], state)
        chunk_starts_ref[n] = state
        tokens = pl.ds(n * chunk, chunk)
        inputs = (ref[tokens].astype(compute) for ref in (q_ref, k_ref, v_ref, g_ref, beta_ref))
        new_state, y = pallas_chunk.forward(state, *inputs, precision=precision)
        y_ref[tokens] = y.astype(y_ref.dtype)
        last = ends_seq_ref[n]

        @pl.when(last >= 0)
        def _():
            finals_ref[jnp.maximum(last, 0)] = new_state

        return new_state

    jax.lax.fori_loop(0, num_chunks, one_chunk, jnp.zeros(h0_ref.shape[1:], compute))


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _value_block(requested: int | None, value_dim: int) -> int:
    """A program's value channels: ``requested`` where it divides ``V``, else all of them."""
    block = min(requested or value_dim, value_dim)
    return block if value_dim % block == 0 else value_dim


def _precision(compute):
    """``LAUNCH.products`` for float32 on a GPU, else full (XLA:CPU has no TF32)."""
    if _on_gpu() and jnp.dtype(compute) == jnp.float32 and LAUNCH.products == "tf32x3":
        return jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return pallas_chunk.EXACT


def _triton(num_warps: int):
    """Triton's options, on a GPU only (the interpret mode imports no deprecated backend)."""
    if not _on_gpu():
        return None
    from jax.experimental.pallas import triton as pl_triton

    return pl_triton.CompilerParams(num_warps=num_warps, num_stages=LAUNCH.num_stages)


def kernel_forward(q, k, v, log_alpha, beta, initial_states, resets, *, chunk_size: int):
    """The kernel over the batch: q, k ``[B, Tc, H, K]``, v ``[B, Tc, HV, V]``, gates ``[B,
    Tc, HV]`` with ``Tc`` a multiple of ``chunk_size`` (the chunk layout), ``initial_states
    [N, HV, V, K]``, ``resets = (starts_seq, ends_seq) [B, NC]``. Returns ``(y [B, Tc, HV,
    V], finals [N, HV, V, K], chunk_starts [B, NC, HV, V, K])``, ``y`` in v's dtype and the
    states in the initial states' (the compute dtype)."""
    batch, padded, heads, key_dim = q.shape
    v_heads, value_dim = v.shape[2:]
    num_states = initial_states.shape[0]
    group = v_heads // heads
    num_chunks = padded // chunk_size
    block_v = _value_block(LAUNCH.block_v, value_dim)
    grid = (batch, v_heads, value_dim // block_v)
    squeezed = pl.squeezed
    state_block = (num_states, squeezed, block_v, key_dim)
    in_specs = [
        pl.BlockSpec((squeezed, num_chunks), lambda b, h, j: (b, 0)),
        pl.BlockSpec((squeezed, num_chunks), lambda b, h, j: (b, 0)),
        pl.BlockSpec((squeezed, padded, squeezed, key_dim), lambda b, h, j: (b, 0, h // group, 0)),
        pl.BlockSpec((squeezed, padded, squeezed, key_dim), lambda b, h, j: (b, 0, h // group, 0)),
        pl.BlockSpec((squeezed, padded, squeezed, block_v), lambda b, h, j: (b, 0, h, j)),
        pl.BlockSpec((squeezed, padded, squeezed), lambda b, h, j: (b, 0, h)),
        pl.BlockSpec((squeezed, padded, squeezed), lambda b, h, j: (b, 0, h)),
        pl.BlockSpec(state_block, lambda b, h, j: (0, h, j, 0)),
        pl.BlockSpec(state_block, lambda b, h, j: (0, h, j, 0)),
    ]
    out_specs = [
        pl.BlockSpec((squeezed, padded, squeezed, block_v), lambda b, h, j: (b, 0, h, j)),
        pl.BlockSpec(state_block, lambda b, h, j: (0, h, j, 0)),
        pl.BlockSpec(
            (squeezed, num_chunks, squeezed, block_v, key_dim), lambda b, h, j: (b, 0, h, j, 0)
        ),
    ]
    compute = initial_states.dtype
    out_shape = [
        jax.ShapeDtypeStruct(v.shape, v.dtype),
        jax.ShapeDtypeStruct(initial_states.shape, compute),
        jax.ShapeDtypeStruct((batch, num_chunks, v_heads, value_dim, key_dim), compute),
    ]
    kernel = functools.partial(
        _forward_kernel,
        chunk=chunk_size,
        num_chunks=num_chunks,
        precision=_precision(initial_states.dtype),
    )
    call = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={8: 1},  # the finals start as the initial states
        interpret=not _on_gpu(),
        compiler_params=_triton(LAUNCH.forward_warps),
        name="gated_delta_rule_chunked_pallas",
    )
    starts_seq, ends_seq = resets
    with jax.named_scope(stages.KERNEL_FORWARD):
        return call(starts_seq, ends_seq, q, k, v, log_alpha, beta, initial_states, initial_states)


def _backward_kernel(
    starts_seq_ref, ends_seq_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, chunk_starts_ref,
    d_y_ref, d_finals_ref, _d_initial_in,
    d_q_ref, d_k_ref, d_v_ref, d_g_ref, d_beta_ref, d_initial_ref, *, chunk: int,
    num_chunks: int, precision,
):  # fmt: skip
    """One program: one sequence, value head and block of ``Vb`` value channels over its
    chunks, last to first, carrying that block of the state's cotangent ``dS [Vb, K]``
    (``chunked.chunk_backward``'s stages per chunk: the reverse state pass, then every
    input's gradient from the chunk's start state). The state's rows, one a value channel,
    evolve apart, and the gradients of q, k and the gates are sums over the rows: a block's
    are its share of them.

    Refs as ``_forward_kernel``'s, with ``chunk_starts [NC, Vb, K]``, ``d_y [Tc, Vb]`` and
    ``d_finals [N, Vb, K]`` in; out the gradients of ``q, k [Tc, K]`` and ``g, beta [Tc]``
    (this value head's and block's share), ``v [Tc, Vb]`` and ``d_initial [N, Vb, K]``,
    aliased to its start (``d_finals`` for the sequences with no tokens, else zeros)."""
    compute = chunk_starts_ref.dtype

    def one_chunk(step, d_carry):
        n = num_chunks - 1 - step
        last = ends_seq_ref[n]
        d_end = d_carry + jnp.where(last >= 0, d_finals_ref[jnp.maximum(last, 0)], 0)
        tokens = pl.ds(n * chunk, chunk)
        refs = (q_ref, k_ref, v_ref, g_ref, beta_ref, d_y_ref)
        inputs = [ref[tokens].astype(compute) for ref in refs]
        d_start, grads = pallas_chunk.backward(
            d_end, chunk_starts_ref[n], *inputs, precision=precision
        )
        for ref, grad in zip((d_q_ref, d_k_ref, d_v_ref, d_g_ref, d_beta_ref), grads, strict=True):
            ref[tokens] = grad
        # A sequence's first chunk: its initial state's cotangent, and no dependence on the
        # chunk before, which belongs to another sequence.
        first = starts_seq_ref[n]

        @pl.when(first >= 0)
        def _():
            m = jnp.maximum(first, 0)
            d_initial_ref[m] = d_initial_ref[m] + d_start

        return jnp.where(first >= 0, 0, d_start)

    d_zero = jnp.zeros(chunk_starts_ref.shape[1:], compute)
    jax.lax.fori_loop(0, num_chunks, one_chunk, d_zero)


def kernel_backward(inputs, chunk_starts, resets, d_y, d_finals, *, chunk_size: int):
    """The backward kernel over the batch, on the forward's chunk layout and residuals:
    returns the gradients of q, k ``[B, Tc, H, K]`` (summed over each key head's value
    heads), v, the gates and the initial states, all in the compute dtype."""
    q, k, v, log_alpha, beta = inputs
    batch, padded, heads, key_dim = q.shape
    v_heads, value_dim = v.shape[2:]
    num_states = d_finals.shape[0]
    group = v_heads // heads
    num_chunks = padded // chunk_size
    compute = chunk_starts.dtype
    squeezed = pl.squeezed
    block_v = _value_block(LAUNCH.backward_block_v, value_dim)
    blocks = value_dim // block_v
    ends_seq = resets[1].reshape(-1)
    ends = jnp.where(ends_seq >= 0, ends_seq, num_states)
    ends_somewhere = jnp.zeros(num_states, bool).at[ends].set(True, mode="drop")
    # A sequence with no tokens passes its initial state straight to its final state.
    d_initial = jnp.where(ends_somewhere[:, None, None, None], 0, d_finals)
    states = pl.BlockSpec((num_states, squeezed, block_v, key_dim), lambda b, h, j: (0, h, j, 0))
    sq = squeezed
    by_token = {
        "qk": pl.BlockSpec((sq, padded, sq, key_dim), lambda b, h, j: (b, 0, h // group, 0)),
        "v": pl.BlockSpec((sq, padded, sq, block_v), lambda b, h, j: (b, 0, h, j)),
        "gate": pl.BlockSpec((sq, padded, sq), lambda b, h, j: (b, 0, h)),
        # The shares of a value head's block: [blocks, B, Tc, HV, K] and [blocks, B, Tc, HV].
        "share_k": pl.BlockSpec((sq, sq, padded, sq, key_dim), lambda b, h, j: (j, b, 0, h, 0)),
        "share": pl.BlockSpec((sq, sq, padded, sq), lambda b, h, j: (j, b, 0, h)),
    }  # fmt: skip
    resets_spec = pl.BlockSpec((squeezed, num_chunks), lambda b, h, j: (b, 0))
    in_specs = [
        resets_spec, resets_spec, by_token["qk"], by_token["qk"], by_token["v"],
        by_token["gate"], by_token["gate"],
        pl.BlockSpec(
            (sq, num_chunks, sq, block_v, key_dim), lambda b, h, j: (b, 0, h, j, 0)
        ),
        by_token["v"], states, states,
    ]  # fmt: skip
    out_specs = [
        by_token["share_k"], by_token["share_k"], by_token["v"], by_token["share"],
        by_token["share"], states,
    ]  # fmt: skip
    shares_k, shares = (blocks, batch, padded, v_heads, key_dim), (blocks, *log_alpha.shape)
    out_shape = [
        jax.ShapeDtypeStruct(shares_k, compute),
        jax.ShapeDtypeStruct(shares_k, compute),
        jax.ShapeDtypeStruct(v.shape, compute),
        jax.ShapeDtypeStruct(shares, compute),
        jax.ShapeDtypeStruct(shares, compute),
        jax.ShapeDtypeStruct(d_finals.shape, compute),
    ]
    kernel = functools.partial(
        _backward_kernel, chunk=chunk_size, num_chunks=num_chunks, precision=_precision(compute)
    )
    call = pl.pallas_call(
        kernel,
        grid=(batch, v_heads, blocks),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={10: 5},  # the initial states' cotangents start as d_initial
        interpret=not _on_gpu(),
        compiler_params=_triton(LAUNCH.backward_warps),
        name="gated_delta_rule_chunked_pallas_bwd",
    )
    starts_seq, ends_seq = resets
    with jax.named_scope(stages.KERNEL_BACKWARD):
        d_q, d_k, d_v, d_log_alpha, d_beta, d_initial = call(
            starts_seq, ends_seq, q, k, v, log_alpha, beta, chunk_starts, d_y.astype(compute),
            d_finals.astype(compute), d_initial.astype(compute),
        )  # fmt: skip

    def over_group(x):  # the blocks' and value heads' shares of their key head's q and k
        return x.sum(0).reshape(batch, padded, heads, group, key_dim).sum(3)

    d_log_alpha, d_beta = d_log_alpha.sum(0), d_beta.sum(0)
    return over_group(d_q), over_group(d_k), d_v, d_log_alpha, d_beta, d_initial


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _pallas_core(q, k, v, log_alpha, beta, initial_states, resets, chunk_size):
    y, finals, _ = kernel_forward(
        q, k, v, log_alpha, beta, initial_states, resets, chunk_size=chunk_size
    )
    return y, finals


def _pallas_core_fwd(q, k, v, log_alpha, beta, initial_states, resets, chunk_size):
    y, finals, chunk_starts = kernel_forward(
        q, k, v, log_alpha, beta, initial_states, resets, chunk_size=chunk_size
    )
    return (y, finals), ((q, k, v, log_alpha, beta), chunk_starts, resets)


def _pallas_core_bwd(chunk_size, residuals, cotangents):
    inputs, chunk_starts, resets = residuals
    *d_inputs, d_initial = kernel_backward(
        inputs, chunk_starts, resets, *cotangents, chunk_size=chunk_size
    )
    d_inputs = [d.astype(x.dtype) for d, x in zip(d_inputs, inputs, strict=True)]
    return (*d_inputs, d_initial, None)


_pallas_core.defvjp(_pallas_core_fwd, _pallas_core_bwd)


def gated_delta_rule_pallas(q, k, v, gates, initial_states, cu_seqlens, *, chunk_size: int):
    """The batched chunked gated delta rule by the kernel: the prepared inputs of
    ``api.prepare_batched`` (q, k ``[B, T, H, K]`` unscaled, v ``[B, T, HV, V]``, ``gates =
    (log_alpha, beta) [B, T, HV]``, ``initial_states [B or N, HV, V, K]`` in the compute
    dtype). Returns ``(o [B, T, HV, V], finals)`` as ``api.over_batch_and_heads`` does."""
    batch, seq_len = q.shape[:2]
    key_dim, value_dim = q.shape[-1], v.shape[-1]
    log_alpha, beta = (x.astype(initial_states.dtype) for x in gates)
    log_alpha = jnp.maximum(log_alpha, LOG_ALPHA_FLOOR)
    # Triton's tiles are powers of two, of at least 16 along a product's sides: K and V are
    # padded with zero channels, which no product reads into the others.
    k_pad, v_pad = (_tile(n) - n for n in (key_dim, value_dim))
    q, k = (_pad_last(x, k_pad) for x in (q, k))
    v = _pad_last(v, v_pad)
    initial_states = jnp.pad(initial_states, [(0, 0), (0, 0), (0, v_pad), (0, k_pad)])
    y, finals = _by_layout(q, k, v, log_alpha, beta, initial_states, cu_seqlens, chunk_size)
    return y[..., :value_dim], finals[..., :value_dim, :key_dim]


def _tile(size: int) -> int:
    return max(16, 1 << (size - 1).bit_length())


def _pad_last(x, pad: int):
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x


def _by_layout(q, k, v, log_alpha, beta, initial_states, cu_seqlens, chunk_size):
    """The kernel on the chunk layout of the batch rows, or of the packed sequences."""
    batch, seq_len = q.shape[:2]
    arrays = (q, k, v, log_alpha, beta)
    if cu_seqlens is None:
        layout = chunk_layout(seq_len, chunk_size)
        num_chunks = -(-seq_len // chunk_size)
        padded = tuple(
            jax.vmap(lambda x: layout.to_chunks(x).reshape(-1, *x.shape[1:]))(x) for x in arrays
        )
        # Each batch row is one sequence: it starts from state b and ends as final b.
        ids = jnp.arange(batch, dtype=jnp.int32)[:, None]
        chunk = jnp.arange(num_chunks, dtype=jnp.int32)[None, :]
        resets = (
            jnp.where(chunk == 0, ids, -1),
            jnp.where(chunk == num_chunks - 1, ids, -1),
        )
        y, finals = _pallas_core(*padded, initial_states, resets, chunk_size)
        return y[:, :seq_len], finals
    layout = pack_layout(cu_seqlens, seq_len, chunk_size)
    padded = tuple(layout.scatter(x[0])[None] for x in arrays)
    resets = tuple(r[None] for r in layout.resets)
    y, finals = _pallas_core(*padded, initial_states, resets, chunk_size)
    return layout.gather(y[0])[None], finals
