"""The one place that chooses how a rule runs: recurrent or chunked (``impl``), and where the
chunked form does each chunk's own work (``schedule``)."""

from __future__ import annotations

import functools
import importlib
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
    ``chunk_size`` and ``schedule`` (``"chunked"``). ``"pallas"`` runs over the whole batch
    (``batched_kernel``)."""
    match impl:
        case "recurrent":
            return rule_recurrent(rule)
        case "chunked":
            return functools.partial(rule.chunked, chunk_size=chunk_size, schedule=schedule)
    raise ValueError(f"{rule.name}: impl={impl!r} must be one of {checks.SUPPORTED_IMPLS}")


# The rules with a Pallas kernel (``impl="pallas"``) and where it is: the module is imported
# when first asked for, so that ``import gdn_jax`` does not load Pallas.
KERNELS = {"gated_delta_rule": ("gdn_jax.ops.chunked_pallas", "gated_delta_rule_pallas")}


def batched_kernel(rule: Rule) -> Callable:
    """``rule``'s kernel over the batch, ``(q, k, v, gates, initial_states, cu_seqlens, *,
    chunk_size) -> (o, finals)`` on ``api.prepare_batched``'s inputs."""
    if rule.name not in KERNELS:
        raise ValueError(
            f'{rule.name}: impl="pallas" has a kernel for {", ".join(KERNELS)} only; use '
            'impl="chunked"'
        )
    module, name = KERNELS[rule.name]
    return getattr(importlib.import_module(module), name)


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
