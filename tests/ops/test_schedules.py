"""The two schedules of the chunked form compute one function: outputs, final states and
the gradient of every input agree with each other and with the recurrent form.

The other op tests name the CPU schedule, ``"in_scan"`` (``cpu_schedule.py``); this file
covers ``"hoisted"``, the default on accelerators, on the same contracts, and ``"auto"``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads
from support.hlo import has_square, loop_bodies
from support.reference import random_inputs, random_state
from support.tolerance import assert_close

import gdn_jax
from gdn_jax.models import LanguageModel, ModelConfig

SCHEDULES = ("hoisted", "in_scan")
NAMES = ("q", "k", "v", "log_alpha", "beta", "initial_state")


def values_and_grads(fn, args, seed):
    """``(y, final_state)`` and the gradients of every input of a random linear loss, from one
    compiled program."""
    y, s = jax.eval_shape(fn, *args)
    ct_y, ct_s = random_state(seed, *y.shape), random_state(seed + 1, *s.shape)

    def loss(*a):
        y, s = fn(*a)
        return jnp.sum(y * ct_y) + jnp.sum(s * ct_s), (y, s)

    grads, (y, s) = jax.jit(jax.grad(loss, argnums=range(len(args)), has_aux=True))(*args)
    return (y, s), grads


def single_head(schedule, chunk_size):
    if schedule == "recurrent":
        fn = gdn_jax.gated_delta_rule_recurrent
    else:
        fn = functools.partial(
            gdn_jax.gated_delta_rule_chunked, chunk_size=chunk_size, schedule=schedule
        )
    return jax.jit(lambda q, k, v, la, b, s: fn(q, k, v, la, b, initial_state=s))


def loops_with_chunk_work(compiled, chunk_size=16):
    """For each while loop of a compiled program, whether its body holds a chunk's
    ``[C, C]`` work (in_scan's do, hoisted's never)."""
    return [has_square(body, chunk_size) for body in loop_bodies(compiled.as_text())]


def test_auto_compiles_to_in_scan_for_cpu():
    """``"auto"`` picks by the platform a program is compiled for (test_tpu_compile.py
    compiles it for a TPU): for this CPU, the in_scan program, whose loop holds a chunk's
    ``[C, C]`` work, which hoisted's never does."""
    q, k, v, la, b = random_inputs(0, 96, 24, 40)

    def loop_has_chunk_work(schedule):
        fn = single_head(schedule, 16)
        return loops_with_chunk_work(fn.lower(q, k, v, la, b, random_state(1, 40, 24)).compile())

    assert loop_has_chunk_work("auto") == loop_has_chunk_work("in_scan") == [True]
    assert loop_has_chunk_work("hoisted") == [False]


def test_the_model_and_its_layers_pass_their_schedule_to_the_op():
    """``ModelConfig.schedule`` reaches the op through each layer's ``schedule``: the loops
    of the compiled forward (Gated DeltaNet's, then Kimi Delta Attention's) hold a chunk's
    ``[C, C]`` work in "in_scan" and not in "hoisted"."""
    tokens = jnp.zeros((1, 40), jnp.int32)

    def loop_has_chunk_work(schedule):
        # d_model 24, head dim 12, T 40, vocab 50: no size but C is 16.
        config = ModelConfig(50, 24, ("gdn", "kda"), chunk_size=16, schedule=schedule)
        model = LanguageModel(config, rngs=nnx.Rngs(0))
        return loops_with_chunk_work(nnx.jit(lambda m, t: m(t)).lower(model, tokens).compile())

    assert loop_has_chunk_work("in_scan") == [True, True]
    assert loop_has_chunk_work("hoisted") == [False, False]


@pytest.mark.parametrize(
    ("seq_len", "key_dim", "value_dim", "chunk_size"),
    [(1, 8, 8, 16), (65, 60, 100, 16), (300, 16, 16, 64), (257, 32, 24, 128)],
)
def test_single_head_schedules_match_recurrent(seq_len, key_dim, value_dim, chunk_size):
    q, k, v, la, b = random_inputs(seq_len, seq_len, key_dim, value_dim)
    # Gates at their edges too: a full reset (-inf and the floor), no decay, no write, reflection.
    la = la.at[::11].set(-jnp.inf).at[3::11].set(-1e4).at[5::11].set(0.0)
    b = b.at[2::7].set(0.0).at[4::7].set(2.0)
    args = (q, k, v, la, b, random_state(seq_len + 1, value_dim, key_dim))
    expected, expected_grads = values_and_grads(single_head("recurrent", chunk_size), args, 7)
    for schedule in SCHEDULES:
        actual, grads = values_and_grads(single_head(schedule, chunk_size), args, 7)
        for a, e, name in zip(actual, expected, ("y", "final"), strict=True):
            assert_close(a, e, jnp.float32, f"{schedule} {name}")
        for a, e, name in zip(grads, expected_grads, NAMES, strict=True):
            assert np.isfinite(a).all(), (schedule, name)
            assert_close(a, e, jnp.float32, f"{schedule} d{name}")


@pytest.mark.parametrize("rule", ["gated_delta_rule", "gated_linear_attention"])
def test_batched_grouped_packed_schedules_agree(rule):
    # Grouped value heads, packed sequences with an empty one and a traced cu_seqlens that
    # ends before T (the tail is inert): everything the batched entry point does.
    q, k, v, la, b = random_inputs(3, 90, 12, 10, lead=(1,), heads=(2, 4))
    state = random_state(4, 4, 4, 10, 12)
    cu = jnp.asarray([0, 30, 30, 61, 80], jnp.int32)

    def run(schedule):
        @jax.jit
        def fn(cu, *args):
            return getattr(gdn_jax, rule)(
                *args[:5], initial_state=args[5], chunk_size=16, schedule=schedule, cu_seqlens=cu
            )

        return values_and_grads(functools.partial(fn, cu), (q, k, v, la, b, state), 11)

    (hoisted, hoisted_grads), (in_scan, in_scan_grads) = (run(s) for s in SCHEDULES)
    for a, e in zip((*hoisted, *hoisted_grads), (*in_scan, *in_scan_grads), strict=True):
        assert_close(a, e, jnp.float32)


def test_hoisted_finite_differences_float64():
    q, k, v, la, b = random_inputs(5, 37, 5, 4, dtype=jnp.float64)
    state = random_state(6, 4, 5, dtype=jnp.float64)
    check_grads(
        single_head("hoisted", 16), (q, k, v, la, b, state), order=1, modes=["rev"], eps=1e-6
    )
