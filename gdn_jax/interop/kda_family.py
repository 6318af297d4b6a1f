"""The transformers families whose linear-attention layers are Kimi Delta Attention, loaded as
``KimiDeltaAttention``: Kimi-Linear, Bailing-hybrid (Ling) and GLM-5 Next.

Their layers compute ``KimiDeltaAttention``'s function with one head count and one head dim
for q, k and v (``HV = H``, ``V = K``), SiLU after the convolution, q and k L2-normalised (eps
1e-6), ``scale = K ** -0.5``, ``beta = sigmoid(b_proj(x))`` in (0, 1), the forget gate of
``kda_log_decay`` and an RMSNorm (eps ``rms_norm_eps``) gated by ``sigmoid(g)``, where ``g``
has no bias (flash-linear-attention's layer has one). They keep the layer's tensor names but
for the fused convolution ``conv1d`` over ``[q | k | v]`` and a ``forget_gate.`` module that
holds ``f_*``, ``dt_bias`` and ``A_log``; checkpoints store both as flash-linear-attention
does (``q_conv1d``, ..., ``f_a_proj``, ... at the layer's top), which loading maps as
transformers does.

Each family's config names its fields its own way (and a ``config.json`` differently from the
loaded config's ``to_dict()``); its ``config_view`` fills in ``KDA_KEYS`` and
``LOWER_BOUND`` the way transformers' config class does on load.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import ClassVar

from gdn_jax.interop.family import (
    QKV_CONV,
    Family,
    check_activation,
    check_gated_short_conv,
    require_keys,
)
from gdn_jax.layers.kda import KimiDeltaAttention
from gdn_jax.ops import checks

KDA_KEYS = ("hidden_size", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim")
# After config_view: the forget gate's lower bound, or None (absent) for the unbounded gate.
LOWER_BOUND = "linear_lower_bound"


def kda_tensors(*, low_rank_gates: bool) -> tuple[dict, dict]:
    """``(tensors, stored_as)`` of a family layer: its state dict's names (with the forget
    gate's under ``forget_gate.``) to ``KimiDeltaAttention``'s, and the forget gate's tensors
    to the names checkpoints store them under."""
    forget = ("f_a_proj.weight", "f_b_proj.weight") if low_rank_gates else ("f_proj.weight",)
    output = ("g_a_proj.weight", "g_b_proj.weight") if low_rank_gates else ("g_proj.weight",)
    same = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "b_proj.weight", *output)
    same += ("o_norm.weight", "o_proj.weight")
    gate = (*forget, "dt_bias", "A_log")
    tensors = {name: (name,) for name in same}
    tensors["conv1d.weight"] = QKV_CONV
    tensors.update({f"forget_gate.{name}": (name,) for name in gate})
    return tensors, {f"forget_gate.{name}": name for name in gate}


@dataclasses.dataclass(frozen=True)
class KDAFamily(Family):
    """A family whose linear-attention layers are ``KimiDeltaAttention``s.

    Attributes (besides ``Family``'s):
      low_rank_gates: the forget and output gates are rank-``K`` pairs (``f_a_proj``,
        ``f_b_proj``, ...), else one projection each (``f_proj``, ``g_proj``).
      bounded: the config may bound the forget gate below (``LOWER_BOUND``).
      view: the family's ``config_view``, ``(fn, text config) -> config`` with ``KDA_KEYS``
        and ``LOWER_BOUND`` filled in.
    """

    layer_class: ClassVar[type] = KimiDeltaAttention

    low_rank_gates: bool = True
    bounded: bool = False
    view: Callable[[str, Mapping], Mapping] | None = None

    def config_view(self, fn: str, config: Mapping) -> Mapping:
        return config if self.view is None else self.view(fn, config)

    def config_kwargs(self, fn: str, config: Mapping) -> dict:
        require_keys(fn, config, (*KDA_KEYS, "rms_norm_eps"))
        check_activation(fn, config, "hidden_act")
        checks.check_positive_int(fn, **{f"config {key}": config[key] for key in KDA_KEYS})
        checks.check_positive_number(fn, rms_norm_eps=config["rms_norm_eps"])
        bound = config.get(LOWER_BOUND) if self.bounded else None
        checks.check_lower_bound(fn, f"config {LOWER_BOUND}", bound)
        heads, head_dim = config["linear_num_heads"], config["linear_head_dim"]
        return dict(
            hidden_size=config["hidden_size"],
            num_heads=heads,
            head_dim=head_dim,
            expand_v=1.0,
            num_v_heads=heads,
            use_gate=True,
            low_rank_gates=self.low_rank_gates,
            output_gate_bias=False,
            gate_lower_bound=bound,
            use_short_conv=True,
            conv_size=config["linear_conv_kernel_dim"],
            conv_bias=False,
            allow_neg_eigval=False,
            norm_eps=config["rms_norm_eps"],
        )

    def check_form(self, fn: str, layer: KimiDeltaAttention, tensors: Mapping) -> None:
        check_gated_short_conv(self, fn, layer, tensors)
        shape = dict(
            num_heads=layer.num_heads,
            num_v_heads=layer.num_v_heads,
            head_dim=layer.head_dim,
            head_v_dim=layer.head_v_dim,
        )
        if layer.num_v_heads != layer.num_heads or layer.head_v_dim != layer.head_dim:
            raise ValueError(
                f"{fn}: {self.title}'s layer has one head count and one head dim for q, k and "
                f"v; this layer has {shape}"
            )
        if layer.low_rank_gates != self.low_rank_gates:
            raise ValueError(
                f"{fn}: {self.title}'s gates are {'low-rank' if self.low_rank_gates else 'full'}"
                f" projections; this layer has low_rank_gates={layer.low_rank_gates}"
            )
        if any(name.startswith(("g_b_proj.", "g_proj.")) and "bias" in name for name in tensors):
            raise ValueError(f"{fn}: {self.title}'s output gate has no bias; output_gate_bias=True")
        if layer.allow_neg_eigval:
            raise ValueError(f"{fn}: {self.title}'s beta lies in (0, 1); allow_neg_eigval=True")
        if layer.gate_lower_bound is not None and not self.bounded:
            raise ValueError(
                f"{fn}: {self.title}'s forget gate has no lower bound; this layer has "
                f"gate_lower_bound={layer.gate_lower_bound}"
            )
