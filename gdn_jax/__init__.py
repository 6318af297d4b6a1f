"""Gated DeltaNet in JAX.

Dimension legend, one meaning per letter, used in every docstring and shape annotation:
  B batch (sequences or examples side by side), T tokens, D model width,
  H query/key heads, HV value heads, K key dim, V value dim,
  C chunk size, NC chunks or scan blocks of one sequence,
  N packed sequences (``cu_seqlens`` has N+1 offsets), W short-convolution width,
  S key/value slots of softmax attention (its cache length).

The memory state of one head is ``S [V, K]``: one row per value feature, one column per key
feature (flash-linear-attention stores its transpose, ``[K, V]``).

Importing ``gdn_jax`` loads the ops (JAX, NumPy and jaxtyping only); the layers and the
model, which need Flax, load on first use of one of their names here or on import of
``gdn_jax.layers`` or ``gdn_jax.models``.
"""

import importlib
from typing import TYPE_CHECKING

from gdn_jax import platforms

# Before anything here can start a backend: JAX kept off the accelerators this host lacks,
# whose start-up failures printed a traceback and libtpu's errors in every user's process.
platforms.use_host_platforms()

from gdn_jax import ops  # noqa: E402
from gdn_jax.ops import *  # noqa: E402, F403 (the ops' own __all__ is the public list)

__version__ = "0.1.0"

# The public names that need Flax, and the subpackage each is read from.
_LAZY = {
    "DeltaNet": "gdn_jax.layers",
    "GatedDeltaNet": "gdn_jax.layers",
    "GatedDeltaNet2": "gdn_jax.layers",
    "GatedDeltaProduct": "gdn_jax.layers",
    "GatedLinearAttention": "gdn_jax.layers",
    "KimiDeltaAttention": "gdn_jax.layers",
    "KVCache": "gdn_jax.layers",
    "LinearAttention": "gdn_jax.layers",
    "RecurrentCache": "gdn_jax.layers",
    "SimpleGatedLinearAttention": "gdn_jax.layers",
    "SoftmaxAttention": "gdn_jax.layers",
    "LanguageModel": "gdn_jax.models",
    "ModelConfig": "gdn_jax.models",
    "generate": "gdn_jax.models",
}

__all__ = ["__version__", *sorted(_LAZY), *(name for name in ops.__all__ if name != "RULES")]

if TYPE_CHECKING:  # what type checkers see of the lazy names
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
        SimpleGatedLinearAttention,
        SoftmaxAttention,
    )
    from gdn_jax.models import LanguageModel, ModelConfig, generate


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'gdn_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__():
    return sorted({*globals(), *_LAZY})
