"""A rule's batched arguments as abstract arrays (``jax.ShapeDtypeStruct``), laid out by the
rule itself (``Rule.layout``): for tracing and compiling without computing or allocating."""

import jax
import jax.numpy as jnp

from gdn_jax.ops.rule import STEPS, shape_of
from gdn_jax.ops.rules import RULES


def abstract_args(name, *, seq_len, key_dim, value_dim, dtype, gate_dtype=jnp.float32,
                  heads=(1, 2), batch=1, steps=2):  # fmt: skip
    """q, k, v (``dtype``) and the gates (``gate_dtype``) of rule ``name``'s batched op,
    ``steps`` a token for a rule with steps."""
    rule = RULES[name]
    sizes = {"B": batch, "T": seq_len, "H": heads[0], "HV": heads[1], "K": key_dim,
             "V": value_dim, STEPS: steps}  # fmt: skip
    return [
        jax.ShapeDtypeStruct(
            shape_of(rule.layout(spec, "batched"), sizes),
            dtype if spec.name in ("q", "k", "v") else gate_dtype,
        )
        for spec in rule.arguments
    ]
