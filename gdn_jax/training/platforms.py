"""Which JAX backends the training command starts: never libtpu's on a host without TPUs.

With libtpu installed (the test and ``tpu-compile`` extras bring it, to compile for TPUs
ahead of time) and ``JAX_PLATFORMS`` unset, JAX tries a TPU backend in every process. On a
host without TPU chips that fails, as it should, but libtpu first prints warnings and an
``INVALID_ARGUMENT`` error on stderr (it cannot find the slice's accelerator type and worker
hostnames) and writes logs to ``/tmp/tpu_logs``: a user reads a broken install. So before the
first computation the command names the backends itself when JAX would find no TPU chip, by
the same check of the host's PCI devices that JAX's own TPU set-up makes. A TPU host keeps
JAX's choice, and so does any process whose user chose (``JAX_PLATFORMS``,
``JAX_FORCE_TPU_INIT``).
"""

from __future__ import annotations

import importlib.util
import os
import pkgutil
from collections.abc import Mapping

# JAX's GPU plugins, as modules of its ``jax_plugins`` namespace, and the platforms they add.
GPU_PLUGINS = {"xla_cuda12": "cuda", "xla_cuda13": "cuda", "xla_rocm": "rocm"}


def tpu_chips() -> int | None:
    """The TPU chips on this host's PCI bus, by JAX's own count (the one that decides whether
    JAX sets up a TPU); None when this JAX has no such count."""
    try:  # JAX keeps it private; without it the choice stays JAX's
        from jax._src import hardware_utils

        return hardware_utils.num_available_tpu_chips_and_device_id()[0]
    except (ImportError, AttributeError, OSError):
        return None


def gpu_platforms() -> list[str] | None:
    """The GPU platforms of the installed JAX plugins, e.g. ``["cuda"]``; None when a plugin
    of another kind is installed, whose platform this module cannot name."""
    spec = importlib.util.find_spec("jax_plugins")
    if spec is None or not spec.submodule_search_locations:
        return []
    found = []
    for module in pkgutil.iter_modules(spec.submodule_search_locations):
        if module.name not in GPU_PLUGINS:
            return None
        found.append(GPU_PLUGINS[module.name])
    return sorted(set(found))


def platforms_without_tpu(environ: Mapping[str, str] = os.environ) -> str | None:
    """The ``jax_platforms`` value that keeps JAX off libtpu here, or None to leave JAX's
    choice: when libtpu is installed, nobody chose, and the host has no TPU chip, the
    installed GPU platforms and the CPU (``"cuda,cpu"``, or ``"cpu"``)."""
    if environ.get("JAX_PLATFORMS") or "JAX_FORCE_TPU_INIT" in environ:
        return None
    if importlib.util.find_spec("libtpu") is None or tpu_chips() != 0:
        return None
    gpus = gpu_platforms()
    return None if gpus is None else ",".join([*gpus, "cpu"])


def use_host_platforms(environ: Mapping[str, str] = os.environ) -> str | None:
    """Apply ``platforms_without_tpu`` to JAX's configuration, before its first computation
    (the backends start then); returns the value set, if any."""
    import jax

    if jax.config.jax_platforms:  # set in this process already
        return None
    chosen = platforms_without_tpu(environ)
    if chosen is not None:
        jax.config.update("jax_platforms", chosen)
    return chosen
