"""XLA options that ``train.py`` and the benchmarks set for their own process.

A library cannot set these for its users: XLA reads ``XLA_FLAGS`` once, when JAX starts its
backend. Each flag here earned its place with a figure in docs/benchmarks.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

# Dots only to YNNPACK: its elementwise and reduce fusions ran slower than XLA's own loops on
# the chunked op's small arrays (docs/benchmarks.md, "CPU options"). Ignored off CPU.
CPU_FLAGS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


def add_flags(settings: Mapping[str, str], environ: MutableMapping[str, str] = os.environ) -> str:
    """Append ``settings`` (``{flag name: value}``) to ``environ["XLA_FLAGS"]``, keeping any
    value the user already gave for the same flag; call before the first JAX computation.
    Returns the new value."""
    flags = environ.get("XLA_FLAGS", "").split()
    given = {flag.lstrip("-").split("=")[0] for flag in flags}
    flags += [f"--{name}={value}" for name, value in settings.items() if name not in given]
    environ["XLA_FLAGS"] = " ".join(flags)
    return environ["XLA_FLAGS"]


def add_cpu_flags(environ: MutableMapping[str, str] = os.environ) -> str:
    """``add_flags(CPU_FLAGS)``: the options ``train.py`` and the benchmarks run with."""
    return add_flags(CPU_FLAGS, environ)
