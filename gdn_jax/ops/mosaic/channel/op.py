"""The channel-decay delta rules (KDA, GDN-2) as Mosaic GPU kernels for Hopper
(``impl="mosaic_gpu"``), of the design of the gated delta rule's (``ops/mosaic/scalar/op.py``).

Both rules reduce to one kernel contract in XLA, before the kernels: per value head, the
erase vectors ``e = b * k`` (KDA: ``beta * k``), the writes ``x = w * v`` (KDA: ``beta * v``)
and the log-decays ``g`` clamped at ``decays.LOG_ALPHA_FLOOR`` (a reset), all on the token
layout of ``ops/mosaic/layout.py`` with channels padded with zeros to multiples of 64. The
forward (``ops/mosaic/channel/factors.py``, ``states.py``) is a kernel over every chunk for the scores, the
inverse of the intra-chunk system and the WY factors, then a state pass a (sequence, value
head, block of 64 value channels) that carries the float32 state on chip.

The backward (``_core_bwd``, ``ops/mosaic/channel/reverse.py``) is a reverse state pass on the
forward's factors that carries the float32 cotangent of the state on chip, then kernels over
every chunk for the gradients of the contract's q, k, e, x and g (their value blocks' and
value heads' shares summed in XLA), pulled back to the rule's inputs through the contract's
elementwise products in XLA (``_contract``).

Every product is a wgmma with bf16 operands and float32 accumulation: bf16 v makes every
operand one bf16 piece, any other dtype two (``ops/mosaic/tiles.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gdn_jax.ops.chunked.decays import LOG_ALPHA_FLOOR
from gdn_jax.ops.forward_mode import first_order_only
from gdn_jax.ops.mosaic import limits, tiles
from gdn_jax.ops.mosaic.channel import factors, grads, reverse, states
from gdn_jax.ops.mosaic.layout import padded, padded_states, token_layout
from gdn_jax.ops.mosaic.limits import CHUNK
from gdn_jax.ops.mosaic.tiles import F32


@jax.custom_jvp
def _clamped(log_alpha):
    """The log-decays clamped at the floor (a full reset), as ``chunked/channel.py``'s ``clamped``;
    a clamped gate gets no gradient (at the floor too, where ``maximum``'s would be half).
    The forward's ``maximum`` and the backward's comparison are different operations: the
    same comparison in both, XLA kept one mask ``[tokens, HV, K]`` from the forward to the
    backward (32 MiB of KDA's peak at B=4, T=4096, H=16, K=128)."""
    return jnp.maximum(log_alpha, LOG_ALPHA_FLOOR)


@_clamped.defjvp
def _clamped_jvp(primals, tangents):
    (log_alpha,), (tangent,) = primals, tangents
    return _clamped(log_alpha), jnp.where(log_alpha > LOG_ALPHA_FLOOR, tangent, 0.0)


def _contract(q, k, v, gates):
    """The kernel contract in float32, unpadded: ``(q, k, e, x, g)`` (the erase vectors ``e
    = b * k`` per value head, the writes ``x = w * v``, KDA's ``beta`` for both gates, the
    log-decays clamped at the floor); its pullback takes the kernels' gradients to the
    rule's inputs. ``g`` passes no gradient to a gate clamped at the floor (as
    ``chunked/channel.py``'s ``clamped``)."""
    log_alpha, erase, *write = (x.astype(F32) for x in gates)
    group = v.shape[1] // q.shape[1]
    erase = erase[..., None] if erase.ndim == 2 else erase
    e = jnp.repeat(k.astype(F32), group, axis=1) * erase
    x = v.astype(F32) * (write[0] if write else erase)
    g = _clamped(log_alpha)
    return q.astype(F32), k.astype(F32), e, x, g


def kernel_operands(q, k, v, gates):
    """The kernels' operands from the token layout (q, k ``[tokens, H, K]``, v ``[tokens,
    HV, V]``, gates ``(log_alpha [tokens, HV, K], beta [tokens, HV])`` or ``(log_alpha, b
    [tokens, HV, K], w [tokens, HV, V])``): ``_contract``'s ``(q, k, e, x)`` padded, as
    pieces (one each when v is bf16, else two), and its ``g [tokens, HV, K]`` padded."""
    *operands, g = _contract(q, k, v, gates)
    count = tiles.piece_count(v.dtype)
    q, k, e, x = (tiles.operand(padded(y, 2), count) for y in operands)
    return (q, k, e, x), padded(g, 2)


def _forward(q, k, v, gates, initial_states, table, *, keep_starts, interpret):
    """Both forward kernels on the token layout. Returns ``(y, finals, residuals)``:
    ``residuals = (operands, g, factors, starts)`` with ``keep_starts``, else None."""
    key_dim, value_dim = q.shape[-1], v.shape[-1]
    operands, g = kernel_operands(q, k, v, gates)
    f = factors.factors(*operands, g, keep_inverse=keep_starts, interpret=interpret)
    h0 = padded_states(initial_states)
    y, finals, *starts = states.states(
        table, f.q_start, f.k_end, f.w, f.u, f.scores, f.whole, h0,
        keep_starts=keep_starts, interpret=interpret,
    )  # fmt: skip
    residuals = (operands, g, f, starts[0]) if keep_starts else None
    return y[..., :value_dim], finals[..., :value_dim, :key_dim], residuals


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _core(q, k, v, gates, initial_states, static, table):
    """The kernels on the token layout; ``static = (op name, interpret)``."""
    y, finals, _ = _forward(
        q, k, v, gates, initial_states, table, keep_starts=False, interpret=static[1]
    )
    return y, finals


def _core_fwd(q, k, v, gates, initial_states, static, table):
    message = limits.SECOND_ORDER.format(op=static[0])
    q, k, v, gates, initial_states = first_order_only(message, (q, k, v, gates, initial_states))
    y, finals, residuals = _forward(
        q, k, v, gates, initial_states, table, keep_starts=True, interpret=static[1]
    )
    return (y, finals), ((q, k, v, gates, initial_states), residuals, table)


def _core_bwd(static, saved, cotangents):
    """The backward kernels on the forward's residuals, then ``_contract``'s pullback."""
    saved, cotangents = first_order_only(
        limits.SECOND_ORDER.format(op=static[0]), (saved, cotangents)
    )
    inputs, (operands, g, f, starts), table = saved
    d_y, d_finals = cotangents
    key_dim, value_dim = inputs[0].shape[-1], inputs[2].shape[-1]
    d_y = tiles.operand(padded(d_y, 2), len(operands[0]))
    d_initial, d_ends = reverse.reverse(
        table, f.q_start, f.k_end, f.w, f.scores, f.whole, d_y,
        padded_states(d_finals), interpret=static[1],
    )  # fmt: skip
    contract_grads = grads.chunk_grads(
        *operands, g, f.scores, f.inverse, d_y, starts, d_ends,
        interpret=static[1],
    )  # fmt: skip
    widths = (key_dim, key_dim, key_dim, value_dim, key_dim)
    contract_grads = tuple(
        d[..., :width].astype(F32) for d, width in zip(contract_grads, widths, strict=True)
    )
    _, pullback = jax.vjp(_contract, *inputs[:4])
    return (*pullback(contract_grads), d_initial[..., :value_dim, :key_dim], None)


_core.defvjp(_core_fwd, _core_bwd)


def run(q, k, v, gates, initial_states, cu_seqlens, *, chunk_size: int, op: str, interpret):
    """KDA or GDN-2 batched by the Mosaic GPU kernels, on ``api.prepare_batched``'s inputs:
    q, k ``[B, T, H, K]`` unscaled, v ``[B, T, HV, V]``, ``gates = (log_alpha [B, T, HV, K],
    beta [B, T, HV])`` (KDA) or ``(log_alpha, b [B, T, HV, K], w [B, T, HV, V])`` (GDN-2),
    ``initial_states [B or N, HV, V, K]`` float32, ``cu_seqlens`` None or ``[N + 1]`` with
    ``B == 1``. Returns ``(o [B, T, HV, V], finals)`` in float32, ``o`` unscaled.
    ``chunk_size`` must be 64, within ``limits.refusals`` (``dispatch`` checks them); ``op``
    names the calling op in errors; ``interpret`` as ``tiles.kernel_call``'s. Differentiable
    once, in reverse mode (``jax.custom_vjp``)."""
    compute = initial_states.dtype
    batch, seq_len = q.shape[:2]
    if batch * seq_len == 0:  # no tokens: every sequence ends as it started
        return jnp.zeros(v.shape, compute), initial_states
    layout = token_layout(batch, seq_len, CHUNK, cu_seqlens)
    q, k, v = (layout.to_tokens(x) for x in (q, k, v))
    gates = tuple(layout.to_tokens(x) for x in gates)
    y, finals = _core(q, k, v, gates, initial_states, (op, interpret), layout.table)
    return layout.from_tokens(y), finals
