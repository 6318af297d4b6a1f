"""Kimi Delta Attention (Kimi Linear, arXiv 2510.26692, Sec. 3): the delta rule with one
decay per key channel,
``S_t = S_{t-1} Diag(alpha_t) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T``.

Wiring only, around ``gdn_jax.kda``. The parameter names and shapes follow
flash-linear-attention's ``KimiDeltaAttention`` (its ``f_proj`` and ``g_proj`` pairs are
``f_a_proj``, ``f_b_proj`` and ``g_a_proj``, ``g_b_proj`` here), so parameter counts match
for one config; options cover the layers of transformers' Kimi-Linear, Bailing-hybrid and
GLM-5 Next, which drop the output gate's bias, make both gates full rank (Bailing) or bound
the forget gate below (Bailing, GLM-5 Next).
"""

from __future__ import annotations

import functools
from typing import no_type_check

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

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
from gdn_jax.ops.rules.kda import KDA


def kda_log_decay(
    gate: Float[Array, "B T HV K"],
    A_log: Float[Array, " HV"],
    dt_bias: Float[Array, "HV K"],
    lower_bound: float | None,
) -> Float[Array, "B T HV K"]:
    """The per-channel log-decay from the forget gate's projection ``f``, in float32.

    Without a bound, ``log_alpha = -exp(A_log) * softplus(f + dt_bias)`` (Gated DeltaNet's
    gate, per channel), which reaches ``-inf``. With ``lower_bound = L < 0``,
    ``log_alpha = L * sigmoid(exp(A_log) * (f + dt_bias))``, in ``(L, 0)``: each step keeps
    at least ``exp(L)`` of every channel (flash-linear-attention's ``lower_bound``).
    """
    f = gate.astype(jnp.float32) + dt_bias.astype(jnp.float32)[None, None]
    rate = jnp.exp(A_log.astype(jnp.float32))[None, None, :, None]
    if lower_bound is None:
        return -rate * jax.nn.softplus(f)
    return lower_bound * jax.nn.sigmoid(rate * f)


@no_type_check  # checks.py names bad arguments and inputs
class KimiDeltaAttention(RecurrentLayer):
    """Kimi Delta Attention token mixer, ``x [B, T, hidden_size] -> [B, T, hidden_size]``.

    In order: bias-free q, k, v projections; causal depthwise convolution with SiLU on each;
    q, k L2-normalised (inside the op); ``beta = sigmoid(b_proj(x))`` per value head (times 2
    with ``allow_neg_eigval``); the forget gate ``f = f_b_proj(f_a_proj(x))`` (rank
    ``head_v_dim``; ``f_proj(x)`` without ``low_rank_gates``), one value per value head and
    key channel, into ``kda_log_decay`` with ``A_log`` per value head and ``dt_bias`` per
    channel; the rule with ``scale = head_dim ** -0.5``; a per-head RMSNorm gated by
    ``sigmoid(g_b_proj(g_a_proj(x)))`` (``g_b_proj`` with a bias when
    ``output_gate_bias``; ``g_proj(x)`` without ``low_rank_gates``; plain RMSNorm without
    ``use_gate``, where ``output_gate_bias`` has nothing to add to); bias-free ``o_proj``. The gates read the layer input, not the convolution
    output.

    Initialisation as flash-linear-attention's by default (``gate_init``, a ``GateInit``,
    changes the ranges): ``A_log = log U(1, 16)`` (zeros with a ``gate_lower_bound``, where
    ``exp(A_log)`` scales the sigmoid's input), ``dt_bias`` the inverse softplus of a
    log-uniform ``dt`` in ``[1e-3, 0.1]``, the output gate's bias zero.
    ``chunk_size``, ``impl`` and ``schedule`` are the op's (``gdn_jax.kda``), as in
    ``GatedDeltaNet``.

    A mesh ``model`` axis splits it by heads like ``GatedDeltaNet`` (the low-rank ``f_a_proj``
    and ``g_a_proj`` are whole on every device), and a mesh ``seq`` axis by tokens: the state
    and the convolution's halo cross the shard boundaries (``gdn_jax.ops.kda_seq_parallel``).
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
        low_rank_gates: bool = True,
        output_gate_bias: bool = True,
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
        checks.check_flag(
            type(self).__name__, low_rank_gates=low_rank_gates, output_gate_bias=output_gate_bias
        )
        law = gate_law(type(self).__name__, gate_init, CHANNEL_DECAY)
        checks.check_lower_bound(type(self).__name__, "gate_lower_bound", gate_lower_bound)
        super().__init__(
            hidden_size, num_heads, head_dim, expand_v=expand_v, num_v_heads=num_v_heads,
            use_gate=use_gate, use_short_conv=use_short_conv, conv_size=conv_size,
            conv_bias=conv_bias, allow_neg_eigval=allow_neg_eigval, norm_eps=norm_eps,
            chunk_size=chunk_size, impl=impl, schedule=schedule, dtype=dtype,
            param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs, rule=KDA,
        )  # fmt: skip
        self.gate_dim = self.num_v_heads * head_dim  # one decay per value head and key channel
        self.low_rank_gates = low_rank_gates
        self.gate_lower_bound = None if gate_lower_bound is None else float(gate_lower_bound)
        linear = bias_free_linear(
            dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs
        )
        # The low-rank factors' inner features are no heads: whole on every device.
        rank = self.head_v_dim
        self.f_a_proj = linear(hidden_size, rank) if low_rank_gates else None
        self.f_b_proj = linear(rank, self.gate_dim, COLUMNS) if low_rank_gates else None
        self.f_proj = None if low_rank_gates else linear(hidden_size, self.gate_dim, COLUMNS)
        self.b_proj = linear(hidden_size, self.num_v_heads, COLUMNS)
        if gate_lower_bound is None:
            a_log = a_log_init(rngs.params(), (self.num_v_heads,), law, param_dtype)
        else:
            a_log = jnp.zeros((self.num_v_heads,), param_dtype)
        dt_bias = dt_bias_init(rngs.params(), (self.gate_dim,), law, param_dtype)
        self.A_log = param(a_log, PER_HEAD, NoWeightDecay)
        self.dt_bias = param(dt_bias, PER_HEAD, NoWeightDecay)

        # Each assigned once: NNX fixes an attribute's data/static status at first assignment.
        low_rank_output = use_gate and low_rank_gates
        self.g_a_proj = linear(hidden_size, rank) if low_rank_output else None
        gate_out = functools.partial(
            gate_linear,
            out_features=self.value_dim,
            use_bias=output_gate_bias,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=kernel_init,
            rngs=rngs,
        )
        self.g_b_proj = gate_out(rank) if low_rank_output else None
        self.g_proj = gate_out(hidden_size) if use_gate and not low_rank_gates else None

    def _mix(self, x, *, mask, cu_seqlens, cache, impl):
        # A mesh in context (jax.set_mesh) with a "seq" axis splits T, as in GatedDeltaNet.
        seq_mesh = self._seq_mesh(cache, impl)
        q, k, v, real, conv_cache = self._qkv(
            x, mask=mask, cu_seqlens=cu_seqlens, cache=cache, seq_mesh=seq_mesh
        )
        batch, seq_len, _ = x.shape
        beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
        beta = 2.0 * beta if self.allow_neg_eigval else beta
        gate = self.f_proj(x) if self.f_proj is not None else self.f_b_proj(self.f_a_proj(x))
        log_alpha = kda_log_decay(
            gate.reshape(batch, seq_len, self.num_v_heads, self.head_dim),
            self.A_log[...],
            self.dt_bias[...].reshape(self.num_v_heads, self.head_dim),
            self.gate_lower_bound,
        )
        if real is not None:
            beta, log_alpha = jnp.where(real, beta, 0), jnp.where(real[..., None], log_alpha, 0)
        o, state = self._recurrence(
            q, k, v, (log_alpha, beta), cu_seqlens=cu_seqlens, cache=cache, impl=impl,
            seq_mesh=seq_mesh,
        )  # fmt: skip
        o = self.o_norm(o)
        if self.use_gate:
            g = self.g_proj(x) if self.g_proj is not None else self.g_b_proj(self.g_a_proj(x))
            o = o * jax.nn.sigmoid(g).reshape(o.shape)
        y = self.o_proj(o.reshape(batch, seq_len, self.value_dim))
        return y, RecurrentCache(conv_cache, state)
