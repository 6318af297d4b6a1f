"""The recurrent token mixer behind Gated DeltaNet and its baselines.

Wiring only: projections, short convolutions, gates and the gated output norm around
``gdn_jax.gated_delta_rule`` (or ``simple_gla`` without the delta correction).
The parameter names, shapes and initialisation follow flash-linear-attention's
``GatedDeltaNet``, so parameter counts match for one config. Two switches, ``decay`` and
``delta``, say which parts of the recurrence a mixer has; ``GatedDeltaNet`` has both, the
baselines in ``baselines.py`` drop one or both. What does not depend on the rule (the
decoding methods, the cache, the path to q, k and v) is ``recurrent_layer.RecurrentLayer``'s.
"""

from __future__ import annotations

from typing import no_type_check

import jax
import jax.numpy as jnp
from flax import nnx

from gdn_jax.layers.params import (
    COLUMNS,
    HEAD_DECAY,
    PER_HEAD,
    GateInit,
    NoWeightDecay,
    a_log_init,
    bias_free_linear,
    dt_bias_init,
    gate_law,
    param,
)
from gdn_jax.layers.recurrent_layer import RecurrentCache, RecurrentLayer
from gdn_jax.ops import checks
from gdn_jax.ops.rules.gated_delta import GATED_DELTA
from gdn_jax.ops.rules.simple_gla import SIMPLE_GLA


def head_log_decay(projected, A_log, dt_bias):
    """Gated DeltaNet's decay, one a head and token, in float32: ``log_alpha =
    -exp(A_log) * softplus(a_proj(x) + dt_bias)`` from ``projected = a_proj(x) [B, T, HV]``."""
    rate = jnp.exp(A_log.astype(jnp.float32))[None, None, :]
    dt_bias = dt_bias.astype(jnp.float32)[None, None, :]
    return -rate * jax.nn.softplus(projected.astype(jnp.float32) + dt_bias)


@no_type_check  # checks.py names bad arguments and inputs
class RecurrentMixer(RecurrentLayer):
    """Recurrent token mixer: ``x [B, T, hidden_size] -> [B, T, hidden_size]``.

    In order: bias-free q, k, v projections; causal depthwise convolution with SiLU on each;
    q, k L2-normalised (inside the op); with ``delta``, ``beta = sigmoid(b_proj(x))`` (times 2
    with ``allow_neg_eigval``), else ``beta = 1`` and no correction; with ``decay``,
    ``log_alpha = -exp(A_log) * softplus(a_proj(x) + dt_bias)`` in float32, else
    ``alpha = 1``; the chunked rule with ``scale = head_dim ** -0.5``; a per-head RMSNorm
    gated by ``silu(g_proj(x))`` (plain RMSNorm without ``use_gate``); bias-free ``o_proj``.
    ``a_proj`` and ``b_proj`` read the layer input, not the convolution output.
    ``A_log`` and ``dt_bias`` start from ``gate_init`` (a ``GateInit``; unset fields are
    flash-linear-attention's ``A ~ U(0, 16)`` and ``dt`` log-uniform in ``[1e-3, 0.1]``).
    ``chunk_size``, ``impl`` and ``schedule`` are the op's (``gdn_jax.gated_delta_rule``):
    ``schedule="auto"`` is chosen where the program is lowered, so all three schedules
    (``"hoisted"``, ``"associative"``, ``"in_scan"``) are traced; naming one traces it alone.

    Use one of the named mixers, which fix the two switches: ``GatedDeltaNet``, ``DeltaNet``,
    ``SimpleGatedLinearAttention``, ``LinearAttention``. Each is a ``RecurrentMixer``, not one of
    another, so none inherits an argument it would ignore.
    """

    decay: bool  # alpha_t = exp(log_alpha_t) from a_proj, A_log, dt_bias; else alpha = 1
    delta: bool  # delta-rule correction with beta from b_proj; else S += v k^T

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        *,
        expand_v: float = 2.0,
        num_v_heads: int | None = None,
        use_gate: bool = True,
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
        name = type(self).__name__
        checks.require(
            name,
            hasattr(type(self), "decay") and hasattr(type(self), "delta"),
            "build GatedDeltaNet, DeltaNet, SimpleGatedLinearAttention or LinearAttention, which "
            "say whether the mixer has a decay gate and a delta correction",
        )
        checks.require(
            name,
            self.decay or gate_init is None,
            f"gate_init={gate_init} sets a decay gate's initial law, which {name} does not have",
        )
        law = gate_law(name, gate_init, HEAD_DECAY)
        checks.check_flag(name, allow_neg_eigval=allow_neg_eigval)  # before its truthiness
        checks.require(
            name,
            self.delta or not allow_neg_eigval,
            f"allow_neg_eigval=True widens beta of the delta correction, which {name} does not "
            "have",
        )
        super().__init__(
            hidden_size, num_heads, head_dim, expand_v=expand_v, num_v_heads=num_v_heads,
            use_gate=use_gate, use_short_conv=use_short_conv, conv_size=conv_size,
            conv_bias=conv_bias, allow_neg_eigval=allow_neg_eigval, norm_eps=norm_eps,
            chunk_size=chunk_size, impl=impl, schedule=schedule, dtype=dtype,
            param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs,
            rule=GATED_DELTA if self.delta else SIMPLE_GLA,
        )  # fmt: skip
        linear = bias_free_linear(
            dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs
        )
        heads = self.num_v_heads
        self.a_proj = linear(hidden_size, heads, COLUMNS) if self.decay else None
        self.b_proj = linear(hidden_size, heads, COLUMNS) if self.delta else None
        if self.decay:
            a_log = a_log_init(rngs.params(), (heads,), law, param_dtype)
            dt_bias = dt_bias_init(rngs.params(), (heads,), law, param_dtype)
            self.A_log = param(a_log, PER_HEAD, NoWeightDecay)
            self.dt_bias = param(dt_bias, PER_HEAD, NoWeightDecay)
        self.g_proj = linear(hidden_size, self.value_dim, COLUMNS) if use_gate else None

    def _mix(self, x, *, mask, cu_seqlens, cache, impl):
        # A mesh in context (jax.set_mesh) with a "seq" axis splits T: the convolution takes
        # its halo and the rule its start state from the previous shard.
        seq_mesh = self._seq_mesh(cache, impl)
        q, k, v, real, conv_cache = self._qkv(
            x, mask=mask, cu_seqlens=cu_seqlens, cache=cache, seq_mesh=seq_mesh
        )
        batch, seq_len, _ = x.shape
        gate_shape = (batch, seq_len, self.num_v_heads)
        if self.delta:
            beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
            beta = 2.0 * beta if self.allow_neg_eigval else beta
        else:
            beta = jnp.ones(gate_shape, jnp.float32)
        if self.decay:
            log_alpha = head_log_decay(self.a_proj(x), self.A_log[...], self.dt_bias[...])
        else:
            log_alpha = jnp.zeros(gate_shape, jnp.float32)
        if real is not None:
            beta, log_alpha = jnp.where(real, beta, 0), jnp.where(real, log_alpha, 0)

        o, state = self._recurrence(
            q, k, v, (log_alpha, beta), cu_seqlens=cu_seqlens, cache=cache, impl=impl,
            seq_mesh=seq_mesh,
        )  # fmt: skip
        o = self.o_norm(o)
        if self.use_gate:
            o = o * jax.nn.silu(self.g_proj(x)).reshape(o.shape)
        y = self.o_proj(o.reshape(batch, seq_len, self.value_dim))
        return y, RecurrentCache(conv_cache, state)
