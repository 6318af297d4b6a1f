"""The one place that chooses how a rule runs: recurrent or chunked (``impl``), and where the
chunked form does each chunk's own work (``schedule``)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from gdn_jax.ops import checks
from gdn_jax.ops.recurrent import rule_recurrent
from gdn_jax.ops.rule import Rule

# What "auto" means on each platform the program is lowered for (``jax.lax.platform_dependent``
# keys): in the scan on CPU, where it measured faster (docs/benchmarks.md), hoisted on GPU, TPU
# and anything else.
AUTO_SCHEDULES = {"cpu": "in_scan", "default": "hoisted"}


def one_head_form(rule: Rule, impl: checks.Impl, *, chunk_size: int, schedule: checks.Schedule):
    """``rule``'s form of one head, ``(q, k, v, gates, initial_states, *, cu_seqlens) -> (y,
    finals)``: its token step scanned (``"recurrent"``), or its chunked form with
    ``chunk_size`` and ``schedule`` (``"chunked"``)."""
    match impl:
        case "recurrent":
            return rule_recurrent(rule)
        case "chunked":
            return functools.partial(rule.chunked, chunk_size=chunk_size, schedule=schedule)
    raise ValueError(f"{rule.name}: impl={impl!r} must be one of {checks.SUPPORTED_IMPLS}")


def run_schedule(schedules: dict[str, Callable], schedule: checks.Schedule, *args):
    """``schedules[schedule](*args)``, with ``"auto"`` resolved by the platform the program
    is lowered for, not the host that traces it (``AUTO_SCHEDULES``): traced on a CPU and
    compiled for a TPU, it is ``"hoisted"``.

    A schedule's forward and backward sit whole inside its branch of
    ``jax.lax.platform_dependent``, so both follow one choice. Both branches are traced; a
    lowering for one platform keeps only that platform's.
    """
    if schedule != "auto":
        return schedules[schedule](*args)
    branches = {platform: schedules[choice] for platform, choice in AUTO_SCHEDULES.items()}
    return jax.lax.platform_dependent(*args, **branches)
