"""The chunked custom VJP against autodiff of the recurrent form, and finite differences."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from support import cpu_schedule as on_cpu
from support import forms
from support.reference import random_inputs, random_state
from support.tolerance import assert_close, assert_close_to_scale

import gdn_jax

NAMES = ("q", "k", "v", "log_alpha", "beta", "initial_state")


def grads_of(rule, form, args, seed, **options):
    """The gradients of every input of a loss whose gradient is the VJP of (y, final_state)
    with fixed random cotangents: ``forms.outputs_and_grads``'s program, which the tests of
    test_schedules.py and test_kda.py at the same shapes run too."""
    seq_len, value_dim, key_dim = args[2].shape[0], args[2].shape[1], args[0].shape[1]
    ct_y = random_state(seed, seq_len, value_dim, dtype=args[0].dtype)
    ct_s = random_state(seed + 1, value_dim, key_dim, dtype=args[0].dtype)
    return forms.outputs_and_grads(rule, form, **options)(*args, ct_y, ct_s)[2]


def chunked_grads(args, seed, chunk_size, schedule="in_scan", rule="gated_delta_rule"):
    return grads_of(rule, "chunked", args, seed, chunk_size=chunk_size, schedule=schedule)


def recurrent_grads(args, seed, rule="gated_delta_rule"):
    return grads_of(rule, "recurrent", args, seed)


# The shapes of test_schedules.py's single-head cases (whose programs these reuse), and one
# more with a chunk size that that file does not run.
@pytest.mark.parametrize(
    ("seq_len", "key_dim", "value_dim", "chunk_size"),
    [(1, 8, 8, 16), (65, 60, 100, 16), (130, 32, 24, 32), (300, 16, 16, 64), (257, 64, 32, 128)],
)
def test_chunked_vjp_matches_recurrent_autodiff(seq_len, key_dim, value_dim, chunk_size):
    args = (
        *random_inputs(seq_len, seq_len, key_dim, value_dim),
        random_state(0, value_dim, key_dim),
    )
    expected = recurrent_grads(args, seed=1)
    actual = chunked_grads(args, seed=1, chunk_size=chunk_size)
    for name, a, e in zip(NAMES, actual, expected, strict=True):
        assert a.dtype == e.dtype == jnp.float32
        assert_close(a, e, jnp.float32, f"d{name}")


def test_gradients_reach_every_input():
    # The shapes of a case above: the same compiled program.
    args = (*random_inputs(2, 130, 32, 24), random_state(3, 24, 32))
    grads = chunked_grads(args, seed=4, chunk_size=32)
    for name, g in zip(NAMES, grads, strict=True):
        assert np.all(np.isfinite(g)) and np.any(g != 0), name


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_finite_differences_float64(form):
    fn = {
        "recurrent": gdn_jax.gated_delta_rule_recurrent,
        "chunked": lambda *a, **kw: on_cpu.gated_delta_rule_chunked(*a, **kw, chunk_size=16),
    }[form]
    q, k, v, la, b = random_inputs(5, 37, 5, 4, dtype=jnp.float64)
    state = random_state(6, 4, 5, dtype=jnp.float64)

    # Jitted: check_grads evaluates it many times, eagerly one program per operation each.
    @jax.jit
    def outputs(q, k, v, la, b, s):
        return fn(q, k, v, la, b, initial_state=s)

    check_grads(outputs, (q, k, v, la, b, state), order=1, modes=["rev"], eps=1e-6)


def test_float64_vjp_matches_recurrent_tightly():
    args = (
        *random_inputs(7, 90, 12, 10, dtype=jnp.float64),
        random_state(8, 10, 12, dtype=jnp.float64),
    )
    expected = recurrent_grads(args, seed=9)
    actual = chunked_grads(args, seed=9, chunk_size=32)
    for name, a, e in zip(NAMES, actual, expected, strict=True):
        assert_close(a, e, jnp.float64, f"d{name}")


# (T, K, V): the shapes of a case of test_schedules.py and of test_kda.py, whose float32
# programs these reuse.
STRONG_DECAY_SHAPES = {"gated_delta_rule": (300, 16, 16), "kda": (130, 16, 24)}


@pytest.mark.parametrize("op", ["gated_delta_rule", "kda"])
def test_strong_decay_gradients_are_as_exact_as_the_recurrent_form(op):
    """log_alpha in [-20, -8], where the gradient of log_alpha is about 1e-4 and smaller:
    chunked (both schedules, a padded tail chunk) and recurrent float32 against the float64
    gradient, each error relative to the gradient's own scale. Measured: 8e-8 to 7.5e-7 for
    every gradient of both rules in each form (Gated DeltaNet's chunked log_alpha 1.1e-7, and
    6.0e-4, at T = 100, before its decay gradient summed each segment's terms only where they
    belong)."""
    seq_len, key_dim, value_dim = STRONG_DECAY_SHAPES[op]
    q, k, v, la, b = random_inputs(
        0, seq_len, key_dim, value_dim, dtype=jnp.float64, log_alpha_range=(-20, -8),
        per_channel=op == "kda",
    )  # fmt: skip
    args = (q, k, v, la, b, random_state(1, value_dim, key_dim, dtype=jnp.float64))
    expected = recurrent_grads(args, seed=2, rule=op)
    as32 = [np.asarray(x, np.float32) for x in args]
    by_form = {"recurrent": recurrent_grads(as32, seed=2, rule=op)}
    for schedule in ("in_scan", "hoisted"):
        by_form[schedule] = chunked_grads(as32, seed=2, chunk_size=64, schedule=schedule, rule=op)
    for form, grads in by_form.items():
        for name, a, e in zip(NAMES, grads, expected, strict=True):
            assert_close_to_scale(a, e, jnp.float32, f"{op} {form} d{name}")


def test_chunked_residuals_are_one_state_per_chunk():
    # What the custom VJP saves between forward and backward: the inputs plus N [V, K] states.
    seq_len, key_dim, value_dim, chunk = 512, 16, 16, 64
    args = (*random_inputs(10, seq_len, key_dim, value_dim), random_state(11, value_dim, key_dim))

    def forward(*a):
        return on_cpu.gated_delta_rule_chunked(*a[:5], initial_state=a[5], chunk_size=chunk)

    # Shapes only (the pullback's leaves are what it keeps): nothing to compile.
    vjp_fn = jax.eval_shape(lambda *a: jax.vjp(forward, *a)[1], *args)
    saved = sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(vjp_fn))
    inputs = sum(x.size for x in args)
    per_chunk_states = (seq_len // chunk) * value_dim * key_dim
    assert saved <= inputs + per_chunk_states + seq_len * 2 + value_dim * key_dim
    # The recurrent form's autodiff keeps a state per token, T times more.
    vjp_rec = jax.eval_shape(
        lambda *a: jax.vjp(
            lambda *a: gdn_jax.gated_delta_rule_recurrent(*a[:5], initial_state=a[5]), *a
        )[1],
        *args,
    )
    saved_rec = sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(vjp_rec))
    assert saved_rec >= seq_len * value_dim * key_dim
