"""Compiling for TPUs that are not here: libtpu's compiler, ahead of time, on any host.

``jax.experimental.topologies`` describes a TPU slice by name (``"v5e:2x4"``: 8 v5e chips
in a 2 x 4 grid) as devices that JAX compiles for but cannot run on. ``compile_for`` lowers a
function with abstract arguments placed on those devices; the compiled program's
``memory_analysis()`` and optimised HLO (``as_text()``) are the TPU compiler's own, for one
device of the slice. Its ``cost_analysis()`` times are estimates, not measurements, and its
FLOPs count each loop body once, whatever the trip count.

Needs libtpu (``INSTALL_COMMAND``), not a TPU. libtpu keeps one process per host off the
host's TPU chips with a lock file; compiling here touches no chip, so ``topology_devices``
sets ``ALLOW_MULTIPLE_LIBTPU_LOAD`` (unless set) so that compiles in several processes at
once (test workers, a compile beside a CPU run) do not shut each other out.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib.util
import math
import os
import re
import shutil
import tempfile
import typing
from collections.abc import Callable, Sequence

import jax
import numpy as np

INSTALL_COMMAND = 'pip install "libtpu==0.0.52"'
# HBM per chip, in GiB (Google Cloud's TPU pages).
HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}
# Cloud accelerator types name v4 and v5p slices by TensorCores (two per chip), v5e and v6e
# by chips: "v4-8" and "v5p-8" hold 4 chips, "v5litepod-8" and "v6e-8" hold 8.
ACCELERATOR_TYPES = {"v4": ("v4", 2), "v5e": ("v5litepod", 1), "v5p": ("v5p", 2), "v6e": ("v6e", 1)}
_NAME = re.compile(r"^(?P<generation>v[0-9a-z]+):(?P<shape>[1-9][0-9]*(?:x[1-9][0-9]*){1,2})$")


class LibtpuMissing(RuntimeError):
    """libtpu, the TPU compiler, is not installed."""

    def __init__(self):
        super().__init__(f"compiling for TPU needs libtpu; install it with: {INSTALL_COMMAND}")


@dataclasses.dataclass(frozen=True)
class Topology:
    """A TPU slice by name: ``generation`` (a key of ``HBM_GIB``) and chips per axis."""

    name: str
    generation: str
    shape: tuple[int, ...]

    @property
    def chips(self) -> int:
        return math.prod(self.shape)

    @property
    def hbm_bytes(self) -> int:
        """HBM of one chip."""
        return HBM_GIB[self.generation] * 2**30

    @property
    def accelerator_type(self) -> str:
        """The slice's Cloud TPU accelerator type, e.g. ``"v5litepod-8"`` for ``"v5e:2x4"``."""
        prefix, per_chip = ACCELERATOR_TYPES[self.generation]
        return f"{prefix}-{self.chips * per_chip}"


def parse_topology(name: str) -> Topology:
    """``"v5e:2x4"`` as a ``Topology``; ``ValueError`` for a name outside ``HBM_GIB``'s
    generations or not of the form ``<generation>:<chips>x<chips>[x<chips>]``."""
    match = _NAME.match(name) if isinstance(name, str) else None
    if match is None or match["generation"] not in HBM_GIB:
        raise ValueError(
            f"topology {name!r} must be <generation>:<chips per axis, joined by x> with a "
            f"generation of {', '.join(HBM_GIB)}, e.g. v5e:2x4"
        )
    shape = tuple(int(n) for n in match["shape"].split("x"))
    return Topology(name, match["generation"], shape)


def libtpu_installed() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def topology_devices(name: str) -> list[jax.Device]:
    """The devices of TPU slice ``name`` (``parse_topology``), to compile for.

    One device per chip, except v4, whose two TensorCores per chip are two devices here.

    Raises:
      ValueError: ``name`` is malformed, of another generation, or a shape libtpu rejects.
      LibtpuMissing: libtpu is not installed.
    """
    parse_topology(name)
    if not libtpu_installed():
        raise LibtpuMissing()
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)
    except jax.errors.JaxRuntimeError as error:
        reason = str(error).splitlines()[0].removeprefix("INVALID_ARGUMENT: ")
        raise ValueError(f"topology {name!r}: {reason}") from None


@typing.no_type_check  # a public entry point: it names a bad argument itself
def quiet_libtpu(topology: Topology, environ=os.environ) -> None:
    """Describe this host to libtpu as the one worker of ``topology``'s slice, unless the
    environment already does, for a process that only compiles for it.

    Without a TPU, libtpu cannot look up its accelerator type and worker hostnames (Cloud TPU
    metadata) and prints warnings about both when it starts; what it compiles is the same
    either way. Its logs go to a temporary directory removed when the process exits, unless
    ``TPU_LOG_DIR`` names one. Call before the first ``topology_devices``; never in a process
    that runs on TPUs of its own."""
    if not isinstance(topology, Topology):
        raise TypeError(
            f"quiet_libtpu: topology={topology!r:.40} must be a Topology, as "
            f"parse_topology(name) returns, got {type(topology).__name__}"
        )
    environ.setdefault("TPU_ACCELERATOR_TYPE", topology.accelerator_type)
    environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    if "TPU_LOG_DIR" not in environ:  # else libtpu leaves its logs in /tmp/tpu_logs
        logs = tempfile.mkdtemp(prefix="gdn_jax-libtpu-logs-")
        atexit.register(shutil.rmtree, logs, ignore_errors=True)
        environ["TPU_LOG_DIR"] = logs


@typing.no_type_check  # it names a bad argument itself
def place_arguments(fn_name: str, args: tuple, device: jax.Device | None) -> tuple:
    """``args`` as what a program for ``device`` is compiled with: every leaf a
    ``jax.ShapeDtypeStruct``, placed on ``device``, except a ``ShapeDtypeStruct`` that
    carries a sharding of its own, which keeps it. Arrays (JAX or NumPy) give their shapes
    and dtypes only: a JAX array's own sharding is on this host's devices, so it is replaced.

    Raises ``TypeError`` for a ``device`` that is not a ``jax.Device`` or a leaf that is
    neither an array nor a ``ShapeDtypeStruct``, and ``ValueError`` for a leaf that has no
    place without ``device`` or a sharding on another platform than ``device``'s; each names
    ``fn_name``, the argument and what it got."""
    if device is not None and not isinstance(device, jax.Device):
        raise TypeError(
            f"{fn_name}: device={device!r} must be a jax.Device of the slice to compile for "
            f"(tpu_compile.topology_devices(name)[i]), got {type(device).__name__}"
        )

    def place(path, leaf):
        name = f"args{jax.tree_util.keystr(path)}"
        if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is not None:
            platforms = {d.platform for d in leaf.sharding.device_set}
            if device is not None and platforms != {device.platform}:
                raise ValueError(
                    f"{fn_name}: {name} has a sharding on {', '.join(sorted(platforms))} "
                    f"devices, not on device={device} ({device.platform})"
                )
            return leaf
        if not isinstance(leaf, jax.ShapeDtypeStruct | jax.Array | np.ndarray | np.generic):
            raise TypeError(
                f"{fn_name}: {name} must be an array or a jax.ShapeDtypeStruct, got "
                f"{type(leaf).__name__} {leaf!r:.40}"
            )
        if device is None:
            raise ValueError(
                f"{fn_name}: {name} has no sharding of a device to compile for, so device must "
                "be given (without one it would compile for this host)"
            )
        single = jax.sharding.SingleDeviceSharding(device)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=single)

    return jax.tree_util.tree_map_with_path(place, args)


@typing.no_type_check  # a public entry point: it names a bad argument itself
def compile_for(fn: Callable, *args, device: jax.Device | None = None) -> jax.stages.Compiled:
    """``fn`` (a function, or a ``jax.jit`` of one with its own shardings) compiled for the
    devices its arguments are placed on.

    ``args`` are pytrees of arrays (JAX or NumPy: only their shapes and dtypes count) or
    ``jax.ShapeDtypeStruct``s; each leaf is placed on ``device`` (one of
    ``topology_devices``), except a ``ShapeDtypeStruct`` with a sharding of its own
    (``place_arguments``). A leaf with no place raises ``ValueError``: it would compile for
    this host.
    """
    if not callable(fn):
        raise TypeError(f"compile_for: fn={fn!r:.60} must be a function, got {type(fn).__name__}")
    placed = place_arguments("compile_for", args, device)
    jitted = fn if isinstance(fn, jax.stages.Wrapped) else jax.jit(fn)
    lowered = jitted.trace(*placed).lower()
    with no_cache_entry(), _host_flags_hidden():
        return lowered.compile()


@contextlib.contextmanager
def no_cache_entry():
    """No persistent-cache entry for the compiles inside: a compile-only client (a TPU
    topology's, a GPU target's) cannot load an executable back, so with the persistent
    compilation cache on, a second compile of the same program would read the entry the
    first wrote and fail. Whether the cache is used is fixed when a process first compiles,
    so the entry is kept from being written: no compile takes this long."""
    threshold = "jax_persistent_cache_min_compile_time_secs"
    saved = getattr(jax.config, threshold)
    jax.config.update(threshold, 1e9)
    try:
        yield
    finally:
        jax.config.update(threshold, saved)


@contextlib.contextmanager
def _host_flags_hidden():
    """``XLA_FLAGS`` empty while libtpu compiles: they are this host's XLA's, and libtpu's
    XLA, another version, reads them at its first compile and aborts the process on a flag it
    does not know (the CPU flags of ``train.py`` and the tests among them). libtpu takes its
    own flags from ``LIBTPU_INIT_ARGS``."""
    jax.devices()  # this host's XLA reads XLA_FLAGS once, when its backend starts: now
    flags = os.environ.pop("XLA_FLAGS", None)
    try:
        yield
    finally:
        if flags is not None:
            os.environ["XLA_FLAGS"] = flags


@typing.no_type_check  # a public entry point: it names a bad argument itself
def devices_per_chip(devices: Sequence[jax.Device]) -> int:
    """How many of ``devices`` share a chip (2 for v4's TensorCores, else 1)."""
    if isinstance(devices, str) or not isinstance(devices, Sequence) or not devices:
        raise ValueError(
            f"devices_per_chip: devices={devices!r:.40} must be a non-empty list of TPU "
            "devices (topology_devices(name))"
        )
    chips = {tuple(d.coords) for d in devices}
    return len(devices) // len(chips)
