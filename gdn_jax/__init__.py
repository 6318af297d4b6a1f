"""Gated DeltaNet in JAX.

Dimension legend, one meaning per letter, used in every docstring and shape annotation:
  B batch (sequences or examples side by side), T tokens, D model width,
  H query/key heads, HV value heads, K key dim, V value dim,
  C chunk size, NC chunks or scan blocks of one sequence,
  N packed sequences (``cu_seqlens`` has N+1 offsets), W short-convolution width,
  S key/value slots of softmax attention (its cache length).

The memory state of one head is ``S [V, K]``: one row per value feature, one column per key
feature (flash-linear-attention stores its transpose, ``[K, V]``).
"""

from gdn_jax.layers import (
    DeltaNet,
    GatedDeltaNet,
    GatedDeltaNet2,
    GatedDeltaProduct,
    GatedLinearAttention,
    KimiDeltaAttention,
    KVCache,
    LinearAttention,
    RecurrentCache,
    SoftmaxAttention,
)
from gdn_jax.models import LanguageModel, ModelConfig, generate
from gdn_jax.ops import (
    default_scale,
    gated_delta_product,
    gated_delta_product_chunked,
    gated_delta_product_recurrent,
    gated_delta_rule,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    gated_delta_step,
    gated_linear_attention,
    gdn2,
    gdn2_chunked,
    gdn2_recurrent,
    gdn2_step,
    kda,
    kda_chunked,
    kda_recurrent,
    kda_step,
    l2_normalize,
)

__all__ = [
    "DeltaNet",
    "GatedDeltaNet",
    "GatedDeltaNet2",
    "GatedDeltaProduct",
    "GatedLinearAttention",
    "KimiDeltaAttention",
    "KVCache",
    "LanguageModel",
    "LinearAttention",
    "ModelConfig",
    "RecurrentCache",
    "SoftmaxAttention",
    "generate",
    "default_scale",
    "gated_delta_product",
    "gated_delta_product_chunked",
    "gated_delta_product_recurrent",
    "gated_delta_rule",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
    "gated_delta_step",
    "gated_linear_attention",
    "gdn2",
    "gdn2_chunked",
    "gdn2_recurrent",
    "gdn2_step",
    "kda",
    "kda_chunked",
    "kda_recurrent",
    "kda_step",
    "l2_normalize",
]
