"""Flax NNX layers: thin modules that create parameters and call ``gdn_jax.ops``."""

from gdn_jax.layers.attention import KVCache, SoftmaxAttention
from gdn_jax.layers.baselines import DeltaNet, GatedLinearAttention, LinearAttention
from gdn_jax.layers.gated_deltanet import GatedDeltaNet, RecurrentCache
from gdn_jax.layers.mixer import TokenMixer
from gdn_jax.layers.mlp import SwiGLU
from gdn_jax.layers.params import NoWeightDecay

__all__ = [
    "DeltaNet",
    "GatedDeltaNet",
    "GatedLinearAttention",
    "KVCache",
    "LinearAttention",
    "NoWeightDecay",
    "RecurrentCache",
    "SoftmaxAttention",
    "SwiGLU",
    "TokenMixer",
]
