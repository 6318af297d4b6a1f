"""transformers' ``BailingHybridDeltaAttention`` <-> gdn_jax's ``KimiDeltaAttention``.

Bailing-hybrid's (Ling's) layer has full-rank gates (``f_proj``, ``g_proj``), ``A_log`` as
``[H]`` and, with ``kda_safe_gate`` (default true), a forget gate bounded below by
``kda_lower_bound`` (default -5). Checkpoints keep it at ``model.layers.{i}.attention`` with
``o_proj`` as ``dense``. A ``config.json`` names the layer's shape ``num_attention_heads``,
``head_dim`` and ``short_conv_kernel_size`` (the loaded config's ``to_dict()`` has them as
``linear_num_heads``, ``linear_head_dim``, ``linear_conv_kernel_dim``, and its ``head_dim`` is
the attention layers' rope dim, so those are read first); without ``layer_types`` every
``layer_group_size``-th layer (default 6) is attention.
"""

from __future__ import annotations

from collections.abc import Mapping

from gdn_jax.interop.family import LINEAR, QKV_CONV
from gdn_jax.interop.kda_family import LOWER_BOUND, KDAFamily, kda_tensors
from gdn_jax.ops import checks

# The loaded config's fields, and the config.json fields they come from.
FIELDS = {
    "linear_head_dim": "head_dim",
    "linear_num_heads": "num_attention_heads",
    "linear_conv_kernel_dim": "short_conv_kernel_size",
}


def bailing_hybrid_config(fn: str, config: Mapping) -> Mapping:
    view = dict(config)
    for field, key in FIELDS.items():
        if field not in view and key in view:
            view[field] = view[key]
    safe_gate = view.get("kda_safe_gate", True)
    if not isinstance(safe_gate, bool):
        raise ValueError(f"{fn}: config kda_safe_gate must be a bool, got {safe_gate!r}")
    view[LOWER_BOUND] = view.get("kda_lower_bound", -5.0) if safe_gate else None
    num_layers = view.get("num_hidden_layers")
    if view.get("layer_types") is None and type(num_layers) is int:
        group = view.get("layer_group_size", 6)
        checks.check_positive_int(fn, **{"config layer_group_size": group})
        view["layer_types"] = [
            "full_attention" if (i + 1) % group == 0 else LINEAR for i in range(num_layers)
        ]
    return view


_TENSORS, _STORED_AS = kda_tensors(low_rank_gates=False)

BAILING_HYBRID = KDAFamily(
    name="bailing_hybrid",
    title="Bailing-hybrid",
    tensors=_TENSORS,
    stored_as={**_STORED_AS, "o_proj.weight": "dense.weight"},
    stored_in_parts={"conv1d.weight": QKV_CONV},
    module="attention",
    interval_default=None,
    low_rank_gates=False,
    bounded=True,
    view=bailing_hybrid_config,
)
