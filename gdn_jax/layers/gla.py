"""Gated linear attention (GLA; Yang et al., ICML 2024, arXiv 2312.06635): linear attention
with one decay per key channel, ``S_t = S_{t-1} Diag(alpha_t) + v_t k_t^T``.

Wiring only, around ``gdn_jax.gated_linear_attention``. The constructor takes
flash-linear-attention's ``GatedLinearAttention`` arguments and builds its parameters under
its names and shapes (``gk_proj``'s two linears are ``gk_a_proj`` and ``gk_b_proj`` here, its
``g_norm`` or ``g_norm_swish_gate`` is ``o_norm``), so parameter counts match for every
config. The scalar-gated layer that had this name before is ``SimpleGatedLinearAttention``;
a call in its old form (with ``head_dim``) still builds it, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import fractions
from typing import Literal, no_type_check

import jax
import jax.numpy as jnp
from flax import nnx

from gdn_jax.layers.baselines import SimpleGatedLinearAttention
from gdn_jax.layers.params import COLUMNS, bias_free_linear, gate_linear
from gdn_jax.layers.recurrent_layer import RecurrentCache, RecurrentLayer, short_convolutions
from gdn_jax.ops import checks
from gdn_jax.ops.renamed import warn_renamed
from gdn_jax.ops.rules.gla import GLA

# flash-linear-attention's activation names (its ``ACT2FN``) that its GLA layer's
# ``feature_map`` and ``gate_fn`` take here.
ACTIVATIONS = {
    "swish": jax.nn.silu,
    "silu": jax.nn.silu,
    "sigmoid": jax.nn.sigmoid,
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
    "tanh": jnp.tanh,
    "elu": jax.nn.elu,
    "identity": lambda x: x,
}
Activation = Literal["swish", "silu", "sigmoid", "relu", "gelu", "tanh", "elu", "identity"]


def gla_log_decay(logits, normalizer: float, clamp_min: float | None):
    """GLA's per-channel log-decay, in float32: ``logsigmoid(logits) / normalizer``, at
    least ``clamp_min`` when given."""
    log_alpha = jax.nn.log_sigmoid(logits.astype(jnp.float32)) / normalizer
    return log_alpha if clamp_min is None else jnp.maximum(log_alpha, clamp_min)


class _OldForm(type(nnx.Module)):
    """Builds ``SimpleGatedLinearAttention`` for a call of ``GatedLinearAttention`` in the
    scalar-gated layer's old form (``hidden_size, num_heads, head_dim``), which it held
    before GLA took the name; the new form takes ``hidden_size`` alone positionally."""

    def __call__(cls, *args, **kwargs):
        if cls is GatedLinearAttention and (len(args) > 1 or "head_dim" in kwargs):
            warn_renamed(
                "GatedLinearAttention(hidden_size, num_heads, head_dim, ...) (the scalar-gated "
                "layer)",
                "SimpleGatedLinearAttention",
            )
            return SimpleGatedLinearAttention(*args, **kwargs)
        return super().__call__(*args, **kwargs)


@no_type_check  # checks.py names bad arguments and inputs
class GatedLinearAttention(RecurrentLayer, metaclass=_OldForm):
    """Gated linear attention token mixer, ``x [B, T, hidden_size] -> [B, T, hidden_size]``,
    as flash-linear-attention's ``GatedLinearAttention`` layer computes it.

    In order: bias-free ``q_proj`` to ``key_dim = int(hidden_size * expand_k)`` features,
    ``k_proj`` and ``v_proj`` to those of ``num_kv_heads`` heads (``key_dim`` and
    ``value_dim = int(hidden_size * expand_v)`` over ``num_heads / num_kv_heads``), each
    through a causal depthwise convolution with SiLU with ``use_short_conv``; the key and
    value heads repeated to ``num_heads`` (each serves ``num_heads / num_kv_heads`` query
    heads in a row); ``feature_map`` on q and k; the decay ``log_alpha =
    logsigmoid(gk_b_proj(gk_a_proj(x))) / gate_logit_normalizer`` (rank
    ``gate_low_rank_dim``, ``gk_b_proj`` with a bias), at least ``clamp_min``, per key
    channel; the rule with ``scale = head_k_dim ** -0.5`` and no L2 norm; a per-head
    RMSNorm (with a weight when ``elementwise_affine``) times ``gate_fn(g_proj(x))`` with
    ``use_output_gate`` (``fuse_norm`` fuses the two in flash-linear-attention's kernels:
    the same values here); bias-free ``o_proj``. ``dtype``, ``param_dtype`` and
    ``kernel_init`` (the projections' initialiser, Flax's LeCun normal when ``None``) are as
    in ``GatedDeltaNet``.

    Args:
      hidden_size: ``D``.
      expand_k: ``key_dim / hidden_size``.
      expand_v: ``value_dim / hidden_size``.
      num_heads: query heads (``H = HV`` of the rule).
      num_kv_heads: key and value heads, a divisor of ``num_heads``; ``None`` is
        ``num_heads``.
      feature_map: an activation name (``ACTIVATIONS``) applied to q and k, or ``None``.
      use_short_conv: causal depthwise convolutions on q, k and v.
      conv_size: their width ``W``.
      conv_bias: whether they have a bias.
      use_output_gate: gate the normed output with ``gate_fn(g_proj(x))``.
      gate_fn: the output gate's activation name.
      elementwise_affine: whether the output norm has a weight.
      norm_eps: the output norm's epsilon.
      gate_logit_normalizer: divides the decay's ``logsigmoid``.
      gate_low_rank_dim: the rank of the decay's projection.
      clamp_min: a floor (``< 0``) on each log-decay, or ``None``.
      fuse_norm: flash-linear-attention's kernel choice; the values are the same.
      chunk_size: the op's (``gdn_jax.gated_linear_attention``), as ``impl`` and
        ``schedule``, which replace flash-linear-attention's ``mode``.
      impl: see ``chunk_size``.
      schedule: see ``chunk_size``.
      rngs: the random streams.
    """

    qk_l2norm = False

    def __init__(
        self,
        hidden_size: int = 1024,
        *,
        expand_k: float = 0.5,
        expand_v: float = 1.0,
        num_heads: int = 4,
        num_kv_heads: int | None = None,
        feature_map: Activation | None = None,
        use_short_conv: bool = False,
        conv_size: int = 4,
        conv_bias: bool = False,
        use_output_gate: bool = True,
        gate_fn: Activation = "swish",
        elementwise_affine: bool = True,
        norm_eps: float = 1e-5,
        gate_logit_normalizer: float = 16,
        gate_low_rank_dim: int = 16,
        clamp_min: float | None = None,
        fuse_norm: bool = True,
        chunk_size: int = 64,
        impl: checks.Impl = "auto",
        schedule: checks.Schedule = "auto",
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        kernel_init=None,
        rngs: nnx.Rngs,
    ):
        name = type(self).__name__
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        head_k_dim, head_v_dim = _head_dims(
            name, hidden_size, expand_k, expand_v, num_heads, num_kv_heads
        )
        checks.check_positive_int(name, gate_low_rank_dim=gate_low_rank_dim)
        checks.check_positive_number(name, gate_logit_normalizer=gate_logit_normalizer)
        checks.check_flag(
            name, use_output_gate=use_output_gate, elementwise_affine=elementwise_affine,
            fuse_norm=fuse_norm,
        )  # fmt: skip
        for option, value in (("feature_map", feature_map), ("gate_fn", gate_fn)):
            allowed = value in ACTIVATIONS or (option == "feature_map" and value is None)
            checks.require(name, allowed, f"{option}={value!r} must be one of {list(ACTIVATIONS)}")
        if clamp_min is not None:
            checks.check_lower_bound(name, "clamp_min", clamp_min)
        super().__init__(
            hidden_size, num_heads, head_k_dim, expand_v=fractions.Fraction(head_v_dim, head_k_dim),
            num_v_heads=None, use_gate=use_output_gate, use_short_conv=use_short_conv,
            conv_size=conv_size, conv_bias=conv_bias, allow_neg_eigval=False, norm_eps=norm_eps,
            chunk_size=chunk_size, impl=impl, schedule=schedule, dtype=dtype,
            param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs, rule=GLA,
        )  # fmt: skip
        self.num_kv_heads, self.groups = num_kv_heads, num_heads // num_kv_heads
        self.feature_map, self.gate_fn = feature_map, gate_fn
        self.gate_logit_normalizer = float(gate_logit_normalizer)
        self.clamp_min = None if clamp_min is None else float(clamp_min)
        self.fuse_norm = fuse_norm
        linear = bias_free_linear(
            dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs
        )
        # k and v of num_kv_heads heads (RecurrentLayer built them for num_heads).
        self.widths = (self.key_dim, self.key_dim // self.groups, self.value_dim // self.groups)
        self.k_proj = linear(hidden_size, self.widths[1], COLUMNS)
        self.v_proj = linear(hidden_size, self.widths[2], COLUMNS)
        if use_short_conv:
            self.q_conv1d, self.k_conv1d, self.v_conv1d = short_convolutions(
                self.widths, conv_size=conv_size, conv_bias=conv_bias, dtype=dtype,
                param_dtype=param_dtype, rngs=rngs,
            )  # fmt: skip
        if not elementwise_affine:
            self.o_norm = nnx.RMSNorm(
                head_v_dim, epsilon=norm_eps, use_scale=False, dtype=dtype,
                param_dtype=param_dtype, rngs=rngs,
            )  # fmt: skip
        self.gk_a_proj = linear(hidden_size, gate_low_rank_dim)  # whole on every device
        self.gk_b_proj = gate_linear(
            gate_low_rank_dim, self.widths[1], use_bias=True, dtype=dtype,
            param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs,
        )  # fmt: skip
        self.g_proj = linear(hidden_size, self.value_dim, COLUMNS) if use_output_gate else None

    def _steps(self, z, heads, width):
        """``z [B, T, kv_heads * width]`` as ``[B, T, heads, width]``: each of the
        ``num_kv_heads`` heads repeated for the ``groups`` query heads it serves."""
        batch, seq_len, _ = z.shape
        return jnp.repeat(z.reshape(batch, seq_len, heads // self.groups, width), self.groups, 2)

    def _mix(self, x, *, mask, cu_seqlens, cache, impl):
        seq_mesh = self._seq_mesh(cache, impl)
        q, k, v, real, conv_cache = self._qkv(
            x, mask=mask, cu_seqlens=cu_seqlens, cache=cache, seq_mesh=seq_mesh
        )
        batch, seq_len, _ = x.shape
        if self.feature_map is not None:
            q, k = ACTIVATIONS[self.feature_map](q), ACTIVATIONS[self.feature_map](k)
        logits = self._steps(self.gk_b_proj(self.gk_a_proj(x)), self.num_heads, self.head_dim)
        log_alpha = gla_log_decay(logits, self.gate_logit_normalizer, self.clamp_min)
        if real is not None:  # a padded token neither decays nor writes
            log_alpha, v = (
                jnp.where(real[..., None], log_alpha, 0),
                jnp.where(real[..., None], v, 0),
            )
        o, state = self._recurrence(
            q, k, v, (log_alpha,), cu_seqlens=cu_seqlens, cache=cache, impl=impl,
            seq_mesh=seq_mesh,
        )  # fmt: skip
        o = self.o_norm(o)
        if self.use_gate:
            o = o * ACTIVATIONS[self.gate_fn](self.g_proj(x)).reshape(o.shape)
        y = self.o_proj(o.reshape(batch, seq_len, self.value_dim))
        return y, RecurrentCache(conv_cache, state)


def _head_dims(name, hidden_size, expand_k, expand_v, num_heads, num_kv_heads):
    """``(head_k_dim, head_v_dim)`` of flash-linear-attention's GLA layer, checked: ``key_dim
    = int(hidden_size * expand_k)`` and ``value_dim`` likewise, each split evenly over
    ``num_heads``, which ``num_kv_heads`` divides."""
    checks.check_positive_int(
        name, hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads
    )
    checks.check_positive_number(name, expand_k=expand_k, expand_v=expand_v)
    checks.require(
        name,
        num_heads % num_kv_heads == 0,
        f"num_kv_heads={num_kv_heads} must divide num_heads={num_heads}",
    )
    dims = []
    for what, expand in (("key", expand_k), ("value", expand_v)):
        total = int(hidden_size * expand)  # as flash-linear-attention rounds it
        checks.require(
            name,
            total > 0 and total % num_heads == 0,
            f"{what} dim int(hidden_size * expand_{what[0]}) = {total} must be a positive "
            f"multiple of num_heads={num_heads}",
        )
        dims.append(total // num_heads)
    return tuple(dims)
