"""The family registry: every transformers family whose linear-attention layers gdn_jax reads.

A family is one module (a ``Family``: the table of its tensors and its config conventions)
plus one entry in ``FAMILIES``. The lookup by a config's ``model_type`` (``load_layer``,
``layer_prefixes``), the public functions named after each family (``load_{name}_layer``,
..., made in ``gdn_jax.interop``) and the tests that every family must pass all read this
table; docs/architecture.md says how to add one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import no_type_check

from gdn_jax.interop.bailing_hybrid import BAILING_HYBRID
from gdn_jax.interop.family import Family, text_config
from gdn_jax.interop.glm5_next import GLM5_NEXT
from gdn_jax.interop.kimi_linear import KIMI_LINEAR
from gdn_jax.interop.olmo_hybrid import OLMO_HYBRID
from gdn_jax.interop.qwen3_5 import QWEN3_5
from gdn_jax.interop.qwen3_next import QWEN3_NEXT
from gdn_jax.layers.recurrent_layer import RecurrentLayer

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (QWEN3_NEXT, QWEN3_5, OLMO_HYBRID, KIMI_LINEAR, BAILING_HYBRID, GLM5_NEXT)
}
# A multimodal config's model_type is read from its text_config, hence the *_text names.
MODEL_TYPES: dict[str, Family] = {
    model_type: family for family in FAMILIES.values() for model_type in family.model_types
}


def public_functions(family: Family) -> dict[str, Callable]:
    """The functions named after ``family`` that ``gdn_jax.interop`` exports."""
    name = family.name
    return {
        f"load_{name}_layer": family.load,
        f"export_{name}_layer": family.export,
        f"{name}_cache_to_gdn_jax": family.cache_to_gdn_jax,
        f"gdn_jax_cache_to_{name}": family.cache_from_gdn_jax,
        f"{name}_layer_prefixes": family.layer_prefixes,
        f"{name}_layer_kwargs": family.layer_kwargs,
    }


def family_of(fn: str, config) -> Family:
    """The family of ``config`` (or of its ``text_config``) by ``model_type``."""
    text, _ = text_config(fn, config)
    model_type = text.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"{fn}: config model_type={model_type!r} has no linear-attention layer gdn_jax "
            f"reads; supported: {', '.join(MODEL_TYPES)}"
        )
    return MODEL_TYPES[model_type]


@no_type_check  # a public entry point: checks.py names its bad arguments
def load_layer(state_dict, config, *, dtype=None, schedule="auto") -> RecurrentLayer:
    """``load_{family}_layer`` for the family that ``config["model_type"]`` names: one
    linear-attention layer's weights (without prefix) as the family's layer, a
    ``GatedDeltaNet`` or, for the Kimi Delta Attention families, a ``KimiDeltaAttention``."""
    family = family_of("load_layer", config)
    return family.load(state_dict, config, dtype=dtype, schedule=schedule)


@no_type_check  # a public entry point: checks.py names its bad arguments
def layer_prefixes(config) -> dict[int, str]:
    """``{layer index: prefix}`` of the linear-attention layers, for any supported family."""
    return family_of("layer_prefixes", config).layer_prefixes(config)
