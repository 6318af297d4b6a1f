"""The op, the layer and the train step compiled for TPUs by libtpu's compiler, on this CPU.

What a test can read of a TPU program without a TPU: that the TPU compiler takes it, its
memory per chip, and its optimised HLO. The loops must be the schedule's: one state pass in
the forward and one more in the backward; in ``"hoisted"`` (``"auto"`` on TPU, also when
traced on a CPU) their bodies hold only state-sized products, never a chunk's ``[C, C]``
work, which ``"in_scan"`` keeps inside. At these sizes every temporary of the op fits the
chip's on-chip VMEM, so its HBM temp is 0; a bound that bites needs sizes whose compile
takes tens of seconds. Each program is compiled once (``tpu_programs``) and read for
everything it shows.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.hlo import count, dots, has_square
from support.tpu_programs import compile_program, devices, op_program

pytest.importorskip("libtpu", reason='compiling for TPU needs libtpu: pip install -e ".[test]"')

from gdn_jax import tpu_compile  # noqa: E402
from gdn_jax.layers import GatedDeltaNet  # noqa: E402
from gdn_jax.training import compile_only  # noqa: E402
from gdn_jax.training.config import load_config  # noqa: E402
from gdn_jax.training.config_paths import CONFIG_DIR  # noqa: E402

# v5e, the chip of docs/benchmarks.md's figures, for the op and the layer; the train step also
# compiles for one more generation (v6e), on another mesh.
TOPOLOGY = "v5e:2x2"
# (B, T, H, K, V) with distinct sizes, so that a [C, C] array is nothing else.
SHAPE, CHUNK = (1, 96, 2, 24, 40), 16
# Products per loop body: the forward's state pass reads and writes the state (2 per chunk,
# 3 with the grouped read split), the backward's reverse pass up to 6.
FORWARD_DOTS, BACKWARD_DOTS = 3, 6


def assert_state_sized_loops(program, *, max_dots):
    for body in program.bodies:
        assert 1 <= len(dots(body)) <= max_dots, dots(body)
        assert not has_square(body, CHUNK)


@pytest.mark.parametrize("schedule", ["hoisted", "in_scan"])
def test_op_compiles_for_tpu_with_its_schedules_loops(schedule):
    # bfloat16 inputs, as TPUs train (the float32 programs have the same loops: measured).
    forward = op_program(TOPOLOGY, schedule, "bfloat16", SHAPE, CHUNK, grad=False)
    both = op_program(TOPOLOGY, schedule, "bfloat16", SHAPE, CHUNK, grad=True)
    assert (forward.whiles, both.whiles) == (1, 2)
    for program in (forward, both):
        assert program.memory.temp_size_in_bytes == 0
    if schedule == "hoisted":
        assert_state_sized_loops(forward, max_dots=FORWARD_DOTS)
        assert_state_sized_loops(both, max_dots=BACKWARD_DOTS)
    else:
        assert all(has_square(body, CHUNK) for body in (*forward.bodies, *both.bodies))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("op", "backward_dots"), [("kda", [2, 4]), ("gdn2", [2, 4]), ("gated_linear_attention", [1, 3])]
)
def test_channel_gated_rules_compile_for_tpu_with_state_sized_loops(op, backward_dots):
    """KDA, GDN-2 and GLA, hoisted, have Gated DeltaNet's two state passes, each body
    state-sized: the forward's two products and the reverse pass's four; GLA's reverse pass
    has three (no WY factor reads the state), and beside it its forward pass one, since the
    outputs read the start states kept for the backward after the loop. A decay a channel
    changes what decays the keys and queries before the loop, not what the loop does."""
    forward = op_program(TOPOLOGY, "hoisted", "bfloat16", SHAPE, CHUNK, grad=False, op=op)
    both = op_program(TOPOLOGY, "hoisted", "bfloat16", SHAPE, CHUNK, grad=True, op=op)
    assert (forward.whiles, both.whiles) == (1, 2)
    assert [len(dots(body)) for body in forward.bodies] == [2]
    assert sorted(len(dots(body)) for body in both.bodies) == backward_dots
    for body in (*forward.bodies, *both.bodies):
        assert not has_square(body, CHUNK)


def test_auto_is_hoisted_when_traced_here_and_compiled_for_tpu():
    """``schedule="auto"`` follows the platform a program is compiled for: the program for a
    v5e chip is the hoisted one, that for this CPU the in_scan one."""
    auto = op_program("v5e:2x2", "auto", "bfloat16", SHAPE, CHUNK, grad=True)
    hoisted = op_program("v5e:2x2", "hoisted", "bfloat16", SHAPE, CHUNK, grad=True)
    assert count(auto.hlo, "fusion") == count(hoisted.hlo, "fusion")
    assert [len(dots(b)) for b in auto.bodies] == [len(dots(b)) for b in hoisted.bodies]
    assert_state_sized_loops(auto, max_dots=BACKWARD_DOTS)


def test_gated_deltanet_layer_compiles_for_tpu():
    layer = nnx.eval_shape(
        lambda: GatedDeltaNet(64, 2, 24, chunk_size=CHUNK, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    )
    graphdef, params = nnx.split(layer)
    x = jax.ShapeDtypeStruct((2, SHAPE[1], 64), jnp.bfloat16)

    def loss(params, x):
        y = nnx.merge(graphdef, params)(x)
        return jnp.sum(y.astype(jnp.float32))

    program = compile_program(
        jax.grad(loss, argnums=(0, 1)), params, x, device=devices(TOPOLOGY)[0]
    )
    assert program.whiles == 2
    assert_state_sized_loops(program, max_dots=BACKWARD_DOTS)


# The train step of train.py on a small GDN (K = V = 24, two chunks per sequence shard).
SMALL_RUN = [
    "model.vocab_size=128", "data.vocab_size=128", "model.d_model=48", "model.mixers=[gdn]",
    f"model.chunk_size={CHUNK}", "data.seq_len=64", "data.num_kv_pairs=4", "train.batch_size=8",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.costly(8)
@pytest.mark.parametrize(("topology", "mesh"), [("v5e:2x2", (1, 2, 2)), ("v6e:2x2", (2, 2, 1))])
def test_train_step_compiles_for_a_tpu_mesh(topology, mesh):
    """data x model x seq over the 4 chips: the step compiles, fits, gathers gradients over
    the chips, passes state between sequence shards over ``seq``, and its GDN layer has the
    hoisted loops (``auto`` on TPU)."""
    data, model, seq = mesh
    sets = [f"train.mesh.data={data}", f"train.mesh.model={model}", f"train.mesh.seq={seq}"]
    config = load_config(CONFIG_DIR / "mqar_gdn.yaml", SMALL_RUN + sets)
    topo = tpu_compile.parse_topology(topology)
    train_step, state, batch, jax_mesh = compile_only.train_step_inputs(config, devices(topology))
    with jax.set_mesh(jax_mesh):
        program = compile_program(train_step, state, batch)
    memory = program.memory
    assert program.whiles == 2  # the layer's state pass, forward and backward
    assert_state_sized_loops(program, max_dots=BACKWARD_DOTS)
    inputs = compile_only.shard_bytes(state) + compile_only.shard_bytes(batch)
    assert inputs <= memory.argument_size_in_bytes <= topo.hbm_bytes
    assert memory.temp_size_in_bytes <= topo.hbm_bytes
    assert count(program.hlo, "all-reduce") > 0
    assert (count(program.hlo, "collective-permute") > 0) == (seq > 1)


def test_a_program_compiles_twice_with_the_persistent_cache_on():
    """The persistent compilation cache (the run's, conftest.py) holds what one compile
    wrote; a compile-only TPU client cannot load it back, so ``compile_for`` keeps TPU
    compiles out of it."""
    device = devices("v5e:2x2")[0]
    x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    options = {
        "jax_persistent_cache_min_compile_time_secs": 0.0,
        "jax_persistent_cache_min_entry_size_bytes": -1,
    }
    saved = {name: getattr(jax.config, name) for name in options}
    try:
        for name, value in options.items():
            jax.config.update(name, value)
        # Whether the cache is used is settled by a process's first compile: make it this
        # host's, as in any session that ran something before it plans a TPU job.
        jax.jit(jnp.cos)(jnp.ones(3)).block_until_ready()
        for _ in range(2):
            compiled = tpu_compile.compile_for(lambda x: jnp.sin(x) @ x.T, x, device=device)
            assert compiled.memory_analysis() is not None
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)


def test_compile_for_places_arrays_of_this_host_on_the_device_it_is_given():
    """A JAX array kept its own sharding, on this host's CPU, and the program was compiled
    for the CPU without a word; a NumPy array was an AttributeError from JAX."""
    device = devices(TOPOLOGY)[0]
    here, numpy = jax.device_put(np.ones((8, 128), np.float32)), np.ones((8, 128), np.float32)
    compiled = tpu_compile.compile_for(lambda a, b: jnp.sin(a) + b, here, numpy, device=device)
    shardings, _ = compiled.input_shardings
    assert [s.device_set for s in shardings] == [{device}, {device}]


def test_compile_for_names_a_bad_argument():
    device = devices(TOPOLOGY)[0]
    x = np.ones((8, 128), np.float32)
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    on_cpu = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cpu)
    cases = [
        ((jnp.sin, x), dict(device="tpu"), TypeError, r"device='tpu' must be a jax.Device of"),
        ((jnp.sin, x), {}, ValueError, r"args\[0\] has no sharding of a device to compile for"),
        ((jnp.sin, [1.5]), dict(device=device), TypeError, r"args\[0\]\[0\] must be an array or"),
        ((jnp.sin, on_cpu), dict(device=device), ValueError, r"args\[0\] has a sharding on cpu"),
        (("sin", x), dict(device=device), TypeError, r"fn='sin' must be a function, got str"),
    ]
    for args, kwargs, error, message in cases:
        with pytest.raises(error, match=rf"^compile_for: {message}"):
            tpu_compile.compile_for(*args, **kwargs)


def test_the_other_helpers_name_a_bad_argument():
    """A topology's name was an AttributeError ('str' object has no attribute
    'accelerator_type'), an int for the devices a TypeError ('int' object is not iterable)."""
    with pytest.raises(TypeError, match=r"^quiet_libtpu: topology='v5e:1x1' must be a Topology"):
        tpu_compile.quiet_libtpu("v5e:1x1", {})
    with pytest.raises(ValueError, match=r"^devices_per_chip: devices=3 must be a non-empty list"):
        tpu_compile.devices_per_chip(3)
