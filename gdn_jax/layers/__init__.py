"""Flax NNX layers: thin modules that create parameters and call ``gdn_jax.ops``."""

from gdn_jax.layers.attention import KVCache, SoftmaxAttention
from gdn_jax.layers.baselines import DeltaNet, LinearAttention, SimpleGatedLinearAttention
from gdn_jax.layers.gated_deltanet import GatedDeltaNet
from gdn_jax.layers.gated_deltaproduct import GatedDeltaProduct
from gdn_jax.layers.gdn2 import GatedDeltaNet2
from gdn_jax.layers.gla import GatedLinearAttention
from gdn_jax.layers.kda import KimiDeltaAttention
from gdn_jax.layers.mixer import TokenMixer
from gdn_jax.layers.mlp import SwiGLU
from gdn_jax.layers.params import CHANNEL_DECAY, HEAD_DECAY, GateInit, NoWeightDecay
from gdn_jax.layers.recurrent_layer import RecurrentCache
from gdn_jax.layers.recurrent_mixer import RecurrentMixer

__all__ = [
    "CHANNEL_DECAY",
    "HEAD_DECAY",
    "DeltaNet",
    "GatedDeltaNet",
    "GatedDeltaNet2",
    "GatedDeltaProduct",
    "GatedLinearAttention",
    "GateInit",
    "KVCache",
    "KimiDeltaAttention",
    "LinearAttention",
    "NoWeightDecay",
    "RecurrentCache",
    "RecurrentMixer",
    "SimpleGatedLinearAttention",
    "SoftmaxAttention",
    "SwiGLU",
    "TokenMixer",
]
