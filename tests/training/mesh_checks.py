"""Head- and sequence-parallel layers and training on 8 virtual CPU devices; run by
test_mesh.py in its own process (the device count is fixed when JAX starts).

Checks, each against one device:
- the KDA and GDN-2 layers (grouped value heads, short convolutions with their halo) on
  (data 2, model 2, seq 2) in the hoisted schedule: outputs and the gradients of the input
  and of every parameter, and their compiled forward and backward gathers no token-sized
  array (only states and the convolution's halo cross devices); the Gated DeltaNet layer,
  whose recurrent path is theirs (``RecurrentLayer``), with packed sequences that cross
  shard boundaries on (model 2, seq 4) in the in_scan schedule (the ops and the halo on
  more shards are sequence_parallel_checks.py's);
- eight training steps of a small hybrid model (KDA + GDN-2 + attention, chunked) with
  ``train.mesh`` (data 2, model 2, seq 2): the same losses;
- the compiled training step gathers no q, k or v across heads;
- the checkpoint of that run at step 5 restores on a mesh that splits T four ways (seq 4)
  and the run goes on with the losses of the one-device run.
Prints one line per check; exits with status 1 if any failed.
"""

import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

# The support modules (process_setup, tolerance) live in tests/, one level up.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import process_setup  # noqa: E402

process_setup.set_up()  # as in conftest.py

from gdn_jax.training.xla_flags import add_flags  # noqa: E402

add_flags({"xla_force_host_platform_device_count": "8"})  # before the first computation

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from tolerance import assert_close  # noqa: E402

# The layers under the suite's strict promotion; training (optax's own arithmetic) under
# JAX's default, as in test_train.py.
from gdn_jax import GatedDeltaNet, GatedDeltaNet2, KimiDeltaAttention  # noqa: E402
from gdn_jax.models import ModelConfig  # noqa: E402
from gdn_jax.training import mesh as mesh_lib  # noqa: E402
from gdn_jax.training.config import Config, MeshConfig, TrainConfig  # noqa: E402
from gdn_jax.training.loop import run  # noqa: E402
from gdn_jax.training.metrics_log import MetricsLog  # noqa: E402

FAILED = []


def check(name):
    def wrap(fn):
        began = time.perf_counter()
        try:
            fn()
            print(f"ok   {name} ({time.perf_counter() - began:.1f} s)", flush=True)
        except Exception:
            FAILED.append(name)
            print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
        return fn

    return wrap


def mesh(data, model, seq):
    devices = np.asarray(jax.devices()[: data * model * seq]).reshape(data, model, seq)
    return Mesh(devices, mesh_lib.AXES)


LAYER = dict(num_heads=2, head_dim=8, num_v_heads=4, expand_v=1.0, chunk_size=16)


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


for layer_class in (KimiDeltaAttention, GatedDeltaNet2):
    name = layer_class.__name__

    @check(f"{name} on (data 2, model 2, seq 2): equal to one device, no tokens gathered")
    def _(layer_class=layer_class, name=name):
        expected = layer_run(None, X, "hoisted", layer_class=layer_class)
        hlo = []
        actual = layer_run(mesh(2, 2, 2), X, "hoisted", layer_class=layer_class, hlo=hlo)
        compare(actual, expected, f"{name}, mesh (2, 2, 2)")
        # T = 48 and T / seq = 24 tokens; D = 16, H*K = 16, HV*V = 32, state rows V = K = 8:
        # the state and the convolution's halo cross the shards, no activation does.
        gathered = token_gathers(hlo[0], (24, 48))
        lines = [line.strip()[:200] for line in hlo[0].splitlines() if "all-gather(" in line]
        assert not gathered, "token-sized all-gathers:\n" + "\n".join(lines)
        shapes = re.findall(r"= (\w+\[[\d,]*\])\S* all-gather", hlo[0])
        print(f"     all-gathers: {sorted(set(shapes))}")


@check("layer with packed sequences across shard boundaries")
def _():
    expected = layer_run(None, X_PACKED, "in_scan", CU)
    compare(layer_run(mesh(1, 2, 4), X_PACKED, "in_scan", CU), expected, "packed, mesh (1, 2, 4)")


def make_config(out_dir, steps, mesh_config):
    """A small hybrid of the channel-gated rules and attention, chunked in the CPU's
    schedule (the form that passes the state across a seq axis)."""
    from gdn_jax.data.mqar import MQARConfig

    return Config(
        model=ModelConfig(
            vocab_size=64,
            d_model=48,
            mixers=("kda", "gdn2", "attention"),
            num_heads=4,
            head_dim=8,
            num_v_heads=8,
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


ROOT = Path(tempfile.mkdtemp())
ONE = MeshConfig(data=1, model=1, seq=1)
CUBE = MeshConfig(data=2, model=2, seq=2)


@check("8 training steps on (data 2, model 2, seq 2) equal one device")
def _():
    run(make_config(ROOT / "one", 8, ONE), devices=jax.devices()[:1])
    run(make_config(ROOT / "cube", 8, CUBE))
    one, cube = losses(ROOT / "one"), losses(ROOT / "cube")
    assert sorted(one) == sorted(cube) == list(range(1, 9)), (one, cube)
    steps = range(1, 9)
    assert_close([cube[s] for s in steps], [one[s] for s in steps], jnp.float32, "losses")


@check("the compiled step gathers no q, k or v across heads")
def _():
    from gdn_jax.data.mqar import make_batch, make_mqar
    from gdn_jax.models import LanguageModel
    from gdn_jax.training.step import loss_and_accuracy

    config = make_config(ROOT / "unused", 8, CUBE)
    where = mesh(2, 2, 2)
    graphdef, params = nnx.split(LanguageModel(config.model, rngs=nnx.Rngs(0)))
    pure = jax.device_put(nnx.to_pure_dict(params), mesh_lib.param_shardings(where, params))
    batch = mesh_lib.place(
        make_batch(*make_mqar(config.data, num_examples=8, seed=0)),
        mesh_lib.batch_shardings(where),
    )

    def loss(pure, batch):
        return loss_and_accuracy(nnx.merge(graphdef, pure), batch, logits_at_labels=True)[0]

    with jax.set_mesh(where):
        hlo = jax.jit(jax.grad(loss)).lower(pure, batch).compile().as_text()
    # Sizes are picked apart: T = 40 and T / seq = 20 tokens, d_model 48, H*K = 32,
    # HV*V = 64, state rows V+K = 16.
    across_heads, gathers = gathers_across_heads(hlo, (20, 40))
    lines = [line.strip()[:200] for line in hlo.splitlines() if "all-gather(" in line]
    assert not across_heads, "all-gathers across heads:\n" + "\n".join(lines)
    print(f"     all-gathers (shape, axis): {gathers}")


@check("the run's step-5 checkpoint restores on (seq 4) and goes on as one device")
def _():
    cube = ROOT / "cube"
    # Go back to the step-5 checkpoint, then continue with T split four ways (4 devices).
    shutil.rmtree(cube / "checkpoints" / "8")
    (cube / "summary.json").unlink()
    seq4 = MeshConfig(data=1, model=1, seq=4)
    run(make_config(cube, 8, seq4), resume=True, devices=jax.devices()[:4])
    one, resumed = losses(ROOT / "one"), losses(cube)
    steps = range(6, 9)
    assert_close([resumed[s] for s in steps], [one[s] for s in steps], jnp.float32, "resumed")


if FAILED:
    print(f"{len(FAILED)} check(s) failed: {FAILED}")
    sys.exit(1)
print("all mesh checks passed")
