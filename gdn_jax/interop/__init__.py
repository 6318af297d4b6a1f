"""Weights in and out of PyTorch: the Gated DeltaNet and Kimi Delta Attention layers of the
transformers families in ``families.FAMILIES``, and flash-linear-attention's Gated DeltaNet.

Everything takes and gives plain ``{name: numpy array}`` dicts, so nothing here imports torch.
Each family has the same six functions, named after it (``families.public_functions``):
``load_{family}_layer``, ``export_{family}_layer``, ``{family}_cache_to_gdn_jax``,
``gdn_jax_cache_to_{family}``, ``{family}_layer_prefixes`` and ``{family}_layer_kwargs``.
"""

from gdn_jax.interop.checkpoint import read_safetensors
from gdn_jax.interop.families import (
    FAMILIES,
    MODEL_TYPES,
    layer_prefixes,
    load_layer,
    public_functions,
)
from gdn_jax.interop.fla import export_fla_layer, load_fla_layer

_PER_FAMILY = {name: fn for f in FAMILIES.values() for name, fn in public_functions(f).items()}
globals().update(_PER_FAMILY)

__all__ = [
    "FAMILIES",
    "MODEL_TYPES",
    "export_fla_layer",
    "layer_prefixes",
    "load_fla_layer",
    "load_layer",
    "read_safetensors",
    *sorted(_PER_FAMILY),
]
