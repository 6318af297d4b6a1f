"""Packed sequences (cu_seqlens) equal running each sequence on its own."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import cpu_schedule as on_cpu
from support import forms
from support.reference import grouped_heads_reference, random_inputs, random_state
from support.tolerance import assert_close

HEADS, V_HEADS, KEY, VALUE = 2, 4, 12, 10

rule = forms.batched("gated_delta_rule")


def packed_and_separate(cu, impl, chunk_size=16, with_state=True):
    seq_len = cu[-1]
    num = len(cu) - 1
    inputs = random_inputs(sum(cu), seq_len, KEY, VALUE, lead=(1,), heads=(HEADS, V_HEADS))
    state = random_state(len(cu), num, V_HEADS, VALUE, KEY) if with_state else None
    return inputs, state, num


def reference_separately(inputs, state, cu):
    """Each sequence of the packed ``inputs`` alone, from its own initial state, by the
    float64 NumPy loop: outputs ``[1, T, HV, V]`` and final states ``[N, HV, V, K]``."""
    inputs = [np.asarray(x[0]) for x in inputs]
    out = np.zeros(inputs[2].shape)
    finals = np.zeros((len(cu) - 1, V_HEADS, VALUE, KEY))
    for n in range(len(cu) - 1):
        lo, hi = cu[n], cu[n + 1]
        if hi == lo:  # an empty sequence returns its initial state
            finals[n] = 0.0 if state is None else state[n]
            continue
        out[lo:hi], finals[n] = grouped_heads_reference(
            *(x[lo:hi] for x in inputs),
            scale=KEY**-0.5,
            initial_state=None if state is None else np.asarray(state[n]),
        )
    return out[None], finals


def run_separately(inputs, state, cu, impl, chunk_size):
    """Each sequence alone through ``gated_delta_rule``, differentiable: for the gradients."""
    outs, finals = [], []
    for n in range(len(cu) - 1):
        lo, hi = cu[n], cu[n + 1]
        init = None if state is None else state[n : n + 1]
        if hi == lo:  # an empty sequence returns its initial state
            finals.append(jnp.zeros((V_HEADS, VALUE, KEY)) if init is None else init[0])
            continue
        out, final = rule(
            *(x[:, lo:hi] for x in inputs), initial_state=init, impl=impl, chunk_size=chunk_size
        )
        outs.append(out)
        finals.append(final[0])
    return jnp.concatenate(outs, axis=1), jnp.stack(finals)


CASES = [
    [0, 37],
    [0, 5, 5, 70, 200],  # an empty sequence in the middle
    [0, 16, 32, 48],  # boundaries on chunk boundaries
    [0, 1, 2, 3, 100, 101],  # one-token sequences
]


@pytest.mark.parametrize("cu", CASES)
@pytest.mark.parametrize("impl", ["chunked", "recurrent"])
def test_outputs_and_final_states(cu, impl):
    inputs, state, _ = packed_and_separate(cu, impl)
    cu_arr = jnp.asarray(cu, jnp.int32)
    out, final = rule(*inputs, initial_state=state, impl=impl, chunk_size=16, cu_seqlens=cu_arr)
    out_ref, final_ref = reference_separately(inputs, state, cu)
    assert final.shape == (len(cu) - 1, V_HEADS, VALUE, KEY)
    assert_close(out, out_ref, jnp.float32)
    assert_close(final, final_ref, jnp.float32)


@pytest.mark.parametrize("impl", ["chunked", "recurrent"])
def test_without_initial_state(impl):
    cu = [0, 20, 50]
    inputs, _, _ = packed_and_separate(cu, impl, with_state=False)
    out, final = rule(*inputs, impl=impl, chunk_size=16, cu_seqlens=jnp.asarray(cu, jnp.int32))
    out_ref, final_ref = reference_separately(inputs, None, cu)
    assert_close(out, out_ref, jnp.float32)
    assert_close(final, final_ref, jnp.float32)


@pytest.mark.parametrize("impl", ["chunked", "recurrent"])
def test_gradients_equal_per_sequence_gradients(impl):
    cu = [0, 30, 30, 61, 90]
    inputs, state, _ = packed_and_separate(cu, impl)
    rng = np.random.default_rng(0)
    ct_out = jnp.asarray(rng.standard_normal((1, 90, V_HEADS, VALUE)), jnp.float32)
    ct_final = jnp.asarray(rng.standard_normal(state.shape), jnp.float32)

    def separate_loss(*args):
        out, final = run_separately(args[:5], args[5], cu, impl, 16)
        return jnp.sum(out * ct_out) + jnp.sum(final * ct_final)

    args = (*inputs, state)
    # Chunked, the program test_schedules.py runs (in_scan) at these shapes.
    options = dict(impl=impl, chunk_size=16, schedule="in_scan")
    packed = forms.packed_outputs_and_grads("gated_delta_rule", **options)
    _, _, g_packed = packed(jnp.asarray(cu, jnp.int32), *args, ct_out, ct_final)
    g_separate = jax.jit(jax.grad(separate_loss, argnums=range(6)))(*args)
    for name, a, e in zip(("q", "k", "v", "la", "b", "state"), g_packed, g_separate, strict=True):
        assert_close(a, e, jnp.float32, name)


def test_traced_cu_seqlens_compile_once():
    inputs, state, _ = packed_and_separate([0, 10, 64], "chunked")
    traces = []

    @jax.jit
    def run(cu, *args):
        traces.append(1)
        return on_cpu.gated_delta_rule(
            *args[:5], initial_state=args[5], chunk_size=16, cu_seqlens=cu
        )

    for cu in ([0, 10, 64], [0, 33, 64], [0, 0, 64]):
        out, final = run(jnp.asarray(cu, jnp.int32), *inputs, state)
        out_ref, final_ref = reference_separately(inputs, state, cu)
        assert_close(out, out_ref, jnp.float32)
        assert_close(final, final_ref, jnp.float32)
    assert len(traces) == 1


def test_packed_chunked_matches_packed_recurrent():
    cu = jnp.asarray([0, 3, 77, 78, 150], jnp.int32)
    inputs, state, _ = packed_and_separate([0, 3, 77, 78, 150], "chunked")
    run = functools.partial(rule, *inputs, initial_state=state, cu_seqlens=cu)
    for chunk_size in (16, 128):  # the smallest and largest; test_forward covers every size
        out_c, fin_c = run(impl="chunked", chunk_size=chunk_size)
        out_r, fin_r = run(impl="recurrent")
        assert_close(out_c, out_r, jnp.float32, f"C={chunk_size}")
        assert_close(fin_c, fin_r, jnp.float32, f"C={chunk_size}")


@pytest.mark.parametrize("impl", ["chunked", "recurrent"])
def test_tokens_past_a_traced_last_offset_are_inert(impl):
    # Under jit cu_seqlens cannot be checked; a last offset below T leaves tokens that belong
    # to no sequence. They must not touch any sequence, and their outputs are zero.
    # The shapes of test_outputs_and_final_states' boundaries case, whose program this reuses.
    inputs, state, _ = packed_and_separate([0, 16, 32, 48], impl)
    cu = [0, 20, 30, 40]
    out, final = rule(
        *inputs,
        initial_state=state,
        impl=impl,
        chunk_size=16,
        cu_seqlens=jnp.asarray(cu, jnp.int32),
    )
    out = np.asarray(out)  # sliced in NumPy: eager slices would compile a program each
    out_ref, final_ref = reference_separately(inputs, state, cu)
    assert_close(out[:, :40], out_ref[:, :40], jnp.float32)
    assert_close(final, final_ref, jnp.float32)
    np.testing.assert_array_equal(out[:, 40:], 0)
