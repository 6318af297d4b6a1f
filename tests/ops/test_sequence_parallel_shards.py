"""The sequence-parallel ops on 2, 4 and 8 of 8 CPU devices against the one-device op, in
the child session of kind ``devices=8`` (support/child_session.py: the device count is fixed
when JAX starts).

``gated_delta_rule_seq_parallel`` against ``gdn_jax.gated_delta_rule`` (chunked): outputs,
final states and the gradient of every input, with the tolerance table, with and without an
initial state, and with packed sequences across shard boundaries in float32 and float64, each
in one schedule or the other. The same for simple_gla, KDA, GDN-2 and GLA (both also
packed) and Gated DeltaProduct (n = 2), with fewer cases. Also: a two-axis mesh, the sizes of the arrays
that cross devices (Gated DeltaNet and GDN-2), ``halo_from_previous`` and the divisibility
error. The arguments' errors on one device are test_sequence_parallel.py's.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from support.tolerance import assert_close

import gdn_jax
import gdn_jax.ops
from gdn_jax.ops import gated_delta_rule_seq_parallel
from gdn_jax.ops.conv import causal_depthwise_conv, halo_from_previous
from gdn_jax.ops.rules import RULES

pytestmark = [pytest.mark.child(devices=8), pytest.mark.slow]

# T / n = 40, 20, 10 tokens per shard: none a multiple of C, one shorter than C, and none
# equal to another dimension, so a token-sized collective cannot pass for a state-sized one.
B, T, H, HV, K, V, C = 2, 80, 2, 4, 8, 16, 16
F32 = jnp.float32
# Packed offsets (N = 6, B = 1). With 8 shards (boundaries every 10 tokens): a sequence
# ends on a boundary (20), the next non-empty one starts on it after an empty one, spans
# shards 2-4, and [47, 73) spans four. The second set adds empty sequences at the start and
# the end and a start on the 2-, 4- and 8-shard boundary 40; the third ends before T, which
# only a traced cu_seqlens may do (the tokens after it belong to no sequence).
PACKED = {
    "crossing": [0, 5, 20, 20, 47, 73, 80],
    "empty ends": [0, 0, 33, 40, 40, 80, 80],
    "ends before T": [0, 12, 30, 30, 61, 61, 61],
}


def random_inputs(seed, batch, num_states, rule="gated_delta_rule"):
    """q, k, v, the gates of ``rule`` (a key of ``RULES``), an initial state and the weights
    of a loss that reads every output and final state."""
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), F32)

    k = normal(batch, T, H, K)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    channels = {None: (), "K": (K,), "V": (V,)}
    gates = []
    for spec in RULES[rule].gates:
        shape = (batch, T, HV, *channels[spec.channels])
        low, high = (-0.5, 0.0) if spec.name == "log_alpha" else (0.1, 1.0)
        gates.append(jnp.asarray(rng.uniform(low, high, shape), F32))
    inputs = (normal(batch, T, H, K), k, normal(batch, T, HV, V), *gates)
    state = 0.5 * normal(num_states, HV, V, K)
    # Fixed weights for a scalar loss that reads every output and final state.
    weights = (normal(batch, T, HV, V), normal(num_states, HV, V, K))
    return inputs, state, weights


def mesh_of(shards):
    return Mesh(np.array(jax.devices()[:shards]), ("seq",))


def loss_and_grads(op, inputs, state, weights, cu_seqlens, **options):
    """Jitted ``(o, final)`` and the gradients of ``sum(o w_o) + sum(final w_f)`` with respect
    to q, k, v, the gates and, when given, the initial state. ``cu_seqlens`` is traced, so
    the packed cases of one shard count share one compiled program."""
    run = jitted_loss(op, len(inputs), state is None, tuple(sorted(options.items())))
    (_, (o, final)), grads = run(*inputs, state, cu_seqlens, weights)
    return o, final, grads


@functools.cache
def jitted_loss(op, num_inputs, stateless, options):
    def loss(*args):
        *inputs, state, cu_seqlens, weights = args
        o, final = op(*inputs, initial_state=state, cu_seqlens=cu_seqlens, **dict(options))
        return jnp.sum(o * weights[0]) + jnp.sum(final * weights[1]), (o, final)

    argnums = tuple(range(num_inputs if stateless else num_inputs + 1))
    return jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))


def compare(
    shards, inputs, state, weights, schedule, cu_seqlens=None, rule="gated_delta_rule", **options
):
    """``rule``'s op on ``shards`` devices against one device, both with ``schedule`` named
    (the default, "auto", traces all three schedules; the two-axis mesh check below runs it)."""
    options = dict(chunk_size=C, schedule=schedule, **options)
    reference = getattr(gdn_jax, rule)
    parallel = getattr(gdn_jax.ops, f"{rule}_seq_parallel")
    expected = loss_and_grads(
        reference, inputs, state, weights, cu_seqlens, impl="chunked", **options
    )
    actual = loss_and_grads(
        parallel, inputs, state, weights, cu_seqlens, mesh=mesh_of(shards), **options
    )
    dtype = inputs[0].dtype
    assert actual[0].dtype == expected[0].dtype == dtype, (actual[0].dtype, expected[0].dtype)
    assert actual[1].dtype == expected[1].dtype, (actual[1].dtype, expected[1].dtype)
    assert_close(actual[0], expected[0], dtype, "o")
    assert_close(actual[1], expected[1], dtype, "final state")
    names = ("q", "k", "v", *RULES[rule].gate_names, "initial_state")
    assert len(actual[2]) == len(expected[2]) == len(names) - (state is None)
    for name, got, want in zip(names, actual[2], expected[2], strict=False):
        assert got.shape == want.shape, (name, got.shape, want.shape)
        assert_close(got, want, dtype, f"gradient of {name}")


# Packed sequences with an initial state each: in float32 on 2 shards, and on 8 shards (the
# most boundaries) in float64 to 1e-9, where a lost term cannot hide in rounding.
@pytest.mark.parametrize("label", PACKED)
@pytest.mark.parametrize(
    "shards, dtype, schedule", [(2, "float32", "in_scan"), (8, "float64", "hoisted")]
)
def test_packed_sequences_across_shards_equal_one_device(shards, dtype, schedule, label):
    inputs, state, weights = random_inputs(10 + shards, 1, len(PACKED["crossing"]) - 1)
    inputs, state, weights = jax.tree.map(
        functools.partial(jnp.asarray, dtype=dtype), (inputs, state, weights)
    )
    offsets = jnp.asarray(PACKED[label], jnp.int32)
    compare(shards, inputs, state, weights, schedule, offsets)


def test_linear_rule_on_4_shards_with_qk_l2norm_hoisted():
    rule = "simple_gla"
    inputs, state, weights = random_inputs(20, B, B, rule)
    compare(4, inputs, state, weights, "hoisted", rule=rule, use_qk_l2norm=True)


# The channel-gated rules on 4 shards with initial states: KDA, and GDN-2 with packed
# sequences across the boundaries, each in one schedule.
def test_kda_on_4_shards_with_an_initial_state_hoisted():
    inputs, state, weights = random_inputs(30, B, B, "kda")
    compare(4, inputs, state, weights, "hoisted", rule="kda", use_qk_l2norm=True)


GDN2_PACKED = jnp.asarray(PACKED["crossing"], jnp.int32)


def test_gdn2_on_4_shards_with_packed_sequences_in_scan():
    inputs, state, weights = random_inputs(31, 1, len(PACKED["crossing"]) - 1, "gdn2")
    compare(4, inputs, state, weights, "in_scan", GDN2_PACKED, rule="gdn2")


def test_gla_on_4_shards_with_packed_sequences_associative():
    # GLA's form of the channel engine (no erase gate), in the GPUs' schedule.
    rule = "gated_linear_attention"
    inputs, state, weights = random_inputs(35, 1, len(PACKED["crossing"]) - 1, rule)
    compare(4, inputs, state, weights, "associative", GDN2_PACKED, rule=rule)


def test_gated_delta_product_on_4_shards_with_an_initial_state_in_scan():
    n, shards = 2, 4
    inputs, state, weights = random_inputs(32, B, B)
    q, _, _, log_alpha, _ = inputs
    steps, _, _ = random_inputs(33, B, B)  # T of them: the first T / n tokens' steps
    rng = np.random.default_rng(34)
    k = jnp.concatenate([steps[1], inputs[1]], axis=1)[:, : T * n]
    v = jnp.concatenate([steps[2], inputs[2]], axis=1)[:, : T * n]
    beta = jnp.asarray(rng.uniform(0.1, 2.0, (B, T * n, HV)), F32)
    args = (q, k, v, log_alpha, beta)
    options = dict(chunk_size=C, schedule="in_scan", num_householder=n)
    expected = loss_and_grads(gdn_jax.gated_delta_product, args, state, weights, None, **options)
    parallel = gdn_jax.ops.gated_delta_product_seq_parallel
    actual = loss_and_grads(parallel, args, state, weights, None, mesh=mesh_of(shards), **options)
    inputs_named = ("q", "k", "v", "log_alpha", "beta", "initial_state")
    names = ("o", "final state", *(f"gradient of {x}" for x in inputs_named))
    for name, got, want in zip(
        names, (*actual[:2], *actual[2]), (*expected[:2], *expected[2]), strict=True
    ):
        assert_close(got, want, F32, name)


def test_data_and_seq_mesh_without_an_initial_state_in_the_default_schedule():
    """The batch over data, T over seq; without an initial state (only the zeros made
    before the shard_map differ from the cases with one)."""
    inputs, _, weights = random_inputs(21, B, B)
    expected = loss_and_grads(
        gdn_jax.gated_delta_rule, inputs, None, weights, None, chunk_size=C, impl="chunked"
    )
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "seq"))
    tokens = NamedSharding(mesh, P("data", "seq"))
    inputs = tuple(jax.device_put(x, tokens) for x in inputs)
    parallel = gated_delta_rule_seq_parallel
    actual = loss_and_grads(parallel, inputs, None, weights, None, mesh=mesh, chunk_size=C)
    assert actual[0].sharding.spec[:2] == ("data", "seq"), actual[0].sharding
    for name, got, want in zip(("o", "final", "grads"), actual, expected, strict=True):
        for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert_close(a, e, F32, name)


COLLECTIVE = re.compile(
    r"= (\(?[^=]*?\)?) (all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)"
    r"(?:-start)?\("
)


# Gated DeltaNet unpacked on 8 shards, and the program of GDN-2's packed test above.
CROSSING = {
    "gated_delta_rule": dict(seed=22, batch=B, shards=8, schedule="hoisted", offsets=None),
    "gdn2": dict(seed=31, batch=1, shards=4, schedule="in_scan", offsets=GDN2_PACKED),
}


@pytest.mark.parametrize("rule", CROSSING)
def test_only_state_sized_arrays_cross_devices(rule):
    case = CROSSING[rule]
    shards, local, offsets = case["shards"], T // case["shards"], case["offsets"]
    states = case["batch"] if offsets is None else offsets.shape[0] - 1
    inputs, state, weights = random_inputs(case["seed"], case["batch"], states, rule)
    options = dict(chunk_size=C, schedule=case["schedule"], mesh=mesh_of(shards))
    parallel = getattr(gdn_jax.ops, f"{rule}_seq_parallel")
    run = jitted_loss(parallel, len(inputs), False, tuple(sorted(options.items())))
    hlo = run.lower(*inputs, state, offsets, weights).compile().as_text()
    found = COLLECTIVE.findall(hlo)
    kinds = {op for _, op in found}
    # The gather of the carries, its transpose, and the sums of the final states.
    assert {"all-gather", "all-reduce"} <= kinds, f"collectives found: {found}"
    bound = shards * max(case["batch"], states) * HV * (V + K) * K
    for shape_text, op in found:
        for dims in re.findall(r"\[([\d,]*)\]", shape_text):
            dims = [int(d) for d in dims.split(",") if d]
            assert local not in dims and T not in dims, f"token-sized {op}: {shape_text}"
            assert int(np.prod(dims)) <= bound, f"{op} of {shape_text} exceeds {bound}"
    print("     collectives:", sorted({f"{op} {shape}" for shape, op in found}))


def test_halo_is_the_previous_shards_last_tokens_and_convolves_like_one_device():
    shards, width, channels = 8, 3, 5
    mesh = mesh_of(shards)
    rng = np.random.default_rng(23)
    x = jnp.asarray(rng.standard_normal((T, channels)), F32)
    weight = jnp.asarray(rng.standard_normal((width + 1, channels)), F32)

    def per_shard(x):
        halo = halo_from_previous(x, width, "seq")
        return halo, causal_depthwise_conv(x, weight, history=halo)[0]

    run = jax.shard_map(per_shard, mesh=mesh, in_specs=P("seq"), out_specs=(P("seq"), P("seq")))
    halos, y = jax.jit(run)(x)
    local = T // shards
    blocks = np.asarray(x).reshape(shards, local, channels)
    expected = np.concatenate([np.zeros((1, width, channels)), blocks[:-1, -width:]])
    np.testing.assert_array_equal(np.asarray(halos).reshape(shards, width, channels), expected)
    assert_close(y, causal_depthwise_conv(x, weight)[0], F32, "sharded convolution")

    too_wide = jax.shard_map(
        lambda x: halo_from_previous(x, local + 1, "seq"),
        mesh=mesh,
        in_specs=P("seq"),
        out_specs=P("seq"),
    )
    try:
        too_wide(x)
    except ValueError as error:
        assert "width=11 must be at most the tokens per shard" in str(error), error
    else:
        raise AssertionError("a halo wider than a shard was accepted")


def test_t_not_divisible_by_the_axis_size_is_refused():
    inputs, _, _ = random_inputs(24, B, B)
    cut = tuple(x[:, : T - 2] for x in inputs)
    try:
        gated_delta_rule_seq_parallel(*cut, mesh=mesh_of(8), chunk_size=C)
    except ValueError as error:
        assert "T=78 (q.shape[1]) must be divisible by the 8 devices" in str(error), error
    else:
        raise AssertionError("T=78 over 8 shards was accepted")
