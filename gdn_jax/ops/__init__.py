"""Pure JAX functions for the delta-rule family, one home per rule (``rules/``): the gated
delta rule, simple gated linear attention (one decay per head), gated linear attention (GLA,
one decay per key channel), Kimi Delta Attention (KDA), Gated DeltaNet-2 (GDN-2) and Gated
DeltaProduct; see ``gdn_jax`` for the dimension legend. Every rule has the same public
forms: ``<name>_step``, ``<name>_recurrent``, ``<name>_chunked``, ``<name>`` (batched) and
``<name>_seq_parallel``."""

from gdn_jax.ops.conv import halo_from_previous
from gdn_jax.ops.normalize import l2_normalize
from gdn_jax.ops.rules import RULES
from gdn_jax.ops.rules.gated_delta import (
    gated_delta_rule,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    gated_delta_rule_seq_parallel,
    gated_delta_step,
)
from gdn_jax.ops.rules.gated_delta_product import (
    gated_delta_product,
    gated_delta_product_chunked,
    gated_delta_product_recurrent,
    gated_delta_product_seq_parallel,
    gated_delta_product_step,
)
from gdn_jax.ops.rules.gdn2 import gdn2, gdn2_chunked, gdn2_recurrent, gdn2_seq_parallel, gdn2_step
from gdn_jax.ops.rules.gla import (
    gated_linear_attention,
    gated_linear_attention_chunked,
    gated_linear_attention_recurrent,
    gated_linear_attention_seq_parallel,
    gated_linear_attention_step,
)
from gdn_jax.ops.rules.kda import kda, kda_chunked, kda_recurrent, kda_seq_parallel, kda_step
from gdn_jax.ops.rules.simple_gla import (
    simple_gla,
    simple_gla_chunked,
    simple_gla_recurrent,
    simple_gla_seq_parallel,
    simple_gla_step,
)
from gdn_jax.ops.single_head import default_scale

__all__ = [
    "RULES",
    "default_scale",
    "gated_delta_rule",
    "gated_delta_rule_chunked",
    "gated_delta_rule_recurrent",
    "gated_delta_rule_seq_parallel",
    "gated_delta_step",
    "gated_linear_attention",
    "gated_linear_attention_chunked",
    "gated_linear_attention_recurrent",
    "gated_linear_attention_seq_parallel",
    "gated_linear_attention_step",
    "gated_delta_product",
    "gated_delta_product_chunked",
    "gated_delta_product_recurrent",
    "gated_delta_product_seq_parallel",
    "gated_delta_product_step",
    "gdn2",
    "gdn2_chunked",
    "gdn2_recurrent",
    "gdn2_seq_parallel",
    "gdn2_step",
    "halo_from_previous",
    "kda",
    "kda_chunked",
    "kda_recurrent",
    "kda_seq_parallel",
    "kda_step",
    "l2_normalize",
    "simple_gla",
    "simple_gla_chunked",
    "simple_gla_recurrent",
    "simple_gla_seq_parallel",
    "simple_gla_step",
]
