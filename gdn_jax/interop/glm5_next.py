"""transformers' ``Glm5NextTextLinearAttention`` <-> gdn_jax's ``KimiDeltaAttention``.

GLM-5 Next's layer is Kimi-Linear's with ``A_log`` as ``[H]`` and a forget gate bounded
below by ``linear_lower_bound`` (default -5; ``None`` unbounded). Its layers lie at
``model.language_model.layers.{i}.self_attn`` (the model is multimodal, whether its
``config.json`` nests the text fields in ``text_config`` or not); a ``config.json`` keeps the
layer's shape and bound in ``linear_attn_config`` (``gate_lower_bound``, and ``safe_gate``,
which bounds at -5 what has no bound). Without ``layer_types``, every 4th layer is attention.
"""

from __future__ import annotations

from collections.abc import Mapping

from gdn_jax.interop.family import QKV_CONV
from gdn_jax.interop.kda_family import LOWER_BOUND, KDAFamily, kda_tensors
from gdn_jax.interop.kimi_linear import linear_attn_view

DEFAULT_LOWER_BOUND = -5.0


def glm5_next_config(fn: str, config: Mapping) -> Mapping:
    view, linear = linear_attn_view(fn, config)
    bound = view.get(LOWER_BOUND, DEFAULT_LOWER_BOUND)
    if linear:
        bound = linear.get("gate_lower_bound", bound)
        if linear.get("safe_gate", True) and bound is None:
            bound = DEFAULT_LOWER_BOUND
    view[LOWER_BOUND] = bound
    return view


_TENSORS, _STORED_AS = kda_tensors(low_rank_gates=True)

GLM5_NEXT = KDAFamily(
    name="glm5_next",
    title="GLM-5 Next",
    # A config.json with GLM-5 Next's text fields at the top level reads as glm5_next.
    also_model_types=("glm5_next_text",),
    tensors=_TENSORS,
    stored_as=_STORED_AS,
    stored_in_parts={"conv1d.weight": QKV_CONV},
    module="self_attn",
    layers_stem="model.language_model.layers",
    bounded=True,
    view=glm5_next_config,
)
