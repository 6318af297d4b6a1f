"""Bad inputs to the layers, models and ops that used to give wrong results or raw errors:
each is now a ValueError naming the argument and its shape or value."""

import gdn_jax
from gdn_jax import GatedDeltaNet, LanguageModel


def test_top_level_exports():
    assert gdn_jax.GatedDeltaNet is GatedDeltaNet and gdn_jax.LanguageModel is LanguageModel
