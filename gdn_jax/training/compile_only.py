"""``gdn-train --compile-only --topology v5e:2x4`` (or ``h200:8``): will a config's train
step fit a TPU slice, or a host's NVIDIA GPUs?

The model and optimizer are built abstractly (shapes only, nothing allocated), ``train.mesh``
is laid over the slice's devices, and the train step is compiled ahead of time on this host
by libtpu's TPU compiler (``gdn_jax.tpu_compile``) or XLA:GPU (``gdn_jax.gpu_compile``). The
figures are the compiler's, for one device: what the step's arguments, outputs and
temporaries take, against the device's memory.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax

from gdn_jax.gpu_compile import GpuTarget
from gdn_jax.gpu_compile import compile_for as compile_for_gpu
from gdn_jax.tpu_compile import Topology, compile_for, devices_per_chip
from gdn_jax.training import mesh as mesh_lib
from gdn_jax.training.config import Config
from gdn_jax.training.errors import is_out_of_memory, reason
from gdn_jax.training.state import abstract_batch, train_setup

MIB = 2**20


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """One device's share of a compiled train step, in bytes, and its FLOPs; ``temp``,
    ``total`` and ``flops`` are None when the compiler ran out of HBM (``out_of_memory``
    says by how much)."""

    state: int  # parameters and optimizer state, as sharded (before the compiler's padding)
    batch: int  # the batch, as sharded
    hbm: int  # HBM of one device: a chip's, or half of it on v4 (a device per TensorCore)
    temp: int | None = None  # the compiler's temporaries
    total: int | None = None  # the compiler's arguments + outputs - donated + temporaries
    flops: float | None = None  # XLA's count for one device, each loop body counted once
    out_of_memory: str | None = None  # the compiler's reason

    @property
    def fits(self) -> bool:
        return self.total is not None and self.total <= self.hbm


def train_step_inputs(config: Config, devices):
    """``(train_step, state, batch, mesh)``: the train step of ``config`` jitted for
    ``train.mesh`` over ``devices`` and its abstract arguments, placed (``train_setup`` with
    ``abstract``: shapes only). Raises ``RunError`` when the mesh does not fit the devices."""
    mesh = mesh_lib.check_mesh(config, devices)
    steps, state = train_setup(config, mesh, abstract=True)
    return steps.train_step, state, abstract_batch(config, steps.batch_shardings), mesh


def shard_bytes(tree) -> int:
    """Bytes of one device's shards of a pytree of sharded ``jax.ShapeDtypeStruct``s."""
    return sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
    )


def step_memory(config: Config, topology: Topology | GpuTarget, devices) -> StepMemory:
    """Compile the train step for ``devices`` (a slice of ``topology``, or a host's GPUs)
    and read its memory and FLOPs for one device."""
    train_step, state, batch, mesh = train_step_inputs(config, devices)
    gpu = isinstance(topology, GpuTarget)
    hbm = topology.hbm_bytes // (1 if gpu else devices_per_chip(devices))
    sizes = StepMemory(state=shard_bytes(state), batch=shard_bytes(batch), hbm=hbm)
    try:
        with jax.set_mesh(mesh):
            compiled = (compile_for_gpu if gpu else compile_for)(train_step, state, batch)
    except jax.errors.JaxRuntimeError as error:
        if not is_out_of_memory(error):
            raise
        message = reason(error, limit=None)
        found = re.search(r"HBM, (.*?)(?:\. HLO module.*)?$", message)
        return dataclasses.replace(sizes, out_of_memory=message if found is None else found[1])
    stats = compiled.memory_analysis()
    total = (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes
    )
    # XLA:GPU estimates no cost without the device (its gemms are not autotuned).
    flops = (compiled.cost_analysis() or {}).get("flops")
    return dataclasses.replace(sizes, temp=stats.temp_size_in_bytes, total=total, flops=flops)


def report(memory: StepMemory, topology: Topology | GpuTarget, devices) -> list[str]:
    """The lines ``--compile-only`` prints: the table per device, the FLOPs, the verdict."""
    per_chip = 1 if isinstance(topology, GpuTarget) else devices_per_chip(devices)
    unit = "GPU" if isinstance(topology, GpuTarget) else "chip" if per_chip == 1 else "device"
    who = unit if per_chip == 1 else f"device ({per_chip} per {topology.generation} chip)"
    hbm = f"{memory.hbm / 2**30:.4g} GiB"
    rows = [
        ("parameters + optimizer state", memory.state),
        ("batch", memory.batch),
        ("temp", memory.temp),
        ("total", memory.total),
    ]
    lines = [f"per {who}, MiB (HBM {hbm}):"]
    for name, size in rows:
        lines.append(f"  {name:<30}{'-' if size is None else f'{size / MIB:.2f}':>12}")
    if memory.out_of_memory is not None:
        lines.append(f"does NOT fit: the TPU compiler ran out of HBM: {memory.out_of_memory}")
        return lines
    if memory.flops is None:
        lines.append(f"compiled FLOPs per step per {unit}: not estimated without the device")
    else:
        lines.append(
            f"compiled FLOPs per step per {unit}: {memory.flops:.3e} (XLA's count, in which a "
            "loop body counts once)"
        )
    verdict = "fits" if memory.fits else "does NOT fit"
    lines.append(
        f"{verdict}: {memory.total / MIB:.2f} MiB of {hbm} per {unit} "
        f"({memory.total / memory.hbm:.1%}) on {topology.name}"
    )
    return lines
