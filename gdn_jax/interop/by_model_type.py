"""Pick a family by the config's ``model_type``: ``load_layer`` and ``layer_prefixes``."""

from __future__ import annotations

from typing import no_type_check

from gdn_jax.interop.bailing_hybrid import BAILING_HYBRID
from gdn_jax.interop.family import Family, text_config
from gdn_jax.interop.glm5_next import GLM5_NEXT
from gdn_jax.interop.kimi_linear import KIMI_LINEAR
from gdn_jax.interop.olmo_hybrid import OLMO_HYBRID
from gdn_jax.interop.qwen3_5 import QWEN3_5
from gdn_jax.interop.qwen3_next import QWEN3_NEXT
from gdn_jax.layers.gated_deltanet import GatedDeltaNet
from gdn_jax.layers.kda import KimiDeltaAttention

# A multimodal config's model_type is read from its text_config, hence the *_text names.
FAMILIES: dict[str, Family] = {
    "qwen3_next": QWEN3_NEXT,
    **{
        model_type: QWEN3_5
        for stem in ("qwen3_5", "qwen3_5_moe", "qwen4_exp")
        for model_type in (stem, f"{stem}_text")
    },
    "lara_mini": QWEN3_5,
    "olmo_hybrid": OLMO_HYBRID,
    "kimi_linear": KIMI_LINEAR,
    "bailing_hybrid": BAILING_HYBRID,
    # A config.json with GLM-5 Next's text fields at the top level reads as glm5_next.
    "glm5_next": GLM5_NEXT,
    "glm5_next_text": GLM5_NEXT,
}


def family_of(fn: str, config) -> Family:
    """The family of ``config`` (or of its ``text_config``) by ``model_type``."""
    text, _ = text_config(fn, config)
    model_type = text.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"{fn}: config model_type={model_type!r} has no linear-attention layer gdn_jax "
            f"reads; supported: {', '.join(FAMILIES)}"
        )
    return FAMILIES[model_type]


@no_type_check  # a public entry point: checks.py names its bad arguments
def load_layer(
    state_dict, config, *, dtype=None, schedule="auto"
) -> GatedDeltaNet | KimiDeltaAttention:
    """``load_{family}_layer`` for the family that ``config["model_type"]`` names: one
    linear-attention layer's weights (without prefix) as a ``GatedDeltaNet`` or, for the
    Kimi Delta Attention families, a ``KimiDeltaAttention``."""
    family = family_of("load_layer", config)
    return family.load(state_dict, config, dtype=dtype, schedule=schedule)


@no_type_check  # a public entry point: checks.py names its bad arguments
def layer_prefixes(config) -> dict[int, str]:
    """``{layer index: prefix}`` of the linear-attention layers, for any supported family."""
    return family_of("layer_prefixes", config).layer_prefixes(config)
