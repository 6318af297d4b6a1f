"""The small hybrid language model that the input checks of the layers and the models call
(tests/layers/test_layer_inputs.py, tests/models/test_model_inputs.py; conftest.py's ``model``
fixture builds it): a GatedDeltaNet and a softmax attention layer over 50 tokens, with the
random token ids it reads."""

import jax.numpy as jnp
import numpy as np

from gdn_jax import ModelConfig
from support.cpu_schedule import SCHEDULE

HYBRID = ModelConfig(
    vocab_size=50, d_model=16, mixers=("gdn", "attention"), chunk_size=16, schedule=SCHEDULE
)


def tokens(batch, seq_len):
    """``[batch, seq_len]`` int32 ids in ``[0, 50)``, the same ones on every call."""
    return jnp.asarray(np.random.default_rng(0).integers(0, 50, (batch, seq_len)), jnp.int32)
