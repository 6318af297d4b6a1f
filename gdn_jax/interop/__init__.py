"""Weights in and out of PyTorch: transformers' Qwen3-Next and flash-linear-attention.

Everything takes and gives plain ``{name: numpy array}`` dicts, so nothing here imports torch.
"""

from gdn_jax.interop.checkpoint import read_safetensors
from gdn_jax.interop.fla import export_fla_layer, load_fla_layer
from gdn_jax.interop.qwen3_next import (
    export_qwen3_next_layer,
    gdn_cache_to_qwen3_next,
    load_qwen3_next_layer,
    qwen3_next_cache_to_gdn,
    qwen3_next_layer_kwargs,
    qwen3_next_layer_prefixes,
)

__all__ = [
    "export_fla_layer",
    "export_qwen3_next_layer",
    "gdn_cache_to_qwen3_next",
    "load_fla_layer",
    "load_qwen3_next_layer",
    "qwen3_next_cache_to_gdn",
    "qwen3_next_layer_kwargs",
    "qwen3_next_layer_prefixes",
    "read_safetensors",
]
