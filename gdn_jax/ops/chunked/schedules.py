"""Where the chunked forms do each chunk's own work (``schedule``), and what ``"auto"`` means
on each platform: resolved for the platform the program is lowered for, not the host that
traces it, by ``jax.lax.platform_dependent``, which keeps the lowered platform's branch.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from gdn_jax.ops import checks

# What schedule="auto" means on each platform the program is lowered for
# (``jax.lax.platform_dependent`` keys): in the scan on CPU, where it measured faster; the
# associative scan over chunks on NVIDIA GPUs, where a loop over chunks launched some 1,700
# kernels a forward+backward against some 260 (both in docs/benchmarks.md); hoisted on TPU
# and anything else.
AUTO_SCHEDULES = {"cpu": "in_scan", "cuda": "associative", "default": "hoisted"}


def run_schedule(schedules: dict[str, Callable], schedule: checks.Schedule, *args):
    """``schedules[schedule](*args)``, with ``"auto"`` resolved by the platform the program
    is lowered for (``AUTO_SCHEDULES``): traced on a CPU and compiled for a TPU, it is
    ``"hoisted"``.

    A schedule's forward and backward sit whole inside its branch of
    ``jax.lax.platform_dependent``, so both follow one choice. Both branches are traced; a
    lowering for one platform keeps only that platform's.
    """
    if schedule != "auto":
        return schedules[schedule](*args)
    branches = {platform: schedules[choice] for platform, choice in AUTO_SCHEDULES.items()}
    return jax.lax.platform_dependent(*args, **branches)
