"""Weights in and out of PyTorch: the Gated DeltaNet layers of transformers' Qwen3-Next,
Qwen3.5 (and its siblings) and OLMo-Hybrid, and flash-linear-attention's; the Kimi Delta
Attention layers of transformers' Kimi-Linear, Bailing-hybrid and GLM-5 Next.

Everything takes and gives plain ``{name: numpy array}`` dicts, so nothing here imports torch.
"""

from gdn_jax.interop.bailing_hybrid import (
    bailing_hybrid_cache_to_gdn,
    bailing_hybrid_layer_kwargs,
    bailing_hybrid_layer_prefixes,
    export_bailing_hybrid_layer,
    gdn_cache_to_bailing_hybrid,
    load_bailing_hybrid_layer,
)
from gdn_jax.interop.by_model_type import FAMILIES, layer_prefixes, load_layer
from gdn_jax.interop.checkpoint import read_safetensors
from gdn_jax.interop.fla import export_fla_layer, load_fla_layer
from gdn_jax.interop.glm5_next import (
    export_glm5_next_layer,
    gdn_cache_to_glm5_next,
    glm5_next_cache_to_gdn,
    glm5_next_layer_kwargs,
    glm5_next_layer_prefixes,
    load_glm5_next_layer,
)
from gdn_jax.interop.kimi_linear import (
    export_kimi_linear_layer,
    gdn_cache_to_kimi_linear,
    kimi_linear_cache_to_gdn,
    kimi_linear_layer_kwargs,
    kimi_linear_layer_prefixes,
    load_kimi_linear_layer,
)
from gdn_jax.interop.olmo_hybrid import (
    export_olmo_hybrid_layer,
    gdn_cache_to_olmo_hybrid,
    load_olmo_hybrid_layer,
    olmo_hybrid_cache_to_gdn,
    olmo_hybrid_layer_kwargs,
    olmo_hybrid_layer_prefixes,
)
from gdn_jax.interop.qwen3_5 import (
    export_qwen3_5_layer,
    gdn_cache_to_qwen3_5,
    load_qwen3_5_layer,
    qwen3_5_cache_to_gdn,
    qwen3_5_layer_kwargs,
    qwen3_5_layer_prefixes,
)
from gdn_jax.interop.qwen3_next import (
    export_qwen3_next_layer,
    gdn_cache_to_qwen3_next,
    load_qwen3_next_layer,
    qwen3_next_cache_to_gdn,
    qwen3_next_layer_kwargs,
    qwen3_next_layer_prefixes,
)

__all__ = [
    "FAMILIES",
    "bailing_hybrid_cache_to_gdn",
    "bailing_hybrid_layer_kwargs",
    "bailing_hybrid_layer_prefixes",
    "export_bailing_hybrid_layer",
    "export_fla_layer",
    "export_glm5_next_layer",
    "export_kimi_linear_layer",
    "export_olmo_hybrid_layer",
    "export_qwen3_5_layer",
    "export_qwen3_next_layer",
    "gdn_cache_to_bailing_hybrid",
    "gdn_cache_to_glm5_next",
    "gdn_cache_to_kimi_linear",
    "gdn_cache_to_olmo_hybrid",
    "gdn_cache_to_qwen3_5",
    "gdn_cache_to_qwen3_next",
    "glm5_next_cache_to_gdn",
    "glm5_next_layer_kwargs",
    "glm5_next_layer_prefixes",
    "kimi_linear_cache_to_gdn",
    "kimi_linear_layer_kwargs",
    "kimi_linear_layer_prefixes",
    "layer_prefixes",
    "load_bailing_hybrid_layer",
    "load_fla_layer",
    "load_glm5_next_layer",
    "load_kimi_linear_layer",
    "load_layer",
    "load_olmo_hybrid_layer",
    "load_qwen3_5_layer",
    "load_qwen3_next_layer",
    "olmo_hybrid_cache_to_gdn",
    "olmo_hybrid_layer_kwargs",
    "olmo_hybrid_layer_prefixes",
    "qwen3_5_cache_to_gdn",
    "qwen3_5_layer_kwargs",
    "qwen3_5_layer_prefixes",
    "qwen3_next_cache_to_gdn",
    "qwen3_next_layer_kwargs",
    "qwen3_next_layer_prefixes",
    "read_safetensors",
]
