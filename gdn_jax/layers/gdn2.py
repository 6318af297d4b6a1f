"""Gated DeltaNet-2 (GDN-2; NVlabs, arXiv 2605.22791): KDA's scalar ``beta`` split into a
channel-wise erase gate ``b`` on the key axis and a write gate ``w`` on the value axis,
``S_t = S_{t-1} Diag(alpha_t) - (S_{t-1} Diag(alpha_t) (b_t * k_t)) k_t^T + (w_t * v_t) k_t^T``.

Wiring only, around ``gdn_jax.gdn2``. The parameters follow flash-linear-attention's
``GatedDeltaNet2`` (``fla/layers/gdn2.py``; its ``f_proj`` and ``g_proj`` pairs are
``f_a_proj``, ``f_b_proj`` and ``g_a_proj``, ``g_b_proj`` here, as in
``KimiDeltaAttention``), so parameter counts match for one config.
"""

from __future__ import annotations

from typing import no_type_check

import jax
import jax.numpy as jnp
from flax import nnx

from gdn_jax.layers.kda import kda_log_decay
from gdn_jax.layers.params import (
    CHANNEL_DECAY,
    COLUMNS,
    PER_HEAD,
    GateInit,
    NoWeightDecay,
    a_log_init,
    bias_free_linear,
    dt_bias_init,
    gate_law,
    gate_linear,
    param,
)
from gdn_jax.layers.recurrent_layer import RecurrentCache, RecurrentLayer
from gdn_jax.ops import checks
from gdn_jax.ops.rules.gdn2 import GDN2


@no_type_check  # checks.py names bad arguments and inputs
class GatedDeltaNet2(RecurrentLayer):
    """Gated DeltaNet-2 token mixer, ``x [B, T, hidden_size] -> [B, T, hidden_size]``.

    In order: bias-free q, k, v projections; causal depthwise convolution with SiLU on each;
    q, k L2-normalised (inside the op); per key head and key channel, the erase gate ``b =
    sigmoid(b_proj(x))`` (times 2 with ``allow_neg_eigval``) and the decay ``f =
    f_b_proj(f_a_proj(x))`` (rank ``head_v_dim``) into ``kda_log_decay`` with ``A_log`` per
    key head and ``dt_bias`` per channel, both shared by the key head's value heads; per
    value channel the write gate ``w = sigmoid(w_proj(x))``; the rule with ``scale =
    head_dim ** -0.5``; a per-head RMSNorm gated by ``sigmoid(g_b_proj(g_a_proj(x)))``
    (``g_b_proj`` with a bias; plain RMSNorm without ``use_gate``); bias-free ``o_proj``.
    The gates read the layer input, not the convolution output.

    Initialisation as flash-linear-attention's by default (``gate_init``, a ``GateInit``,
    changes the ranges): ``A_log = log U(1, 16)`` (zeros with a ``gate_lower_bound``, as in
    ``KimiDeltaAttention``, which bounds each step's decay below by
    ``exp(gate_lower_bound)``), ``dt_bias`` the inverse softplus of a log-uniform ``dt`` in
    ``[1e-3, 0.1]``, the output gate's bias zero. ``chunk_size``, ``impl`` and
    ``schedule`` are the op's (``gdn_jax.gdn2``).

    A mesh ``model`` axis splits it by heads (the low-rank ``f_a_proj`` and ``g_a_proj`` are
    whole on every device), a mesh ``seq`` axis by tokens (``gdn_jax.ops.gdn2_seq_parallel``).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        *,
        expand_v: float = 1.0,
        num_v_heads: int | None = None,
        use_gate: bool = True,
        gate_lower_bound: float | None = None,
        use_short_conv: bool = True,
        conv_size: int = 4,
        conv_bias: bool = False,
        allow_neg_eigval: bool = False,
        norm_eps: float = 1e-5,
        chunk_size: int = 64,
        impl: checks.Impl = "auto",
        schedule: checks.Schedule = "auto",
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        kernel_init=None,
        gate_init: GateInit | None = None,
        rngs: nnx.Rngs,
    ):
        law = gate_law(type(self).__name__, gate_init, CHANNEL_DECAY)
        checks.check_lower_bound(type(self).__name__, "gate_lower_bound", gate_lower_bound)
        super().__init__(
            hidden_size, num_heads, head_dim, expand_v=expand_v, num_v_heads=num_v_heads,
            use_gate=use_gate, use_short_conv=use_short_conv, conv_size=conv_size,
            conv_bias=conv_bias, allow_neg_eigval=allow_neg_eigval, norm_eps=norm_eps,
            chunk_size=chunk_size, impl=impl, schedule=schedule, dtype=dtype,
            param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs, rule=GDN2,
        )  # fmt: skip
        self.gate_lower_bound = None if gate_lower_bound is None else float(gate_lower_bound)
        linear = bias_free_linear(
            dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs
        )
        # The low-rank factors' inner features are no heads: whole on every device.
        rank = self.head_v_dim
        self.f_a_proj = linear(hidden_size, rank)
        self.f_b_proj = linear(rank, self.key_dim, COLUMNS)
        self.b_proj = linear(hidden_size, self.key_dim, COLUMNS)
        self.w_proj = linear(hidden_size, self.value_dim, COLUMNS)
        if gate_lower_bound is None:
            a_log = a_log_init(rngs.params(), (num_heads,), law, param_dtype)
        else:
            a_log = jnp.zeros((num_heads,), param_dtype)
        dt_bias = dt_bias_init(rngs.params(), (self.key_dim,), law, param_dtype)
        self.A_log = param(a_log, PER_HEAD, NoWeightDecay)
        self.dt_bias = param(dt_bias, PER_HEAD, NoWeightDecay)
        # Each assigned once: NNX fixes an attribute's data/static status at first assignment.
        self.g_a_proj = linear(hidden_size, rank) if use_gate else None
        gate_out = (
            gate_linear(
                rank,
                self.value_dim,
                use_bias=True,
                dtype=dtype,
                param_dtype=param_dtype,
                kernel_init=kernel_init,
                rngs=rngs,
            )
            if use_gate
            else None
        )
        self.g_b_proj = gate_out

    def _gates(self, x, real):
        """``(log_alpha [B, T, HV, K], b [B, T, HV, K], w [B, T, HV, V])`` in float32: the key
        heads' decay and erase gate repeated over their value heads, nothing on padding."""
        batch, seq_len, _ = x.shape
        heads, group = self.num_heads, self.num_v_heads // self.num_heads
        key_heads = (batch, seq_len, heads, self.head_dim)
        log_alpha = kda_log_decay(
            self.f_b_proj(self.f_a_proj(x)).reshape(key_heads),
            self.A_log[...],
            self.dt_bias[...].reshape(heads, self.head_dim),
            self.gate_lower_bound,
        )
        b = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32)).reshape(key_heads)
        b = 2.0 * b if self.allow_neg_eigval else b
        log_alpha, b = (jnp.repeat(z, group, axis=2) for z in (log_alpha, b))
        w = jax.nn.sigmoid(self.w_proj(x).astype(jnp.float32))
        w = w.reshape(batch, seq_len, self.num_v_heads, self.head_v_dim)
        if real is not None:
            keep = real[..., None]
            log_alpha, b, w = (jnp.where(keep, z, 0) for z in (log_alpha, b, w))
        return log_alpha, b, w

    def _mix(self, x, *, mask, cu_seqlens, cache, impl):
        # A mesh in context (jax.set_mesh) with a "seq" axis splits T, as in GatedDeltaNet.
        seq_mesh = self._seq_mesh(cache, impl)
        q, k, v, real, conv_cache = self._qkv(
            x, mask=mask, cu_seqlens=cu_seqlens, cache=cache, seq_mesh=seq_mesh
        )
        batch, seq_len, _ = x.shape
        o, state = self._recurrence(
            q, k, v, self._gates(x, real), cu_seqlens=cu_seqlens, cache=cache, impl=impl,
            seq_mesh=seq_mesh,
        )  # fmt: skip
        o = self.o_norm(o)
        if self.use_gate:
            o = o * jax.nn.sigmoid(self.g_b_proj(self.g_a_proj(x))).reshape(o.shape)
        y = self.o_proj(o.reshape(batch, seq_len, self.value_dim))
        return y, RecurrentCache(conv_cache, state)
