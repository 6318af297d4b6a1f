"""Language models built from the layers."""

from gdn_jax.models.config import MIXERS, ModelConfig
from gdn_jax.models.generate import generate
from gdn_jax.models.lm import Block, LanguageModel, build_mixer

__all__ = ["MIXERS", "Block", "LanguageModel", "ModelConfig", "build_mixer", "generate"]
