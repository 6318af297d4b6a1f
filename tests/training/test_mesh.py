"""Training on a mesh: the multi-device checks in a subprocess, the mesh config here."""

import os
import subprocess
import sys

import numpy as np
import pytest
from runs import command_args, train_losses

from gdn_jax.training.config import MeshConfig, load_config
from gdn_jax.training.errors import RunError
from gdn_jax.training.mesh import mesh_shape

CHECKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mesh_checks.py")


@pytest.mark.costly(32)
def test_multi_device_checks_pass(subprocess_env):
    """Layers on (data 2, model 2, seq 2) and (model 2, seq 4), training steps, the compiled
    step's all-gathers and a restore onto another mesh (see mesh_checks.py)."""
    # The timeout guards against a hang: the checks take about 32 s on 2 loaded cores.
    result = subprocess.run(
        [sys.executable, CHECKS], env=subprocess_env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"


def test_mesh_sizes_resolve_and_refuse():
    assert mesh_shape(MeshConfig(), 8) == (8, 1, 1)
    assert mesh_shape(MeshConfig(data=-1, model=2, seq=2), 8) == (2, 2, 2)
    assert mesh_shape(MeshConfig(data=2, model=1, seq=-1), 8) == (2, 1, 4)
    with pytest.raises(RunError, match=r"only one axis may be -1, got data, seq"):
        mesh_shape(MeshConfig(data=-1, seq=-1), 8)
    with pytest.raises(RunError, match=r"does not fit the 8 devices"):
        mesh_shape(MeshConfig(data=1, model=3, seq=1), 8)
    with pytest.raises(RunError, match=r"train.mesh.seq=0 must be a positive integer or -1"):
        mesh_shape(MeshConfig(seq=0), 8)


def test_mesh_is_set_from_the_command_line():
    config = load_config(None, ["train.mesh.seq=4", "train.mesh.model=2"])
    assert config.train.mesh == MeshConfig(data=-1, model=2, seq=4)
    with pytest.raises(ValueError, match=r"train.mesh"):
        load_config(None, ["train.mesh.pipeline=2"])


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.costly(13)
def test_two_processes_train_like_one(subprocess_env, tmp_path, finished_run):
    """Two processes of 2 CPU devices each (jax.distributed, a localhost coordinator, gloo)
    run train.py, data-parallel over the 4 devices (the default mesh), with the losses of one
    process on one device (the shared finished run). One process on several devices trains
    in mesh_checks.py."""
    env = dict(
        subprocess_env,
        XLA_FLAGS=f"{subprocess_env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2",
        JAX_COORDINATOR_ADDRESS=f"localhost:{free_port()}",
        JAX_NUM_PROCESSES="2",
    )
    command = [sys.executable, "-m", "gdn_jax.training.cli", *command_args(tmp_path / "two")]
    processes = [
        subprocess.Popen(
            command, env=dict(env, JAX_PROCESS_ID=str(i)), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
        )
        for i in range(2)
    ]  # fmt: skip
    try:
        outputs = [p.communicate(timeout=300)[0] for p in processes]  # a guard against hangs
    finally:
        for p in processes:
            p.kill()
    assert [p.returncode for p in processes] == [0, 0], "\n".join(outputs)
    assert "devices: 4 x cpu" in outputs[0], outputs[0]
    one, two = train_losses(finished_run), train_losses(tmp_path / "two")
    assert len(one) == len(two) == 12
    np.testing.assert_allclose(two, one, rtol=2e-4)
