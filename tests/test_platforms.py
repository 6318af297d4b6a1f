"""The choice of JAX backends of a process that imports gdn_jax (``gdn_jax.platforms``): off
libtpu on a host without TPU chips and off a GPU plugin on a host without its GPU, JAX's own
choice everywhere else."""

import os
import subprocess
import sys

import pytest
from support.runs import REPO

from gdn_jax import platforms, tpu_compile


@pytest.fixture
def host(monkeypatch):
    """A host with ``chips`` TPU chips, the GPU platforms ``gpus`` (None: a plugin of
    unknown kind) and libtpu installed or not."""

    def make(chips=0, gpus=(), libtpu=True, present=None):
        monkeypatch.setattr(platforms, "tpu_chips", lambda: chips)
        monkeypatch.setattr(platforms, "gpu_platforms", lambda: gpus)
        here = gpus if present is None else present
        monkeypatch.setattr(platforms, "gpu_present", lambda p: p in here)
        find_spec = platforms.importlib.util.find_spec

        def fake(name, *args):
            if name == "libtpu":
                return object() if libtpu else None
            return find_spec(name, *args)

        monkeypatch.setattr(platforms.importlib.util, "find_spec", fake)

    return make


def test_a_host_without_tpus_keeps_jax_off_libtpu(host):
    host(chips=0)
    assert platforms.host_platforms({}) == "cpu"
    host(chips=0, gpus=["cuda"])
    assert platforms.host_platforms({}) == "cuda,cpu"


def test_a_host_without_the_gpu_of_an_installed_plugin_keeps_jax_off_it(host):
    """The CUDA plugin of the gpu-compile extra logged a cuDNN traceback on every run of a
    host without an NVIDIA driver."""
    host(chips=0, gpus=["cuda"], present=[])
    assert platforms.host_platforms({}) == "cpu"
    host(chips=0, gpus=["cuda"], libtpu=False, present=[])
    assert platforms.host_platforms({}) == "cpu"
    host(chips=4, gpus=["cuda"], present=[])
    assert platforms.host_platforms({}) == "tpu,cpu"
    host(chips=0, gpus=["cuda"], libtpu=False)  # a GPU host without libtpu: JAX's choice
    assert platforms.host_platforms({}) is None


@pytest.mark.parametrize(
    ("environ", "chips", "gpus", "libtpu"),
    [
        ({"JAX_PLATFORMS": "cpu"}, 0, [], True),  # the user chose
        ({"JAX_FORCE_TPU_INIT": "1"}, 0, [], True),  # the user insists on a TPU
        ({}, 4, [], True),  # a TPU host
        ({}, None, [], True),  # this JAX cannot count chips: its choice stands
        ({}, 0, None, True),  # a plugin whose platform is unknown here
        ({}, 0, [], False),  # no libtpu: nothing to keep off
    ],
)
def test_everyone_else_keeps_jaxs_choice(host, environ, chips, gpus, libtpu):
    host(chips=chips, gpus=gpus, libtpu=libtpu)
    assert platforms.host_platforms(environ) is None


def test_jax_counts_the_tpu_chips_of_this_host():
    assert platforms.tpu_chips() == 0  # the suite runs on CPU hosts
    assert set(platforms.gpu_platforms()) <= {"cuda"}  # the test extra's CUDA plugin, if any
    assert not platforms.gpu_present("cuda")


def test_compile_only_keeps_libtpu_logs_in_a_directory_removed_at_exit(monkeypatch, tmp_path):
    exits = []
    monkeypatch.setattr(
        tpu_compile.atexit, "register", lambda fn, *a, **k: exits.append((fn, a, k))
    )
    environ = {}
    tpu_compile.quiet_libtpu(tpu_compile.parse_topology("v5e:2x2"), environ)
    logs = environ["TPU_LOG_DIR"]
    assert os.path.isdir(logs) and environ["TPU_ACCELERATOR_TYPE"] == "v5litepod-4"
    for fn, args, kwargs in exits:
        fn(*args, **kwargs)
    assert not os.path.exists(logs)
    given = {"TPU_LOG_DIR": str(tmp_path)}
    tpu_compile.quiet_libtpu(tpu_compile.parse_topology("v5e:2x2"), given)
    assert given["TPU_LOG_DIR"] == str(tmp_path)


# A user's script: it imports gdn_jax and runs an op, as on the README's tour.
USER_SCRIPT = """
import jax, jax.numpy as jnp
import gdn_jax

q = k = jnp.ones((1, 8, 1, 4)) / 2
v, gates = jnp.ones((1, 8, 1, 4)), jnp.zeros((1, 8, 1))
o, _ = jax.jit(gdn_jax.gated_delta_rule)(q, k, v, gates - 0.1, gates + 0.5)
print(float(o.sum()))
"""


@pytest.mark.costly(6)
def test_a_users_script_prints_nothing_it_did_not_ask_for_and_leaves_no_tpu_logs(
    tmp_path, subprocess_env
):
    """On this host (no TPU, no GPU), with the test extra's libtpu and CUDA plugin installed
    and ``JAX_PLATFORMS`` unset as a user leaves it: libtpu's warnings and ``INVALID_ARGUMENT``
    error, its logs in ``tpu_logs``, and the CUDA plugin's cuDNN traceback came with every
    process."""
    env = {k: v for k, v in subprocess_env.items() if k != "JAX_PLATFORMS"}
    env["TMPDIR"] = str(tmp_path)
    # libtpu logs to /tmp/tpu_logs whatever TMPDIR says, one file set per process id.
    shared_logs = "/tmp/tpu_logs"
    child = subprocess.Popen(
        [sys.executable, "-c", USER_SCRIPT],
        cwd=REPO,  # this checkout's gdn_jax
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = child.communicate(timeout=120)  # about 4 s
    assert child.returncode == 0 and err == "", err
    assert float(out) > 0
    assert os.listdir(tmp_path) == []
    logs = os.listdir(shared_logs) if os.path.isdir(shared_logs) else []
    assert [name for name in logs if name.endswith(f".{child.pid}")] == []
