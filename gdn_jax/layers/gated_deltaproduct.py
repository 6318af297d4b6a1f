"""Gated DeltaProduct (Siems et al., 2025): ``num_householder`` delta-rule steps per token,
each with its own key, value and ``beta``, the decay once per token.

Wiring only, around ``gdn_jax.gated_delta_product``. The parameters are
flash-linear-attention's ``GatedDeltaProduct``'s (``fla/layers/gated_deltaproduct.py``), so
the counts match: its ``k_proj``, ``v_proj`` and ``b_proj`` make ``n`` keys, values and betas
a token and its short convolutions run over those. Their columns are head-major,
``(h n d)``, where fla's are step-major, ``(n h d)``: a ``model`` axis over the columns then
splits whole heads and no key or value crosses devices (fla's weights load by permuting
the columns).
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
from gdn_jax.layers.recurrent_mixer import head_log_decay
from gdn_jax.ops import checks
from gdn_jax.ops.rules.gated_delta_product import GATED_DELTA_PRODUCT


@no_type_check  # checks.py names bad arguments and inputs
class GatedDeltaProduct(RecurrentLayer):
    """Gated DeltaProduct token mixer, ``x [B, T, hidden_size] -> [B, T, hidden_size]``.

    In order: bias-free q, k, v projections, k and v with ``n = num_householder`` keys and
    values a token; causal depthwise convolution with SiLU on each; q, k L2-normalised (inside
    the op); ``beta = sigmoid(b_proj(x))``, ``n`` a token and value head (times 2 with
    ``allow_neg_eigval``, on by default as in flash-linear-attention); with
    ``use_forget_gate``, Gated DeltaNet's ``log_alpha = -exp(A_log) * softplus(a_proj(x) +
    dt_bias)`` once a token (``A_log`` and ``dt_bias`` initialised as Gated DeltaNet's, from
    ``gate_init``), else no decay; the rule; a per-head RMSNorm gated by
    ``silu(g_proj(x))`` (plain RMSNorm without ``use_gate``); bias-free ``o_proj``.

    A mesh ``seq`` axis splits it by tokens, each token's steps on its shard
    (``gdn_jax.ops.gated_delta_product_seq_parallel``); a ``model`` axis splits its heads.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        *,
        num_householder: int = 2,
        use_forget_gate: bool = True,
        expand_v: float = 2.0,
        num_v_heads: int | None = None,
        use_gate: bool = True,
        use_short_conv: bool = True,
        conv_size: int = 4,
        conv_bias: bool = False,
        allow_neg_eigval: bool = True,
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
        checks.check_flag(type(self).__name__, use_forget_gate=use_forget_gate)
        checks.require(
            type(self).__name__,
            use_forget_gate or gate_init is None,
            f"gate_init={gate_init} sets the forget gate's initial law; use_forget_gate=False",
        )
        law = gate_law(type(self).__name__, gate_init, HEAD_DECAY)
        checks.check_positive_int(type(self).__name__, num_householder=num_householder)
        super().__init__(
            hidden_size, num_heads, head_dim, expand_v=expand_v, num_v_heads=num_v_heads,
            use_gate=use_gate, use_short_conv=use_short_conv, conv_size=conv_size,
            conv_bias=conv_bias, allow_neg_eigval=allow_neg_eigval, norm_eps=norm_eps,
            chunk_size=chunk_size, impl=impl, schedule=schedule, dtype=dtype,
            param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs,
            rule=GATED_DELTA_PRODUCT, rule_options=dict(num_householder=num_householder),
        )  # fmt: skip
        self.num_householder, self.use_forget_gate = num_householder, use_forget_gate
        linear = bias_free_linear(
            dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs
        )
        heads = self.num_v_heads
        self.b_proj = linear(hidden_size, heads * num_householder, COLUMNS)
        self.a_proj = linear(hidden_size, heads, COLUMNS) if use_forget_gate else None
        if use_forget_gate:
            a_log = a_log_init(rngs.params(), (heads,), law, param_dtype)
            dt_bias = dt_bias_init(rngs.params(), (heads,), law, param_dtype)
            self.A_log = param(a_log, PER_HEAD, NoWeightDecay)
            self.dt_bias = param(dt_bias, PER_HEAD, NoWeightDecay)
        self.g_proj = linear(hidden_size, self.value_dim, COLUMNS) if use_gate else None

    def _mix(self, x, *, mask, cu_seqlens, cache, impl):
        seq_mesh = self._seq_mesh(cache, impl)
        q, k, v, real, conv_cache = self._qkv(
            x, mask=mask, cu_seqlens=cu_seqlens, cache=cache, seq_mesh=seq_mesh
        )
        batch, seq_len, _ = x.shape
        beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
        beta = 2.0 * beta if self.allow_neg_eigval else beta
        log_alpha = None
        if self.use_forget_gate:
            log_alpha = head_log_decay(self.a_proj(x), self.A_log[...], self.dt_bias[...])
        if real is not None:
            beta = jnp.where(real, beta, 0)
            log_alpha = None if log_alpha is None else jnp.where(real, log_alpha, 0)
        beta = self._steps(beta, self.num_v_heads, 1)[..., 0]
        o, state = self._recurrence(
            q, k, v, (log_alpha, beta), cu_seqlens=cu_seqlens, cache=cache, impl=impl,
            seq_mesh=seq_mesh,
        )  # fmt: skip
        o = self.o_norm(o)
        if self.use_gate:
            o = o * jax.nn.silu(self.g_proj(x)).reshape(o.shape)
        y = self.o_proj(o.reshape(batch, seq_len, self.value_dim))
        return y, RecurrentCache(conv_cache, state)
