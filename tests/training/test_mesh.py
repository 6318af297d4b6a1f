"""Training on a mesh: the mesh config, and in the child session of kind ``devices=8``
(support/child_session.py: the device count is fixed when JAX starts) the layers and
training on 8 virtual CPU devices, each against one device:

- the KDA and GDN-2 layers (grouped value heads, short convolutions with their halo) on
  (data 2, model 2, seq 2) in the hoisted schedule: outputs and the gradients of the input
  and of every parameter, and their compiled forward and backward gather no token-sized
  array (only states and the convolution's halo cross devices); the same for the Gated
  DeltaProduct layer (n = 2); the Gated DeltaNet layer,
  whose recurrent path is theirs (``RecurrentLayer``), with packed sequences that cross
  shard boundaries on (model 2, seq 4) in the in_scan schedule (the ops and the halo on
  more shards are test_sequence_parallel_shards.py's);
- eight training steps of a small hybrid model (a KDA and a GDN-2 layer, chunked) with
  ``train.mesh`` (data 2, model 2, seq 2): the same losses; its compiled training step
  gathers no q, k or v across heads; its checkpoint at step 5 restores on a mesh that
  splits T four ways (seq 4) and the run goes on with the losses of the one-device run.
Two processes training as one: test_two_processes_train_like_one.
"""

import functools
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from support.runs import command_args, train_losses
from support.tolerance import assert_close

from gdn_jax import GatedDeltaNet, GatedDeltaNet2, GatedDeltaProduct, KimiDeltaAttention
from gdn_jax.models import ModelConfig
from gdn_jax.training import mesh as mesh_lib
from gdn_jax.training.compile_only import train_step_inputs
from gdn_jax.training.config import Config, MeshConfig, TrainConfig, load_config
from gdn_jax.training.errors import RunError
from gdn_jax.training.loop import run
from gdn_jax.training.mesh import mesh_shape
from gdn_jax.training.metrics_log import MetricsLog


def on_8_devices(test):
    """In the child session of 8 CPU devices, whose start and compiles take about 40 s of
    one core: among the slow tests, which the README's command leaves out and CI runs."""
    return pytest.mark.slow(pytest.mark.child(devices=8)(test))


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


def mesh(data, model, seq):
    devices = np.asarray(jax.devices()[: data * model * seq]).reshape(data, model, seq)
    return Mesh(devices, mesh_lib.AXES)


LAYER = dict(num_heads=2, head_dim=8, num_v_heads=4, expand_v=1.0, chunk_size=16)


@on_8_devices
def test_a_layer_whose_impl_cannot_split_t_is_refused_under_a_sequence_mesh():
    layer = GatedDeltaNet(16, rngs=nnx.Rngs(0), impl="recurrent", **LAYER)
    message = r"GatedDeltaNet: impl='recurrent' cannot split T over the mesh axis 'seq'"
    with jax.set_mesh(mesh(1, 1, 8)), pytest.raises(ValueError, match=message):
        jax.eval_shape(lambda x: layer(x), jnp.zeros((1, 32, 16)))


def layer_loss(graphdef, params, x, cu_seqlens):
    y = nnx.merge(graphdef, params)(x, cu_seqlens=cu_seqlens)
    return jnp.sum(jnp.sin(y)), y


def layer_run(where, x, schedule, cu_seqlens=None, layer_class=GatedDeltaNet, hlo=None):
    """The layer's output and the gradients of x and every parameter, jitted on ``where``
    with the op's ``schedule``; with a list ``hlo``, the compiled program's text is appended
    to it."""
    layer = layer_class(16, rngs=nnx.Rngs(0), schedule=schedule, **LAYER)
    graphdef, params = nnx.split(layer)
    # The output comes out of the same forward that the gradients run through.
    grad = jax.value_and_grad(layer_loss, argnums=(1, 2), has_aux=True)

    def both(params, x, cu_seqlens):
        (loss, y), grads = grad(graphdef, params, x, cu_seqlens)
        return y, (loss, grads)

    if where is None:
        with jax.numpy_dtype_promotion("strict"):
            return jax.jit(both)(params, x, cu_seqlens)
    with jax.set_mesh(where):
        placed = jax.device_put(nnx.to_pure_dict(params), mesh_lib.param_shardings(where, params))
        nnx.replace_by_pure_dict(params, placed)
        data = "data" if x.shape[0] % where.shape["data"] == 0 and x.shape[0] > 1 else None
        x = jax.device_put(x, NamedSharding(where, P(data, "seq")))
        with jax.numpy_dtype_promotion("strict"):
            compiled = jax.jit(both).lower(params, x, cu_seqlens).compile()
            if hlo is not None:
                hlo.append(compiled.as_text())
            return compiled(params, x, cu_seqlens)


def compare(actual, expected, what):
    (y_a, (l_a, g_a)), (y_e, (l_e, g_e)) = actual, expected
    assert_close(y_a, y_e, jnp.float32, f"{what}: y")
    assert_close(l_a, l_e, jnp.float32, f"{what}: loss")
    d_params_a, d_x_a = g_a
    d_params_e, d_x_e = g_e
    assert_close(d_x_a, d_x_e, jnp.float32, f"{what}: dx")
    flat_a = nnx.to_flat_state(d_params_a)
    flat_e = dict(nnx.to_flat_state(d_params_e))
    for path, value in flat_a:
        assert_close(value.get_value(), flat_e[path].get_value(), jnp.float32, f"{what}: d{path}")


rng = np.random.default_rng(0)
X = jnp.asarray(rng.standard_normal((2, 48, 16)), jnp.float32)
X_PACKED = X[:1]
CU = jnp.asarray([0, 5, 20, 37, 48], jnp.int32)  # sequences crossing the 4-way bounds 12, 24, 36


def gathers_across_heads(hlo, token_sizes):
    """The all-gathers ``(shape, axis)`` in ``hlo`` of an array with a token axis (one of
    ``token_sizes``, picked apart from the other sizes) along another axis: gathering q, k
    or v across heads. Gathering the token axis is attention fetching K and V along seq, or
    the partitioner running a layer whole over T, which the design allows."""
    gathers = re.findall(r"= \w+\[([\d,]*)\]\S* all-gather\(.*?dimensions=\{(\d+)\}", hlo)
    across_heads = []
    for shape, dim in gathers:
        sizes = [int(n) for n in shape.split(",") if n]
        tokens = [i for i, n in enumerate(sizes) if n in token_sizes]
        if tokens and int(dim) not in tokens:
            across_heads.append((shape, dim))
    return across_heads, sorted(set(gathers))


def token_gathers(hlo, token_sizes):
    """The all-gathers in ``hlo`` of an array with a token axis (one of ``token_sizes``),
    along any axis."""
    gathers = re.findall(r"= \w+\[([\d,]*)\]\S* all-gather\(", hlo)
    return [g for g in gathers if any(int(n) in token_sizes for n in g.split(",") if n)]


@on_8_devices
@pytest.mark.parametrize(
    "layer_class",
    [KimiDeltaAttention, GatedDeltaNet2, GatedDeltaProduct],
    ids=lambda c: c.__name__,
)
def test_layer_on_data_model_seq_equals_one_device_and_gathers_no_tokens(
    layer_class,
):
    name = layer_class.__name__
    expected = layer_run(None, X, "hoisted", layer_class=layer_class)
    hlo = []
    actual = layer_run(mesh(2, 2, 2), X, "hoisted", layer_class=layer_class, hlo=hlo)
    compare(actual, expected, f"{name}, mesh (2, 2, 2)")
    # T = 48 and T / seq = 24 tokens; D = 16, H*K = 16, HV*V = 32, state rows V = K = 8:
    # the state and the convolution's halo cross the shards, no activation does.
    gathered = token_gathers(hlo[0], (24, 48))
    lines = [line.strip()[:200] for line in hlo[0].splitlines() if "all-gather(" in line]
    assert not gathered, "token-sized all-gathers:\n" + "\n".join(lines)


@on_8_devices
def test_layer_with_packed_sequences_across_shard_boundaries_equals_one_device():
    expected = layer_run(None, X_PACKED, "in_scan", CU)
    compare(layer_run(mesh(1, 2, 4), X_PACKED, "in_scan", CU), expected, "packed, mesh (1, 2, 4)")


def make_config(out_dir, steps, mesh_config):
    """A small hybrid of the channel-gated rules, chunked in the CPU's schedule (the form
    that passes the state across a seq axis). Attention on a seq axis is the partitioner's
    (it gathers K and V); with it, and at width 48, the two runs took 50 s instead of 31."""
    from gdn_jax.data.mqar import MQARConfig

    return Config(
        model=ModelConfig(
            vocab_size=64,
            d_model=32,
            mixers=("kda", "gdn2"),
            num_heads=2,
            head_dim=8,
            num_v_heads=4,
            chunk_size=16,
            schedule="in_scan",
        ),
        data=MQARConfig(vocab_size=64, seq_len=40, num_kv_pairs=4),
        train=TrainConfig(
            steps=steps,
            batch_size=8,
            warmup_steps=2,
            eval_every=1000,
            eval_examples=8,
            checkpoint_every=5,
            out_dir=str(out_dir),
            progress=False,
            mesh=mesh_config,
        ),
    ).validate()


def losses(out_dir):
    return {
        row["step"]: row["loss"]
        for row in MetricsLog(Path(out_dir) / "metrics.jsonl").read("train")
    }


ONE = MeshConfig(data=1, model=1, seq=1)
CUBE = MeshConfig(data=2, model=2, seq=2)


@functools.cache
def hybrid_runs() -> Path:
    """Eight steps of the hybrid on one device (``one``) and on (data 2, model 2, seq 2)
    (``cube``), made once per session and read only: under JAX's default promotion, as
    test_train.py trains (optax's own arithmetic)."""
    root = Path(tempfile.mkdtemp())
    with jax.numpy_dtype_promotion("standard"):
        run(make_config(root / "one", 8, ONE), devices=jax.devices()[:1])
        run(make_config(root / "cube", 8, CUBE))
    return root


@on_8_devices
def test_training_on_data_model_seq_logs_the_losses_of_one_device():
    one, cube = losses(hybrid_runs() / "one"), losses(hybrid_runs() / "cube")
    assert sorted(one) == sorted(cube) == list(range(1, 9)), (one, cube)
    steps = range(1, 9)
    assert_close([cube[s] for s in steps], [one[s] for s in steps], jnp.float32, "losses")


@on_8_devices
def test_the_compiled_step_gathers_no_q_k_or_v_across_heads():
    hybrid_runs()  # its step, compiled, is in the compilation cache
    config = make_config(Path(tempfile.mkdtemp()) / "unused", 8, CUBE)
    with jax.numpy_dtype_promotion("standard"):
        train_step, state, batch, where = train_step_inputs(config, jax.devices())
        with jax.set_mesh(where):
            hlo = train_step.lower(state, batch).compile().as_text()
    # Sizes are picked apart: T = 40 and T / seq = 20 tokens, d_model 32, H*K = 16,
    # HV*V = 32, state rows V+K = 16.
    across_heads, gathers = gathers_across_heads(hlo, (20, 40))
    lines = [line.strip()[:200] for line in hlo.splitlines() if "all-gather(" in line]
    assert not across_heads, "all-gathers across heads:\n" + "\n".join(lines)


@on_8_devices
def test_a_checkpoint_restores_on_seq_4_and_the_run_goes_on_as_one_device(tmp_path):
    # From the cube run's step-5 checkpoint, T split four ways (4 devices).
    cube = tmp_path / "cube"
    shutil.copytree(hybrid_runs() / "cube", cube)
    shutil.rmtree(cube / "checkpoints" / "8")
    (cube / "summary.json").unlink()
    seq4 = MeshConfig(data=1, model=1, seq=4)
    with jax.numpy_dtype_promotion("standard"):
        run(make_config(cube, 8, seq4), resume=True, devices=jax.devices()[:4])
    one, resumed = losses(hybrid_runs() / "one"), losses(cube)
    steps = range(6, 9)
    assert_close([resumed[s] for s in steps], [one[s] for s in steps], jnp.float32, "resumed")


def free_port():

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
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
