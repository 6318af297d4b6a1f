"""The sequence-parallel ops on one device: one shard is the one-device op, and the
arguments' errors. On several devices: test_sequence_parallel_shards.py."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P
from support.tolerance import assert_close

import gdn_jax
from gdn_jax.ops import gated_delta_rule_seq_parallel, halo_from_previous

B, T, H, HV, K, V = 1, 12, 2, 4, 8, 16


def inputs(batch=B, seq_len=T):
    rng = np.random.default_rng(0)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    gates = jnp.asarray(-rng.uniform(0, 0.5, (batch, seq_len, HV)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (batch, seq_len, HV)), jnp.float32)
    return [normal(batch, seq_len, H, K), normal(batch, seq_len, H, K)] + [
        normal(batch, seq_len, HV, V),
        gates,
        beta,
    ]


def one_device(name="seq"):
    return Mesh(np.array(jax.devices()[:1]), (name,))


def test_one_shard_is_the_one_device_op():
    args = inputs(batch=2)
    state = jnp.ones((2, HV, V, K), jnp.float32)
    parallel = functools.partial(gated_delta_rule_seq_parallel, mesh=one_device())
    o, final = jax.jit(parallel, static_argnames="chunk_size")(
        *args, initial_state=state, chunk_size=16
    )
    o_ref, final_ref = jax.jit(gdn_jax.gated_delta_rule, static_argnames="chunk_size")(
        *args, initial_state=state, chunk_size=16
    )
    assert_close(o, o_ref, jnp.float32)
    assert_close(final, final_ref, jnp.float32)


def arguments(**changes):
    args = inputs()
    if "heads" in changes:  # a consistent HV that is not a multiple of H
        heads, rng = changes.pop("heads"), np.random.default_rng(1)
        args[2] = jnp.asarray(rng.standard_normal((B, T, heads, V)), jnp.float32)
        args[3], args[4] = args[3][..., :heads], args[4][..., :heads]
    for i, name in enumerate(("q", "k", "v", "log_alpha", "beta")):
        if name in changes:
            args[i] = changes.pop(name)
    changes.setdefault("mesh", one_device())
    return args, changes


# (changes, the argument at fault, the ValueError's message).
BAD = [
    ({"mesh": "seq"}, "mesh", r"mesh must be a jax.sharding.Mesh, got str"),
    (
        {"mesh": one_device("data")},
        "mesh",
        r"axis_name='seq' must be an axis of the mesh, got axes \('data',\)",
    ),
    ({"axis_name": "tokens"}, "axis_name", r"axis_name='tokens' must be an axis"),
    (
        {"mesh": AbstractMesh((5,), ("seq",))},
        "mesh",
        r"T=12 \(q.shape\[1\]\) must be divisible by the 5 devices of mesh axis 'seq'",
    ),
    (
        {"k": jnp.zeros((B, T, H, K + 1), jnp.float32)},
        "k",
        r"k must have shape \[B, T, H, K\] like q",
    ),
    ({"heads": 3}, "v", r"value heads HV=3 .* must be a multiple of .* H=2"),
    ({"q": np.zeros((B, T, H, K))}, "q", r"q, k, v must share one dtype, got q.dtype=float64"),
    ({"q": [[0.0]]}, "q", r"q must be an array, got list"),
    ({"beta": jnp.zeros((B, T, H))}, "beta", r"beta must have shape \[B, T, HV\]"),
    (
        {"initial_state": jnp.zeros((B, HV, K, V))},
        "initial_state",
        r"initial_state must have shape \[B, HV, V, K\]",
    ),
    ({"cu_seqlens": jnp.array([0, 5, 11])}, "cu_seqlens", r"cu_seqlens must rise from 0 to T=12"),
    ({"cu_seqlens": jnp.array([0.0, 12.0])}, "cu_seqlens", r"cu_seqlens must be integer"),
    (
        {"cu_seqlens": jnp.array([0, 12]), "initial_state": jnp.zeros((2, HV, V, K))},
        "initial_state",
        r"initial_state must have shape \[N, HV, V, K\] = \(1, 4, 16, 8\)",
    ),
    ({"chunk_size": 24}, "chunk_size", r"chunk_size=24 must be one of"),
    ({"schedule": "fast"}, "schedule", r"schedule='fast' must be one of"),
    ({"scale": -1.0}, "scale", r"scale=-1.0 must be a finite number > 0"),
]


@pytest.mark.parametrize(("changes", "argument", "message"), BAD)
def test_bad_arguments_name_the_argument(changes, argument, message):
    """A user gets the op's ValueError. In the test session the shape annotations are also
    checked (tests/conftest.py may install jaxtyping's hook), and an annotation may refuse
    the call first: then the TypeError must name the same argument."""
    args, options = arguments(**changes)
    with pytest.raises((ValueError, TypeError)) as error:
        gated_delta_rule_seq_parallel(*args, **options)
    if isinstance(error.value, ValueError):
        assert re.match(rf"gated_delta_rule_seq_parallel: .*{message}", str(error.value))
    else:
        assert f"parameter '{argument}'" in str(error.value), error.value


def test_packed_sequences_need_one_batch_row():
    args = inputs(batch=2)
    with pytest.raises(ValueError, match=r"cu_seqlens packs sequences along T and needs B == 1"):
        gated_delta_rule_seq_parallel(*args, mesh=one_device(), cu_seqlens=jnp.array([0, T]))


@pytest.mark.parametrize(
    ("width", "message"),
    [
        (0, r"width=0 must be a positive integer"),
        (T + 1, r"width=13 must be at most the tokens per shard, x.shape\[0\]"),
    ],
)
def test_halo_width_is_checked(width, message):
    run = jax.shard_map(
        lambda x: halo_from_previous(x, width, "seq"),
        mesh=one_device(),
        in_specs=P("seq"),
        out_specs=P("seq"),
    )
    with pytest.raises(ValueError, match=rf"^halo_from_previous: {message}"):
        run(jnp.zeros((T, 3)))


def test_the_halo_of_the_first_shard_is_zeros():
    run = jax.shard_map(
        lambda x: halo_from_previous(x, 2, "seq"),
        mesh=one_device(),
        in_specs=P("seq"),
        out_specs=P("seq"),
    )
    np.testing.assert_array_equal(run(jnp.ones((T, 3))), np.zeros((2, 3)))
