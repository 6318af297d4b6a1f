"""Language models built from the layers."""

from gdn_jax.models.config import ModelConfig
from gdn_jax.models.generate import generate
from gdn_jax.models.lm import Block, LanguageModel, build_mixer
from gdn_jax.models.mixers import MIXERS, MixerSpec

__all__ = [
    "MIXERS",
    "Block",
    "LanguageModel",
    "MixerSpec",
    "ModelConfig",
    "build_mixer",
    "generate",
]
