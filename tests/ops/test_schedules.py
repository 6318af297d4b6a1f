"""The schedules of the chunked form compute one function: outputs, final states and the
gradient of every input agree with each other and with the recurrent form.

The other op tests name the CPU schedule, ``"in_scan"`` (``cpu_schedule.py``); this file
covers ``"hoisted"`` (the default on TPU) and ``"associative"`` (on NVIDIA GPUs) on the same
contracts, and ``"auto"``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads
from support import forms
from support.hlo import dots, has_square, loop_bodies
from support.reference import random_inputs, random_state
from support.tolerance import assert_close

import gdn_jax
from gdn_jax.models import LanguageModel, ModelConfig

SCHEDULES = ("hoisted", "associative", "in_scan")
NAMES = ("q", "k", "v", "log_alpha", "beta", "initial_state")


def values_and_grads(form, args, seed, chunk_size):
    """``(y, final_state)`` and the gradients of every input of a random linear loss, from one
    compiled program (``forms.outputs_and_grads``'s, which test_gradients.py runs at these
    shapes too): ``form`` is "recurrent" or a schedule."""
    q, v = args[0], args[2]
    ct_y = random_state(seed, *v.shape)
    ct_s = random_state(seed + 1, v.shape[1], q.shape[1])
    if form == "recurrent":
        run = forms.outputs_and_grads("gated_delta_rule", "recurrent")
    else:
        run = forms.outputs_and_grads(
            "gated_delta_rule", "chunked", chunk_size=chunk_size, schedule=form
        )
    y, s, grads = run(*args, ct_y, ct_s)
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
    # No loop over the chunks at all: XLA:CPU's loops here are its scatters of the finals.
    associative = single_head("associative", 16).lower(q, k, v, la, b, random_state(1, 40, 24))
    assert not any(dots(body) for body in loop_bodies(associative.compile().as_text()))


def test_the_model_and_its_layers_pass_their_schedule_to_the_op():
    """``ModelConfig.schedule`` reaches the op through each layer's ``schedule``: the loops
    of the compiled forward (Gated DeltaNet's, then Kimi Delta Attention's) hold a chunk's
    ``[C, C]`` work in "in_scan" and not in "hoisted"."""
    tokens = jnp.zeros((1, 40), jnp.int32)

    def loop_has_chunk_work(schedule):
        # d_model 24, head dim 12, T 40, vocab 50: no size but C is 16.
        config = ModelConfig(50, 24, ("gdn", "kda"), chunk_size=16, schedule=schedule)
        # Abstract: lowering reads only the parameters' shapes, and making them would compile
        # each initialiser eagerly.
        model = nnx.eval_shape(lambda: LanguageModel(config, rngs=nnx.Rngs(0)))
        return loops_with_chunk_work(nnx.jit(lambda m, t: m(t)).lower(model, tokens).compile())

    assert loop_has_chunk_work("in_scan") == [True, True]
    assert loop_has_chunk_work("hoisted") == [False, False]


@pytest.mark.parametrize(
    ("seq_len", "key_dim", "value_dim", "chunk_size"),
    [(1, 8, 8, 16), (65, 60, 100, 16), (300, 16, 16, 64), (257, 64, 32, 128)],
)
def test_single_head_schedules_match_recurrent(seq_len, key_dim, value_dim, chunk_size):
    q, k, v, la, b = (np.array(x) for x in random_inputs(seq_len, seq_len, key_dim, value_dim))
    # Gates at their edges too: a full reset (-inf and the floor), no decay, no write, reflection
    # (set in NumPy: eager updates would compile a program each).
    la[::11], la[3::11], la[5::11] = -np.inf, -1e4, 0.0
    b[2::7], b[4::7] = 0.0, 2.0
    args = (q, k, v, la, b, random_state(seq_len + 1, value_dim, key_dim))
    expected, expected_grads = values_and_grads("recurrent", args, 7, chunk_size)
    for schedule in SCHEDULES:
        actual, grads = values_and_grads(schedule, args, 7, chunk_size)
        for a, e, name in zip(actual, expected, ("y", "final"), strict=True):
            assert_close(a, e, jnp.float32, f"{schedule} {name}")
        for a, e, name in zip(grads, expected_grads, NAMES, strict=True):
            assert np.isfinite(a).all(), (schedule, name)
            assert_close(a, e, jnp.float32, f"{schedule} d{name}")


@pytest.mark.parametrize("rule", ["gated_delta_rule", "simple_gla"])
def test_batched_grouped_packed_schedules_agree(rule):
    # Grouped value heads, packed sequences with an empty one and a traced cu_seqlens that
    # ends before T (the tail is inert): everything the batched entry point does.
    q, k, v, la, b = random_inputs(3, 90, 12, 10, lead=(1,), heads=(2, 4))
    state = random_state(4, 4, 4, 10, 12)
    cu = jnp.asarray([0, 30, 30, 61, 80], jnp.int32)

    cotangents = (random_state(11, 1, 90, 4, 10), random_state(12, *state.shape))

    def run(schedule):
        # forms.packed_outputs_and_grads: test_varlen.py runs the in_scan one at these shapes.
        fn = forms.packed_outputs_and_grads(rule, impl="chunked", chunk_size=16, schedule=schedule)
        return fn(cu, q, k, v, la, b, state, *cotangents)

    *accelerated, in_scan = (run(s) for s in SCHEDULES)
    for schedule, results in zip(SCHEDULES[:-1], accelerated, strict=True):
        for a, e in zip((*results[:2], *results[2]), (*in_scan[:2], *in_scan[2]), strict=True):
            assert_close(a, e, jnp.float32, schedule)


def test_hoisted_finite_differences_float64():
    q, k, v, la, b = random_inputs(5, 37, 5, 4, dtype=jnp.float64)
    state = random_state(6, 4, 5, dtype=jnp.float64)
    check_grads(
        single_head("hoisted", 16), (q, k, v, la, b, state), order=1, modes=["rev"], eps=1e-6
    )
