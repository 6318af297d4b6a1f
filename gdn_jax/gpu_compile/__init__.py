"""Compiling for NVIDIA GPUs that are not here, and what the program launches there.

``jax.experimental.topologies`` describes a GPU by its target config (``targets/*.txtpb``,
package data: the H100 SXM and the H200, written from NVIDIA's figures) as a device that
JAX compiles for but cannot run on. ``compile_for`` compiles a function for it: XLA:GPU's
whole pipeline for sm_90a (fusions, gemms, loops, buffer assignment, Pallas kernels through
ptxas). ``report`` compiles it once more into a dump and reads from it what one call
launches (``thunks.py``), the memory it needs, and each Pallas kernel's registers, spills,
shared memory and tensor-core instructions (``kernels.py``).

Without the GPU, XLA does not autotune: its gemms take default tiles, so launches, fusions
and buffers are the real ones but the kernels' times are not measured, and
``cost_analysis()`` is empty. XLA's autotune results dumped on a GPU
(``xla_gpu_dump_autotune_results_to``) can be loaded with ``autotune_results=``.

Needs the CUDA plugin and ptxas (``INSTALL_COMMAND``), not a GPU. On a host without one,
start the process with ``JAX_PLATFORMS=cpu`` (or ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1``):
otherwise the plugin's start-up looks for cuDNN, fails, and is not registered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.resources
import importlib.util
import os
import re
import tempfile
import typing
from collections.abc import Callable
from pathlib import Path

import jax

from gdn_jax.gpu_compile import kernels as kernel_reports
from gdn_jax.gpu_compile import thunks
from gdn_jax.gpu_compile.kernels import Kernel
from gdn_jax.gpu_compile.thunks import Launches, Loop
from gdn_jax.tpu_compile import no_cache_entry, place_arguments

__all__ = [
    "INSTALL_COMMAND",
    "TARGETS",
    "GpuCompileMissing",
    "GpuTarget",
    "Kernel",
    "Launches",
    "Loop",
    "Report",
    "compile_for",
    "parse_target",
    "plugin_installed",
    "report",
    "target_config",
    "target_device",
    "target_devices",
]

INSTALL_COMMAND = 'pip install "gdn_jax[gpu-compile]"'
# Each target's config file, in targets/.
TARGETS = {"h100": "h100.txtpb", "h200": "h200.txtpb"}


_NAME = re.compile(r"^(?P<model>[a-z0-9]+)(?::(?P<count>[0-9]+))?$")


class GpuCompileMissing(RuntimeError):
    """JAX's CUDA plugin is not installed, or did not start."""


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """GPUs of one host by name: ``"h200"`` is one H200, ``"h200:8"`` eight (``model`` a key
    of ``TARGETS``)."""

    name: str
    model: str
    chips: int

    @property
    def hbm_bytes(self) -> int:
        """Memory of one GPU, as CUDA reports it (its target config)."""
        config = target_config(self.model)
        return int(re.search(r"device_memory_size: (\d+)", config)[1])

    def hbm_per_device(self, devices) -> int:
        del devices  # one device a GPU
        return self.hbm_bytes


def parse_target(name: str) -> GpuTarget:
    """``"h200"`` or ``"h200:8"`` as a ``GpuTarget``; ``ValueError`` for anything else."""
    match = _NAME.match(name) if isinstance(name, str) else None
    if match is None or match["model"] not in TARGETS:
        raise ValueError(
            f"GPU target {name!r} must be one of {', '.join(TARGETS)}, optionally with a GPU "
            "count, e.g. h200 or h200:8"
        )
    if match["count"] is not None and int(match["count"]) < 1:
        raise ValueError(f"GPU target {name!r}: the GPU count must be at least 1, e.g. h200:8")
    return GpuTarget(name, match["model"], int(match["count"] or 1))


def plugin_installed() -> bool:
    return any(
        importlib.util.find_spec(name) is not None
        for name in ("jax_cuda13_plugin", "jax_cuda12_plugin")
    )


def target_config(name: str) -> str:
    """The ``GpuTargetConfig`` text of target ``name`` (a key of ``TARGETS``)."""
    if not isinstance(name, str) or name not in TARGETS:
        raise ValueError(f"GPU target {name!r} must be one of {', '.join(TARGETS)}")
    return (importlib.resources.files(__package__) / "targets" / TARGETS[name]).read_text()


def target_device(name: str) -> jax.Device:
    """A device of GPU target ``name`` (a key of ``TARGETS``) to compile for, on any host.

    Raises:
      ValueError: ``name`` is not a key of ``TARGETS``.
      GpuCompileMissing: the CUDA plugin is not installed or did not start.
    """
    target_config(name)
    return target_devices(name)[0]


def target_devices(name: str) -> list[jax.Device]:
    """The devices of GPU target ``name`` (``parse_target``: ``"h200:8"`` is eight GPUs of
    one host) to compile for, on any host. Raises as ``target_device``."""
    target = parse_target(name)
    config = target_config(target.model)
    if not plugin_installed():
        raise GpuCompileMissing(f"compiling for a GPU needs JAX's CUDA plugin: {INSTALL_COMMAND}")
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=config, topology=f"1x1x{target.chips}"
        )
    except NotImplementedError:
        raise GpuCompileMissing(
            "JAX's CUDA plugin did not start (on a host without a GPU it looks for cuDNN "
            "first): start the process with JAX_PLATFORMS=cpu or "
            "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1"
        ) from None
    return list(topology.devices)


@typing.no_type_check  # a public entry point: it names a bad fn itself
def compile_for(
    fn: Callable,
    *args,
    device: jax.Device | None = None,
    autotune_results: str | os.PathLike | None = None,
    options: dict | None = None,
) -> jax.stages.Compiled:
    """``fn`` (a function, or a ``jax.jit`` of one with its own shardings) compiled for GPU
    ``device`` (``target_device``). ``args`` are pytrees of ``jax.ShapeDtypeStruct`` or arrays
    (their shapes and dtypes), placed on ``device`` unless they carry a sharding of their own
    (``tpu_compile.place_arguments``); ``options`` are XLA debug options for this compile
    alone (``xla_dump_to``, ...)."""
    _check_function("compile_for", fn)
    if device is not None and (not isinstance(device, jax.Device) or device.platform != "gpu"):
        raise ValueError(
            f"compile_for: device must be a GPU device of target_device, got {device!r}"
        )
    options = dict(options or {})
    if autotune_results is not None:
        path = Path(autotune_results)
        if not path.is_file():
            raise ValueError(f"compile_for: autotune_results {str(path)!r} is not a file")
        options["xla_gpu_load_autotune_results_from"] = str(path)
    placed = place_arguments("compile_for", args, device)
    gpus = {d for leaf in jax.tree.leaves(placed) for d in leaf.sharding.device_set}
    if not gpus:
        raise ValueError("compile_for: no argument to place on a GPU: give at least one")
    jitted = fn if isinstance(fn, jax.stages.Wrapped) else jax.jit(fn)
    with _abstract_gpu(next(iter(gpus))):
        lowered = jitted.trace(*placed).lower()
    with no_cache_entry():
        return lowered.compile(options)


@dataclasses.dataclass(frozen=True)
class Report:
    """What one call of a program compiled for ``target`` launches and needs.

    ``error`` is XLA's refusal to build the program (``kernels`` then holds the kernel it
    refused, where the message says which limit); the other figures are then absent."""

    target: str
    launches: Launches | None
    argument_bytes: int | None
    output_bytes: int | None
    alias_bytes: int | None
    temp_bytes: int | None
    device_memory: int
    kernels: tuple[Kernel, ...]
    tuned: bool
    error: str | None = None

    @property
    def peak_bytes(self) -> int | None:
        """Arguments, outputs and temporaries, less the outputs that reuse an argument."""
        if self.temp_bytes is None:
            return None
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def launchable(self) -> bool:
        return self.error is None and all(k.launchable for k in self.kernels)

    def lines(self) -> list[str]:
        """The report as text, one fact a line."""
        from gdn_jax.gpu_compile.text import report_lines

        return report_lines(self)


@typing.no_type_check  # a public entry point: it names a bad fn itself
def report(
    fn: Callable,
    *args,
    target: str = "h200",
    autotune_results: str | os.PathLike | None = None,
    open_trips: typing.Mapping[str, tuple[int, ...]] | None = None,
) -> Report:
    """``fn`` compiled for GPU ``target`` (``parse_target``: ``"h200"``, or ``"h200:8"``,
    whose first GPU takes the arguments that carry no sharding of their own) with ``args`` as
    in ``compile_for``: its launches per call, memory and Pallas kernels (module docstring).
    A program XLA refuses to build (a kernel over a block's shared memory) is a report with
    ``error`` set, not an exception. ``open_trips``: by Mosaic kernel name, the trips of the
    loops it bounds at run time, for the model of its time (``kernels.mosaic_kernels``)."""
    _check_function("report", fn)
    device = target_devices(target)[0]
    config = target_config(parse_target(target).model)
    limits = kernel_reports.Limits.of(config)
    memory_size = int(config.split("device_memory_size: ")[1].split()[0])
    with tempfile.TemporaryDirectory(prefix="gdn_jax-gpu-compile-") as folder:
        xla_dump, mosaic_dump = Path(folder, "xla"), Path(folder, "mosaic")
        mosaic_dump.mkdir()
        options = {
            "xla_dump_to": str(xla_dump),
            "xla_dump_hlo_as_text": True,
        }
        try:
            with _mosaic_dumps(mosaic_dump):
                compiled = compile_for(
                    fn, *args, device=device, autotune_results=autotune_results, options=options
                )
        except (jax.errors.JaxRuntimeError, ValueError) as error:
            refused = kernel_reports.over_shared_memory(str(error))
            if refused is None:
                raise
            kernels = (*kernel_reports.mosaic_kernels(mosaic_dump, limits, open_trips), refused)
            return Report(target, None, None, None, None, None, memory_size, kernels,
                          autotune_results is not None, str(error).splitlines()[0])  # fmt: skip
        launches = thunks.read_dump(xla_dump)
        kernels = tuple(kernel_reports.mosaic_kernels(mosaic_dump, limits, open_trips))
    memory = compiled.memory_analysis()
    return Report(
        target=target,
        launches=launches,
        argument_bytes=memory.argument_size_in_bytes,
        output_bytes=memory.output_size_in_bytes,
        alias_bytes=memory.alias_size_in_bytes,
        temp_bytes=memory.temp_size_in_bytes,
        device_memory=memory_size,
        kernels=tuple(kernels),
        tuned=autotune_results is not None,
    )


def _check_function(fn_name: str, fn) -> None:
    """``TypeError`` for an ``fn`` that cannot be called (an op's name as a string, say):
    JAX's own message, "Expected a callable value", names neither the function nor fn."""
    if not callable(fn):
        raise TypeError(
            f"{fn_name}: fn={fn!r:.60} must be a function or a jax.jit of one, got "
            f"{type(fn).__name__}"
        )


@contextlib.contextmanager
def _abstract_gpu(device):
    """Tracing under an abstract mesh of ``device``'s kind, unless a mesh is in context
    already (the caller's, over the GPUs compiled for): gdn_jax's dispatch asks it whether a
    kernel runs compiled (``dispatch.kernel_interpret``; this host's own device is a CPU)."""
    if not jax.sharding.get_abstract_mesh().empty:
        yield
        return
    kind = jax.sharding.AbstractDevice(
        device_kind=device.device_kind, num_cores=None, platform="gpu"
    )
    mesh = jax.sharding.AbstractMesh(
        (1,), ("gpu",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=kind
    )
    with jax.sharding.use_abstract_mesh(mesh):
        yield


@contextlib.contextmanager
def _mosaic_dumps(folder: Path):
    """Mosaic GPU's dumps into ``folder`` while a program lowers (its kernels compile then)."""
    dumps = dict(MOSAIC_GPU_DUMP_TO=str(folder), MOSAIC_GPU_DUMP_PTX="1",
                 MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_SASS_CTRL="1")  # fmt: skip
    saved = {name: os.environ.get(name) for name in dumps}
    os.environ.update(dumps)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
