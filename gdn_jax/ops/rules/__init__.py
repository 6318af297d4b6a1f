"""The rule registry: every recurrence of the family, one home module each (its math, its
public ops and its ``rule.Rule``) and one entry in ``RULES``.

The tests that every rule must pass (``tests/ops/test_head_layouts.py`` and the rule tests
that iterate over ``RULES``) read this table; docs/architecture.md says how to add a rule.
"""

from gdn_jax.ops.rule import Rule
from gdn_jax.ops.rules.gated_delta import GATED_DELTA
from gdn_jax.ops.rules.gated_delta_product import GATED_DELTA_PRODUCT
from gdn_jax.ops.rules.gdn2 import GDN2
from gdn_jax.ops.rules.gla import GLA
from gdn_jax.ops.rules.kda import KDA
from gdn_jax.ops.rules.simple_gla import SIMPLE_GLA

RULES: dict[str, Rule] = {
    rule.name: rule for rule in (GATED_DELTA, SIMPLE_GLA, GLA, KDA, GDN2, GATED_DELTA_PRODUCT)
}
