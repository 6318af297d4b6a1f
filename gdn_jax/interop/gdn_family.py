"""The transformers families whose linear-attention layers are Gated DeltaNet, loaded as
``GatedDeltaNet``: Qwen3-Next, Qwen3.5 (and its siblings) and OLMo-Hybrid.

Every one computes the same function as ``GatedDeltaNet``: SiLU after the convolution, q and
k L2-normalised (eps 1e-6), ``scale = K ** -0.5``, ``beta = sigmoid(b)`` (times 2 with
``allow_neg_eigval``), ``log_alpha = -exp(A_log) * softplus(a + dt_bias)``, value head
``i*R + j`` reading key head ``i``, and an RMSNorm gated by ``silu(g)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

from gdn_jax.interop.family import Family, check_activation, check_gated_short_conv, require_keys
from gdn_jax.layers.gated_deltanet import GatedDeltaNet
from gdn_jax.ops import checks

COUNT_KEYS = (
    "hidden_size",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetFamily(Family):
    """A family whose linear-attention layers are ``GatedDeltaNet``s.

    Attributes (besides ``Family``'s):
      norm_eps: the output norm's epsilon when the layer fixes it; ``None`` reads
        ``rms_norm_eps`` from the config.
      neg_eigval_key: the config field for ``allow_neg_eigval`` (its default ``True``);
        ``None`` for a family whose beta lies in (0, 1).
    """

    layer_class: ClassVar[type] = GatedDeltaNet

    norm_eps: float | None = None
    neg_eigval_key: str | None = None

    def config_kwargs(self, fn: str, config: Mapping) -> dict:
        require_keys(fn, config, COUNT_KEYS + (() if self.norm_eps else ("rms_norm_eps",)))
        check_activation(fn, config, "hidden_act", "output_gate_type")
        checks.check_positive_int(fn, **{f"config {key}": config[key] for key in COUNT_KEYS})
        norm_eps = self.norm_eps or config["rms_norm_eps"]
        checks.check_positive_number(fn, rms_norm_eps=norm_eps)
        neg_eigval = bool(self.neg_eigval_key) and config.get(self.neg_eigval_key, True)
        if not isinstance(neg_eigval, bool):
            raise ValueError(
                f"{fn}: config {self.neg_eigval_key} must be a bool, got {neg_eigval!r}"
            )
        key_dim, value_dim = config["linear_key_head_dim"], config["linear_value_head_dim"]
        heads, v_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
        if value_dim / key_dim * key_dim != value_dim:
            raise ValueError(
                f"{fn}: linear_value_head_dim={value_dim} is not an exact float multiple of "
                f"linear_key_head_dim={key_dim}"
            )
        if v_heads % heads:
            raise ValueError(
                f"{fn}: config linear_num_value_heads={v_heads} must be a multiple "
                f"of linear_num_key_heads={heads}"
            )
        return dict(
            hidden_size=config["hidden_size"],
            num_heads=heads,
            head_dim=key_dim,
            num_v_heads=v_heads,
            expand_v=value_dim / key_dim,
            use_gate=True,
            use_short_conv=True,
            conv_size=config["linear_conv_kernel_dim"],
            conv_bias=False,
            allow_neg_eigval=neg_eigval,
            norm_eps=norm_eps,
        )

    def check_form(self, fn: str, layer: GatedDeltaNet, tensors: Mapping) -> None:
        check_gated_short_conv(self, fn, layer, tensors)
        if layer.allow_neg_eigval and not self.neg_eigval_key:
            raise ValueError(f"{fn}: {self.title}'s beta lies in (0, 1); allow_neg_eigval=True")
        if self.norm_eps and layer.o_norm.epsilon != self.norm_eps:
            raise ValueError(
                f"{fn}: {self.title}'s output norm has eps {self.norm_eps}; this layer's has "
                f"norm_eps={layer.o_norm.epsilon}"
            )
