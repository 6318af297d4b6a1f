"""The device mesh of a run (``data``, ``model``, ``seq``) and what is placed on it."""

from __future__ import annotations

import math
import os

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gdn_jax.layers.params import MODEL_AXIS, SEQ_AXIS
from gdn_jax.training.config import Config, MeshConfig
from gdn_jax.training.errors import RunError

DATA_AXIS = "data"
AXES = (DATA_AXIS, MODEL_AXIS, SEQ_AXIS)


def initialize_distributed() -> bool:
    """Start ``jax.distributed`` when this process is one of several: with
    ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` set, or in a
    cluster JAX detects itself (SLURM, Open MPI). Returns whether it did."""
    env = os.environ
    several = "JAX_COORDINATOR_ADDRESS" in env or int(env.get("SLURM_NTASKS", "1")) > 1
    several = several or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
    if several and "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in env:
        # CPU devices of different processes talk through gloo (no effect on GPU or TPU).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if "JAX_COORDINATOR_ADDRESS" in env:
        jax.distributed.initialize(
            coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(env["JAX_NUM_PROCESSES"]),
            process_id=int(env["JAX_PROCESS_ID"]),
        )
        return True
    if "SLURM_JOB_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        jax.distributed.initialize()
        return True
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        jax.distributed.initialize()
        return True
    return False


def mesh_shape(mesh: MeshConfig, num_devices: int) -> tuple[int, int, int]:
    """The ``(data, model, seq)`` sizes over ``num_devices``, with a -1 resolved."""
    sizes = {axis: getattr(mesh, axis) for axis in AXES}
    for axis, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
            raise RunError(f"train.mesh.{axis}={size!r} must be a positive integer or -1")
    free = [axis for axis, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise RunError(f"train.mesh: only one axis may be -1, got {', '.join(free)}")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if num_devices % fixed or (not free and fixed != num_devices):
        raise RunError(
            f"train.mesh {sizes} does not fit the {num_devices} devices (the fixed sizes must "
            f"{'divide' if free else 'multiply to'} {num_devices})"
        )
    if free:
        sizes[free[0]] = num_devices // fixed
    return tuple(sizes[axis] for axis in AXES)


def check_mesh(config: Config, devices) -> Mesh:
    """The run's mesh over ``devices``; the batch, the tokens and the heads must split over
    its axes."""
    data, model, seq = mesh_shape(config.train.mesh, len(devices))
    m, train = config.model, config.train
    rules = [
        (train.batch_size % data == 0, f"train.batch_size={train.batch_size}", "data", data),
        (config.data.seq_len % seq == 0, f"data.seq_len={config.data.seq_len}", "seq", seq),
        (m.num_heads % model == 0, f"model.num_heads={m.num_heads}", "model", model),
        (
            (m.num_v_heads or m.num_heads) % model == 0,
            f"model.num_v_heads={m.num_v_heads}",
            "model",
            model,
        ),
        (not m.use_mlp or m.mlp_width % model == 0, f"the MLP width {m.mlp_width}", "model", model),
    ]
    for fits, what, axis, size in rules:
        if not fits:
            raise RunError(f"{what} does not divide over the {size} devices of train.mesh.{axis}")
    local = config.data.seq_len // seq
    if seq > 1 and local < m.conv_size - 1:
        raise RunError(
            f"data.seq_len={config.data.seq_len} over train.mesh.seq={seq} leaves {local} tokens "
            f"per device, fewer than the convolution's halo of {m.conv_size - 1}"
        )
    return Mesh(np.asarray(devices).reshape(data, model, seq), AXES)


def param_shardings(mesh: Mesh, params: nnx.State) -> dict:
    """``{path: NamedSharding}`` (a pure dict like ``nnx.to_pure_dict(params)``) from the
    partitioning metadata the layers give their parameters."""
    specs = nnx.to_pure_dict(nnx.get_partition_spec(params))
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P)
    )


def opt_state_shardings(mesh: Mesh, optimizer, opt_state, params_shardings):
    """The optimizer state placed like the parameters it mirrors (moments), the rest whole."""
    return optax.tree_utils.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        opt_state,
        params_shardings,
        transform_non_params=lambda _: NamedSharding(mesh, P()),
    )


def batch_shardings(mesh: Mesh) -> dict:
    """Examples over ``data``; the tokens of ``inputs`` and ``labels`` over ``seq``."""
    by_token, by_example = (
        NamedSharding(mesh, P(DATA_AXIS, SEQ_AXIS)),
        NamedSharding(mesh, P(DATA_AXIS)),
    )
    return dict(inputs=by_token, labels=by_token, positions=by_example, targets=by_example)


def place(batch: dict, shardings: dict) -> dict:
    """Host arrays, the same in every process, as global arrays on the mesh: each process
    fills only the shards of its own devices (so it also works across processes)."""
    return {
        name: jax.make_array_from_callback(x.shape, shardings[name], lambda index, x=x: x[index])
        for name, x in batch.items()
    }
