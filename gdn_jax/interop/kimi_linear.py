"""transformers' ``KimiLinearDeltaAttention`` <-> gdn_jax's ``KimiDeltaAttention``.

Kimi-Linear's layer (``model.layers.{i}.self_attn``) has low-rank gates, no gate lower bound,
and its ``A_log`` as ``[1, 1, H, 1]``. A ``config.json`` keeps the layer's shape in
``linear_attn_config`` (``num_heads``, ``head_dim``, ``short_conv_kernel_size``) and the layer
kinds in its 1-based ``full_attn_layers`` and ``kda_layers``; without those lists or
``layer_types``, layers 4, 8, 12, ... (0-based) are full attention, as in transformers.
"""

from __future__ import annotations

from collections.abc import Mapping

from gdn_jax.interop.family import LINEAR, QKV_CONV
from gdn_jax.interop.kda_family import KDAFamily, kda_tensors

# linear_attn_config's names for the fields of the loaded config.
LINEAR_ATTN_FIELDS = {
    "head_dim": "linear_head_dim",
    "num_heads": "linear_num_heads",
    "short_conv_kernel_size": "linear_conv_kernel_dim",
}


def linear_attn_view(fn: str, config: Mapping) -> tuple[dict, Mapping]:
    """``(config with linear_attn_config's fields over its own, linear_attn_config)``, as
    Kimi-Linear's and GLM-5 Next's config classes read a ``config.json``."""
    linear = config.get("linear_attn_config") or {}
    if not isinstance(linear, Mapping):
        raise ValueError(f"{fn}: config linear_attn_config must be a mapping, got {linear!r}")
    view = dict(config)
    view.update({field: linear[key] for key, field in LINEAR_ATTN_FIELDS.items() if key in linear})
    return view, linear


def _one_based_layers(fn: str, linear: Mapping, key: str, num_layers) -> list:
    layers = linear[key]
    if not isinstance(layers, list | tuple) or not all(
        type(i) is int and 1 <= i <= num_layers for i in layers
    ):
        raise ValueError(
            f"{fn}: config linear_attn_config.{key} must list layers 1 to "
            f"num_hidden_layers={num_layers}, got {layers!r}"
        )
    return list(layers)


def kimi_linear_config(fn: str, config: Mapping) -> Mapping:
    view, linear = linear_attn_view(fn, config)
    num_layers = view.get("num_hidden_layers")
    if view.get("layer_types") is None and type(num_layers) is int:
        if "full_attn_layers" in linear and "kda_layers" in linear:
            types = [None] * num_layers
            for i in _one_based_layers(fn, linear, "full_attn_layers", num_layers):
                types[i - 1] = "full_attention"
            for i in _one_based_layers(fn, linear, "kda_layers", num_layers):
                types[i - 1] = LINEAR
        else:
            types = ["full_attention" if i and i % 4 == 0 else LINEAR for i in range(num_layers)]
        view["layer_types"] = types
    return view


_TENSORS, _STORED_AS = kda_tensors(low_rank_gates=True)

KIMI_LINEAR = KDAFamily(
    name="kimi_linear",
    title="Kimi-Linear",
    tensors=_TENSORS,
    stored_as=_STORED_AS,
    stored_in_parts={"conv1d.weight": QKV_CONV},
    unsqueezed={"forget_gate.A_log": (0, 1, 3)},
    module="self_attn",
    interval_default=None,
    view=kimi_linear_config,
)
