"""Chunked == recurrent == float64 reference on outputs and final states."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import cpu_schedule as on_cpu
from support.reference import gated_delta_reference, random_inputs, random_state
from support.tolerance import assert_close

import gdn_jax

recurrent = jax.jit(gdn_jax.gated_delta_rule_recurrent)
chunked = jax.jit(on_cpu.gated_delta_rule_chunked, static_argnames="chunk_size")


def check_forms_agree(inputs, chunk_size, initial_state=None, dtype=jnp.float32):
    scale = inputs[0].shape[-1] ** -0.5
    y_ref, s_ref = gated_delta_reference(*inputs, scale=scale, initial_state=initial_state)
    y_rec, s_rec = recurrent(*inputs, initial_state=initial_state)
    y_chk, s_chk = chunked(*inputs, initial_state=initial_state, chunk_size=chunk_size)
    state_dtype = jnp.float64 if dtype == jnp.float64 else jnp.float32
    assert y_chk.dtype == inputs[2].dtype and s_chk.dtype == state_dtype
    assert_close(y_rec, y_ref, dtype, "recurrent y")
    assert_close(s_rec, s_ref, dtype, "recurrent state")
    assert_close(y_chk, y_ref, dtype, "chunked y")
    assert_close(s_chk, s_ref, dtype, "chunked state")


# Every chunk size against lengths around a chunk boundary; T=1000 once, to keep the run short.
LENGTHS_AND_CHUNKS = [(t, c) for t in (1, 63, 64, 65, 300) for c in (16, 32, 64, 128)] + [
    (1000, 64)
]


@pytest.mark.parametrize(("seq_len", "chunk_size"), LENGTHS_AND_CHUNKS)
def test_lengths_and_chunk_sizes(seq_len, chunk_size):
    inputs = random_inputs(seq_len, seq_len, 32, 24)
    check_forms_agree(inputs, chunk_size)


@pytest.mark.parametrize(("key_dim", "value_dim"), [(60, 100), (100, 60), (128, 128), (1, 3)])
@pytest.mark.parametrize("with_state", [False, True])
def test_head_dims_and_initial_state(key_dim, value_dim, with_state):
    inputs = random_inputs(key_dim, 130, key_dim, value_dim)
    state = random_state(1, value_dim, key_dim) if with_state else None
    check_forms_agree(inputs, 32, initial_state=state)


@pytest.mark.parametrize("key_dim", [256])
def test_largest_head_dim(key_dim):
    inputs = random_inputs(5, 200, key_dim, key_dim)
    check_forms_agree(inputs, 64, initial_state=random_state(2, key_dim, key_dim))


def test_float64_matches_reference_tightly():
    inputs = random_inputs(3, 150, 20, 12, dtype=jnp.float64)
    check_forms_agree(inputs, 32, random_state(4, 12, 20, dtype=jnp.float64), jnp.float64)


def test_output_is_causal():
    # Changing tokens from position t on leaves every output before t untouched.
    # Changed and compared in NumPy: eagerly each update and slice would compile a program.
    q, k, v, la, b = (np.asarray(x) for x in random_inputs(6, 100, 16, 16))
    y, _ = chunked(q, k, v, la, b, chunk_size=32)
    t = 45
    later = np.arange(100)[:, None] >= t
    y2, _ = chunked(
        *(x + later for x in (q, k, v)),
        np.where(later[:, 0], -0.3, la),
        np.where(later[:, 0], 0.9, b),
        chunk_size=32,
    )
    y, y2 = np.asarray(y), np.asarray(y2)
    np.testing.assert_array_equal(y[:t], y2[:t])
    assert not np.allclose(y[t:], y2[t:])


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_splitting_a_sequence_carries_the_state(form):
    fn = {"recurrent": recurrent, "chunked": functools.partial(chunked, chunk_size=32)}[form]
    # Sliced and joined in NumPy: eagerly each slice would compile a program per shape.
    inputs = [np.asarray(x) for x in random_inputs(7, 181, 24, 40)]
    y_full, s_full = fn(*inputs)
    cut = 77
    y_a, s_a = fn(*(x[:cut] for x in inputs))
    y_b, s_b = fn(*(x[cut:] for x in inputs), initial_state=s_a)
    assert_close(np.concatenate([y_a, y_b]), y_full, jnp.float32)
    assert_close(s_b, s_full, jnp.float32)
