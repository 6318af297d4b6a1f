"""The chunked ops with their CPU schedule named, for the op tests that are not about
schedules: ``schedule="auto"``, the default, traces both schedules and lowers ``"in_scan"``
on CPU; named, one is traced. A call may still name another. test_schedules.py runs both
schedules and ``"auto"`` itself, test_layers.py and the TPU tests the layers' default."""

import functools

import gdn_jax

gated_delta_rule = functools.partial(gdn_jax.gated_delta_rule, schedule="in_scan")
gated_delta_rule_chunked = functools.partial(gdn_jax.gated_delta_rule_chunked, schedule="in_scan")
gated_linear_attention = functools.partial(gdn_jax.gated_linear_attention, schedule="in_scan")
kda = functools.partial(gdn_jax.kda, schedule="in_scan")
kda_chunked = functools.partial(gdn_jax.kda_chunked, schedule="in_scan")
