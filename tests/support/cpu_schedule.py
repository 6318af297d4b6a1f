"""The CPU schedule, named, for the tests that are not about schedules: ``schedule="auto"``,
the default, traces all three schedules and lowers ``"in_scan"`` on CPU; named, one is traced.
``SCHEDULE`` is for the layers, models and loaders; the chunked ops below name it (a call may
still name another). test_schedules.py runs every schedule and ``"auto"`` itself; the layer
agreement tests, the interop checkpoint and bfloat16 tests and the TPU tests run the default.
"""

import functools

import gdn_jax

SCHEDULE = "in_scan"

gated_delta_rule = functools.partial(gdn_jax.gated_delta_rule, schedule=SCHEDULE)
gated_delta_rule_chunked = functools.partial(gdn_jax.gated_delta_rule_chunked, schedule=SCHEDULE)
gated_linear_attention = functools.partial(gdn_jax.gated_linear_attention, schedule=SCHEDULE)
gated_linear_attention_chunked = functools.partial(
    gdn_jax.gated_linear_attention_chunked, schedule=SCHEDULE
)
simple_gla = functools.partial(gdn_jax.simple_gla, schedule=SCHEDULE)
simple_gla_chunked = functools.partial(gdn_jax.simple_gla_chunked, schedule=SCHEDULE)
kda = functools.partial(gdn_jax.kda, schedule=SCHEDULE)
kda_chunked = functools.partial(gdn_jax.kda_chunked, schedule=SCHEDULE)
gdn2 = functools.partial(gdn_jax.gdn2, schedule=SCHEDULE)
gdn2_chunked = functools.partial(gdn_jax.gdn2_chunked, schedule=SCHEDULE)
