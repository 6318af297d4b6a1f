"""The chunked gated delta rule as Mosaic GPU kernels for Hopper (``impl="mosaic_gpu"``).

Forward (``ops/mosaic/scalar/factors.py``, ``states.py``): a kernel over every chunk at once for the parallel work (the
decays, ``K K^T``, the inverse of the intra-chunk system by doubling blocks on the tensor
cores, kept for the backward, the WY factors ``w`` and ``u``), then one program per (sequence, value head, block of
64 value channels) that carries its block of the float32 state on chip from the sequence's
first chunk to its last, streams the chunks' tiles in by TMA, writes the outputs and, for the
backward, each chunk's start state. Backward (``ops/mosaic/scalar/reverse.py``, ``grads.py``), derived by hand as
``ops/chunked/scalar.py``'s: a reverse pass of the same shape carrying the state's cotangent, then a
kernel over every chunk for every input's gradient. Four Mosaic kernels a forward and
backward (two a forward), with XLA's layout, gates and sums around them.

Every product is a wgmma with bf16 operands and float32 accumulation (``ops/mosaic/tiles.py``):
bf16 v makes every operand one bf16 piece (q and k too, which the op's L2 norm returns in
float32), any other dtype two pieces an operand, about float32's accuracy at three times the
products. The state, the decays and every sum outside the products are float32.

The inputs are laid out in XLA first (``ops/mosaic/layout.py``): every sequence's chunks on one
token axis, channels padded with zeros to multiples of 64, gates and the decays from
them as ``[5, HV, tokens]`` (``scalar/chunk.gate_rows``).
Off a GPU the kernels run in Mosaic GPU's interpret mode (jax >= 0.11).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gdn_jax.ops.chunked.decays import LOG_ALPHA_FLOOR
from gdn_jax.ops.forward_mode import first_order_only
from gdn_jax.ops.mosaic import limits, tiles
from gdn_jax.ops.mosaic.layout import padded, padded_states, token_layout
from gdn_jax.ops.mosaic.limits import CHUNK
from gdn_jax.ops.mosaic.scalar import chunk as in_chunk
from gdn_jax.ops.mosaic.scalar import factors, grads, reverse, states
from gdn_jax.ops.mosaic.tiles import F32


def _operands(q, k, v, log_alpha, beta):
    """The kernels' operands: q, k, v padded and as pieces (one each when v is bf16, else
    two), and the gates with the decays ``[GATES, HV, tokens]``."""
    count = tiles.piece_count(v.dtype)
    q, k, v = (tiles.operand(padded(x, 2), count) for x in (q, k, v))
    return q, k, v, in_chunk.gate_rows(log_alpha.T.astype(F32), beta.T.astype(F32))


def _forward(q, k, v, log_alpha, beta, initial_states, table, *, keep_starts, interpret):
    """Both forward kernels on the token layout (q, k ``[tokens, H, K]``, v ``[tokens, HV,
    V]``, gates ``[tokens, HV]``, ``initial_states [N, HV, V, K]`` float32). Returns ``(y,
    finals, residuals)``, the residuals (operands, w, the chunks' attention, start states and
    inverses) None without ``keep_starts``."""
    key_dim, value_dim = q.shape[-1], v.shape[-1]
    operands = _operands(q, k, v, log_alpha, beta)
    q, k, v, gates = operands
    h0 = padded_states(initial_states)
    w, u, attn, *inverses = factors.factors(
        q, k, v, gates, keep_inverse=keep_starts, interpret=interpret
    )
    y, finals, *starts = states.states(
        table, q, k, w, attn, u, gates, h0, keep_starts=keep_starts, interpret=interpret
    )
    residuals = (operands, w, attn, starts[0], inverses[0]) if keep_starts else None
    return y[..., :value_dim], finals[..., :value_dim, :key_dim], residuals


def _backward(residuals, table, d_y, d_finals, *, dims, dtypes, interpret):
    """Both backward kernels, and the sums of the shares of q's, k's and the gates'
    gradients over value blocks and each key head's value heads."""
    (q, k, v, gates), w, attn, starts, inverses = residuals
    key_dim, value_dim = dims
    count = len(q)
    d_y = tiles.operand(padded(d_y, 2), count)
    d_finals = padded_states(d_finals)
    d_initial, d_ends = reverse.reverse(
        table, q, k, w, attn, d_y, gates, d_finals, interpret=interpret
    )
    d_q, d_k, d_v, d_gates = grads.grads(
        q, k, v, d_y, gates, starts, d_ends, inverses, dtypes=dtypes, interpret=interpret
    )
    tokens, heads = q[0].shape[:2]

    def key_grad(shares):  # [blocks, tokens, HV, K] -> [tokens, H, K]
        if shares.shape[0] > 1 or shares.shape[2] > heads:  # shares to sum, in float32
            shares = shares.sum(0).reshape(tokens, heads, -1, shares.shape[-1]).sum(2)
        else:  # one program's gradient, maybe in q's dtype: no sum, no copy
            shares = shares[0]
        return shares[..., :key_dim]

    d_log_alpha, d_beta = d_gates.sum(0)
    d_initial = d_initial[..., :value_dim, :key_dim]
    return key_grad(d_q), key_grad(d_k), d_v[..., :value_dim], d_log_alpha.T, d_beta.T, d_initial


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _core(q, k, v, log_alpha, beta, initial_states, table, static):
    """The kernels on the token layout; ``static = (op, interpret, dtypes of q, k and v, (K,
    V))``, what the backward needs besides arrays."""
    y, finals, _ = _forward(
        q, k, v, log_alpha, beta, initial_states, table, keep_starts=False, interpret=static[1]
    )
    return y, finals


def _core_fwd(q, k, v, log_alpha, beta, initial_states, table, static):
    q, k, v, log_alpha, beta, initial_states = first_order_only(
        limits.SECOND_ORDER.format(op=static[0]), (q, k, v, log_alpha, beta, initial_states)
    )
    y, finals, residuals = _forward(
        q, k, v, log_alpha, beta, initial_states, table, keep_starts=True, interpret=static[1]
    )
    return (y, finals), (residuals, table)


def _core_bwd(static, saved, cotangents):
    op, interpret, dtypes, dims = static
    saved, cotangents = first_order_only(limits.SECOND_ORDER.format(op=op), (saved, cotangents))
    residuals, table = saved
    # With one bf16 piece an operand (bf16 v) the products are bf16's, and the kernel may
    # write the gradients of q and k in bf16 too: float32 ones, kept for the sum of the
    # programs' shares, were a quarter of the backward's peak (the H200 compile report).
    key_dtype = tiles.BF16 if tiles.piece_count(dtypes[2]) == 1 else F32
    grads = _backward(
        residuals, table, *cotangents, dims=dims, dtypes=(key_dtype, dtypes[2]),
        interpret=interpret,
    )  # fmt: skip
    d_q, d_k, d_v = (d.astype(dtype) for d, dtype in zip(grads[:3], dtypes, strict=True))
    return (d_q, d_k, d_v, *grads[3:], None)


_core.defvjp(_core_fwd, _core_bwd)


def run(q, k, v, gates, initial_states, cu_seqlens, *, chunk_size: int, op: str, interpret):
    """The batched chunked gated delta rule by the Mosaic GPU kernels: the prepared inputs
    of ``api.prepare_batched`` (q, k ``[B, T, H, K]`` unscaled, v ``[B, T, HV, V]``, ``gates
    = (log_alpha, beta) [B, T, HV]``, ``initial_states [B or N, HV, V, K]`` float32,
    ``cu_seqlens`` None or ``[N + 1]`` with ``B == 1``). Returns ``(o [B, T, HV, V],
    finals)`` in float32, ``o`` unscaled. ``chunk_size`` must be the kernels' 64 (a wgmma's
    rows), within ``limits.refusals`` (``dispatch`` checks them); ``op`` names the calling op
    in errors; ``interpret`` as ``tiles.kernel_call``'s. Differentiable once, in reverse
    mode (``jax.custom_vjp``)."""
    compute = initial_states.dtype
    batch, seq_len = q.shape[:2]
    if batch * seq_len == 0:  # no tokens: every sequence ends as it started
        return jnp.zeros(v.shape, compute), initial_states
    log_alpha, beta = (x.astype(compute) for x in gates)
    log_alpha = jnp.maximum(log_alpha, LOG_ALPHA_FLOOR)
    layout = token_layout(batch, seq_len, CHUNK, cu_seqlens)
    inputs = (layout.to_tokens(x) for x in (q, k, v, log_alpha, beta))
    static = (op, interpret, (q.dtype, k.dtype, v.dtype), (q.shape[-1], v.shape[-1]))
    y, finals = _core(*inputs, initial_states, layout.table, static)
    return layout.from_tokens(y), finals
