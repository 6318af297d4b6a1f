"""Which JAX backends a process that imports gdn_jax starts: never an accelerator's that the
host lacks.

With libtpu installed (the test and ``tpu-compile`` extras bring it, to compile for TPUs
ahead of time) and ``JAX_PLATFORMS`` unset, JAX tries a TPU backend in every process. On a
host without TPU chips that fails, as it should, but libtpu first prints warnings and an
``INVALID_ARGUMENT`` error on stderr (it cannot find the slice's accelerator type and worker
hostnames) and writes logs to ``/tmp/tpu_logs``: a user reads a broken install. JAX's CUDA
plugin (the test and ``gpu-compile`` extras bring it, to compile for GPUs) does the same on a
host without an NVIDIA driver: it looks for cuDNN first and logs a traceback when it finds
none. libtpu's log-level variables do not reach the lines it prints before its logging
starts, and the traceback is JAX's own record of the plugin's failure; so ``import gdn_jax``
names the backends itself (``use_host_platforms``) when an installed one's hardware is
absent: TPU chips by the same check of the host's PCI devices that JAX's own TPU set-up
makes, an NVIDIA or AMD GPU by its driver's device files. The backends are those JAX would
end up with; only the failed attempts and their noise are gone. A host that has the
hardware keeps JAX's choice, and so does any process whose user chose (``JAX_PLATFORMS``,
``JAX_FORCE_TPU_INIT``, ``jax_platforms`` set before the import) or whose backends had
started before gdn_jax was imported.
"""

from __future__ import annotations

import importlib.util
import os
import pkgutil
from collections.abc import Mapping

# JAX's GPU plugins, as modules of its ``jax_plugins`` namespace, and the platforms they add.
GPU_PLUGINS = {"xla_cuda12": "cuda", "xla_cuda13": "cuda", "xla_rocm": "rocm"}
# A file each GPU platform's kernel driver makes, present exactly where its GPUs can be used.
GPU_DRIVER_FILES = {
    "cuda": ("/proc/driver/nvidia/version", "/dev/nvidiactl"),
    "rocm": ("/dev/kfd",),
}


def tpu_chips() -> int | None:
    """The TPU chips on this host's PCI bus, by JAX's own count (the one that decides whether
    JAX sets up a TPU); None when this JAX has no such count."""
    try:  # JAX keeps it private; without it the choice stays JAX's
        from jax._src import hardware_utils

        return hardware_utils.num_available_tpu_chips_and_device_id()[0]
    except (ImportError, AttributeError, OSError):
        return None


def backends_started() -> bool:
    """Whether this process's JAX backends have started (a computation ran), after which
    the choice of platforms is made; False when this JAX cannot tell."""
    try:  # JAX keeps it private; without it, a late choice is only a config value
        from jax._src import xla_bridge

        return xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):
        return False


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


def gpu_present(platform: str) -> bool:
    """Whether this host has a GPU of ``platform`` (``"cuda"``, ``"rocm"``): its driver's
    device files."""
    return any(os.path.exists(path) for path in GPU_DRIVER_FILES.get(platform, ()))


def host_platforms(environ: Mapping[str, str] = os.environ) -> str | None:
    """The ``jax_platforms`` value that keeps JAX off the installed accelerators this host
    lacks (module docstring), or None to leave JAX's choice: when nobody chose and libtpu is
    installed without TPU chips, or a GPU plugin without its GPU, the installed platforms
    whose hardware is here and the CPU (``"cuda,cpu"``, or ``"cpu"``)."""
    if environ.get("JAX_PLATFORMS") or "JAX_FORCE_TPU_INIT" in environ:
        return None
    gpus = gpu_platforms()
    libtpu = importlib.util.find_spec("libtpu") is not None
    chips = tpu_chips() if libtpu else 0
    if gpus is None or chips is None:
        return None
    present = [p for p in gpus if gpu_present(p)]
    if len(present) == len(gpus) and not (libtpu and chips == 0):
        return None
    return ",".join([*(["tpu"] if chips else []), *present, "cpu"])


def use_host_platforms(environ: Mapping[str, str] = os.environ) -> str | None:
    """Apply ``host_platforms`` to JAX's configuration, before its first computation
    (the backends start then); returns the value set, if any."""
    import jax

    if jax.config.jax_platforms or backends_started():  # chosen, or too late to choose
        return None
    chosen = host_platforms(environ)
    if chosen is not None:
        jax.config.update("jax_platforms", chosen)
    return chosen
