"""Gates at their limits and long sequences: finite results that still match the reference."""

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

EDGES = {
    "no decay": dict(log_alpha=0.0),
    "full reset": dict(log_alpha=-1e4),
    "no write": dict(beta=0.0),
    "reflection": dict(beta=2.0),
    "no decay, reflection": dict(log_alpha=0.0, beta=2.0),
}


@pytest.mark.parametrize("edge", list(EDGES))
def test_gate_edges_match_reference(edge):
    q, k, v, la, b = random_inputs(11, 150, 16, 8)
    gates = EDGES[edge]
    # In NumPy: eager JAX operations would compile a program each.
    if "log_alpha" in gates:
        la = np.full_like(la, gates["log_alpha"])
    if "beta" in gates:
        b = np.full_like(b, gates["beta"])
    state = random_state(12, 8, 16)
    y_ref, s_ref = gated_delta_reference(q, k, v, la, b, scale=0.25, initial_state=state)
    for fn in (recurrent, lambda *a, **kw: chunked(*a, **kw, chunk_size=32)):
        y, s = fn(q, k, v, la, b, initial_state=state)
        assert np.isfinite(y).all() and np.isfinite(s).all()
        assert_close(y, y_ref, jnp.float32, edge)
        assert_close(s, s_ref, jnp.float32, edge)


def test_mixed_extreme_gates_keep_small_decays_exact():
    # A full reset followed by slight decays: differences of a running log-decay sum would
    # lose the -0.01 steps next to -1e4 in float32; segment sums keep them.
    q, k, v, la, b = random_inputs(13, 64, 8, 8)
    la = np.where(np.arange(64) % 16 == 0, -1e4, -0.01).astype(np.float32)
    y_ref, s_ref = gated_delta_reference(q, k, v, la, b, scale=8**-0.5)
    y, s = chunked(q, k, v, la, b, chunk_size=64)
    assert_close(y, y_ref, jnp.float32)
    assert_close(s, s_ref, jnp.float32)


def test_gradients_finite_at_gate_edges():
    # Set in NumPy: eager updates of JAX arrays would compile a program each.
    q, k, v, la, b = (np.array(x) for x in random_inputs(14, 100, 8, 8))
    la[::7], la[1::7] = -1e4, 0.0
    b[::5], b[1::5] = 0.0, 2.0

    def loss(*args):
        y, s = on_cpu.gated_delta_rule_chunked(*args, chunk_size=16)
        return jnp.sum(y**2) + jnp.sum(s**2)

    grads = jax.jit(jax.grad(loss, argnums=range(5)))(q, k, v, la, b)
    for g in grads:
        assert np.isfinite(g).all()


def test_long_sequence_stays_finite_and_matches_recurrent():
    q, k, v, la, b = random_inputs(15, 16384, 16, 16, log_alpha_range=(-0.05, 0.0))
    y_rec, s_rec = recurrent(q, k, v, la, b)
    y_chk, s_chk = chunked(q, k, v, la, b, chunk_size=64)
    assert np.isfinite(y_chk).all() and np.isfinite(s_chk).all()
    assert_close(y_chk, y_rec, jnp.float32)
    assert_close(s_chk, s_rec, jnp.float32)


def test_minus_infinity_gate_is_a_full_reset():
    # alpha = exp(-inf) = 0 wipes the state; the chunked form must not let -inf meet the
    # zeros of a mask (0 * -inf = NaN) in its segment sums or its backward.
    q, k, v, la, b = random_inputs(16, 100, 8, 6)
    la = np.array(la)  # set in NumPy: an eager update would compile a program
    la[[0, 17, 40, 41, 99]] = -np.inf
    state = random_state(17, 6, 8)
    y_ref, s_ref = gated_delta_reference(q, k, v, la, b, scale=8**-0.5, initial_state=state)
    cotangents = (random_state(18, 100, 6), random_state(19, 6, 8))

    def loss(fn, *args):
        y, s = fn(*args[:5], initial_state=args[5])
        return jnp.sum(y * cotangents[0]) + jnp.sum(s * cotangents[1])

    forms = {"recurrent": gdn_jax.gated_delta_rule_recurrent}
    forms.update(
        {
            f"chunked {c}": functools.partial(on_cpu.gated_delta_rule_chunked, chunk_size=c)
            for c in (16, 64)
        }
    )
    grads = {}
    for name, fn in forms.items():
        y, s = jax.jit(fn)(q, k, v, la, b, initial_state=state)
        assert_close(y, y_ref, jnp.float32, name)
        assert_close(s, s_ref, jnp.float32, name)
        grads[name] = jax.jit(jax.grad(functools.partial(loss, fn), argnums=range(6)))(
            q, k, v, la, b, state
        )
    for name in forms:
        for arg, g, e in zip(
            "q k v la b state".split(), grads[name], grads["recurrent"], strict=True
        ):
            assert np.isfinite(g).all(), (name, arg)
            assert_close(g, e, jnp.float32, f"{name} d{arg}")


chunked_in = jax.jit(on_cpu.gated_delta_rule_chunked, static_argnames=("chunk_size", "schedule"))


@pytest.mark.parametrize("schedule", ["in_scan", "hoisted"])
def test_extent_of_a_nan_at_one_token(schedule):
    """The documented extent (chunked.py): a NaN in q at token t reaches y_t alone; in k, v,
    log_alpha or beta it reaches y from t on in the recurrent form, and from the start of t's
    chunk on in the chunked form, whose in-chunk products multiply it by exact zeros. Every
    output before that is the clean one."""
    inputs = random_inputs(20, 40, 4, 3)
    clean = np.asarray(recurrent(*inputs)[0])
    t, chunk_start = 20, 16
    for i, name in enumerate(["q", "k", "v", "log_alpha", "beta"]):
        poisoned = [np.array(x) for x in inputs]  # set in NumPy, as above
        poisoned[i][t] = np.nan
        y_rec, _ = recurrent(*poisoned)
        y_chk, _ = chunked_in(*poisoned, chunk_size=16, schedule=schedule)
        first = t if name == "q" else chunk_start
        last = t if name == "q" else 39
        for y, nan_from in ((y_rec, t), (y_chk, first)):
            y = np.asarray(y)  # sliced in NumPy, as above
            nan_rows = np.flatnonzero(~np.isfinite(y).all(1))
            assert nan_rows.tolist() == list(range(nan_from, last + 1)), name
            assert_close(y[:nan_from], clean[:nan_from], jnp.float32, name)


def test_a_nan_stays_in_its_packed_sequence():
    """Packed, t's chunk starts where t's sequence does (or later), and the next sequence
    starts from its own initial state: a NaN never leaves its sequence. Both schedules share
    that reset (blocks.scan_blocks), so one is tested."""
    q, k, v, la, b = random_inputs(21, 40, 4, 3, lead=(1,), heads=(1, 1))
    cu = jnp.asarray([0, 10, 25, 40], jnp.int32)
    packed = jax.jit(functools.partial(on_cpu.gated_delta_rule, chunk_size=16))
    k = np.array(k)  # set in NumPy: an eager update would compile a program
    k[0, 15] = np.nan
    y, finals = packed(q, k, v, la, b, cu_seqlens=cu)
    nan_rows = np.flatnonzero(~np.isfinite(np.asarray(y[0])).all((1, 2)))
    assert nan_rows.tolist() == list(range(10, 25))
    assert np.isfinite(np.asarray(finals)).all((1, 2, 3)).tolist() == [True, False, True]
