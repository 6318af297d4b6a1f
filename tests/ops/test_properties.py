"""Property-based checks over random shapes, chunk sizes and gate ranges."""

import os

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from support import cpu_schedule as on_cpu
from support.reference import gated_delta_reference, random_inputs, random_state
from support.tolerance import assert_close

# Each example compiles new shapes (~1-3 s), so the default run draws few of them;
# GDN_HYPOTHESIS_EXAMPLES=200 pytest tests/ops/test_properties.py searches harder.
EXAMPLES = int(os.environ.get("GDN_HYPOTHESIS_EXAMPLES", "8"))
# Under jit: one compilation per drawn shape instead of one per operation.
chunked = jax.jit(on_cpu.gated_delta_rule_chunked, static_argnames="chunk_size")
SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, derandomize="GDN_HYPOTHESIS_EXAMPLES" not in os.environ
)


@st.composite
def problems(draw):
    seq_len = draw(st.integers(1, 200))
    key_dim = draw(st.integers(1, 40))
    value_dim = draw(st.integers(1, 40))
    chunk = draw(st.sampled_from([16, 32, 64, 128]))
    strongest_decay = draw(st.sampled_from([0.0, -0.1, -3.0, -1e4]))
    max_beta = draw(st.sampled_from([0.0, 1.0, 2.0]))
    seed = draw(st.integers(0, 2**16))
    with_state = draw(st.booleans())
    return seq_len, key_dim, value_dim, chunk, strongest_decay, max_beta, seed, with_state


@SETTINGS
@given(problems())
def test_chunked_matches_reference(problem):
    seq_len, key_dim, value_dim, chunk, decay, max_beta, seed, with_state = problem
    inputs = random_inputs(
        seed,
        seq_len,
        key_dim,
        value_dim,
        log_alpha_range=(decay, 0.0),
        beta_range=(0.0, max_beta),
    )
    state = random_state(seed + 1, value_dim, key_dim) if with_state else None
    y, s = chunked(*inputs, initial_state=state, chunk_size=chunk)
    y_ref, s_ref = gated_delta_reference(*inputs, scale=key_dim**-0.5, initial_state=state)
    assert np.isfinite(y).all() and np.isfinite(s).all()
    assert_close(y, y_ref, jnp.float32)
    assert_close(s, s_ref, jnp.float32)


# Three compilations per example: half as many examples as the test above.
@settings(SETTINGS, max_examples=max(1, EXAMPLES // 2))
@given(st.integers(2, 150), st.integers(1, 149), st.sampled_from([16, 64]), st.integers(0, 999))
def test_any_split_carries_state(seq_len, cut, chunk, seed):
    cut = min(cut, seq_len - 1)
    # Sliced and joined in NumPy: eagerly each slice would compile a program per shape.
    inputs = [np.asarray(x) for x in random_inputs(seed, seq_len, 8, 6)]
    y, s = chunked(*inputs, chunk_size=chunk)
    y_a, s_a = chunked(*(x[:cut] for x in inputs), chunk_size=chunk)
    y_b, s_b = chunked(*(x[cut:] for x in inputs), initial_state=s_a, chunk_size=chunk)
    assert_close(np.concatenate([y_a, y_b]), y, jnp.float32)
    assert_close(s_b, s, jnp.float32)
