"""Pure JAX functions for the gated delta rule and Kimi Delta Attention (KDA, its per-channel
gated form); see ``gdn_jax`` for the dimension legend."""

from gdn_jax.ops.api import gated_delta_rule, gated_linear_attention, kda
from gdn_jax.ops.chunked import gated_delta_rule_chunked
from gdn_jax.ops.conv import halo_from_previous
from gdn_jax.ops.kda_chunkwise import kda_chunked
from gdn_jax.ops.kda_token import kda_step
from gdn_jax.ops.normalize import l2_normalize
from gdn_jax.ops.recurrent import gated_delta_rule_recurrent, kda_recurrent
from gdn_jax.ops.sequence_parallel import (
    gated_delta_rule_seq_parallel,
    gated_linear_attention_seq_parallel,
)
from gdn_jax.ops.step import default_scale, gated_delta_step

__all__ = [
    "default_scale",
    "gated_delta_rule",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
    "gated_delta_rule_seq_parallel",
    "gated_delta_step",
    "gated_linear_attention",
    "gated_linear_attention_seq_parallel",
    "halo_from_previous",
    "kda",
    "kda_chunked",
    "kda_recurrent",
    "kda_step",
    "l2_normalize",
]
