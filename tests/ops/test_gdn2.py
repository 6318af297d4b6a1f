"""Gated DeltaNet-2 (a channel-wise erase gate on the keys, a write gate on the values): the
step, the recurrent and chunked forms and the batched entry point against the float64 loop,
each other, KDA and the gated delta rule."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from support import cpu_schedule as on_cpu
from support import forms
from support.forms import with_state_and_cotangents
from support.reference import erase_write_reference, random_inputs, random_state
from support.tolerance import assert_close

import gdn_jax
from gdn_jax.ops.chunked.channel_backward import CPU_GRADS_GROUP, GRADS_GROUP, LEVELS_GROUP

HEADS, V_HEADS, KEY, VALUE = 2, 4, 12, 10

gdn2 = forms.batched("gdn2")
gdn2_chunked = jax.jit(on_cpu.gdn2_chunked, static_argnames=("scale", "chunk_size", "schedule"))
# Jitted: eagerly each call would compile a program per operation.
gdn2_recurrent = jax.jit(gdn_jax.gdn2_recurrent, static_argnames="scale")
gdn2_step = jax.jit(gdn_jax.gdn2_step, static_argnames="scale")


def gdn2_inputs(seed, seq_len, key_dim, value_dim, *, dtype=jnp.float32, lead=(), heads=None, **kw):
    """q, k, v, log_alpha per key channel, and the erase and write gates in [0, 1] (in
    [0, 2] for the erase gate with ``reflect``)."""
    q, k, v, la, _ = random_inputs(
        seed, seq_len, key_dim, value_dim, dtype=dtype, lead=lead, heads=heads,
        per_channel=True, **kw,
    )  # fmt: skip
    rng = np.random.default_rng(seed + 100)
    b = jnp.asarray(rng.uniform(0, 1, la.shape), dtype)
    w = jnp.asarray(rng.uniform(0, 1, (*la.shape[:-1], value_dim)), dtype)
    return q, k, v, la, b, w


def batched_inputs(seed, seq_len, batch=1, **kw):
    return gdn2_inputs(seed, seq_len, KEY, VALUE, lead=(batch,), heads=(HEADS, V_HEADS), **kw)


def loop_per_head(q, k, v, la, b, w, state, n, i):
    """The float64 loop for sequence ``n`` and value head ``i`` of the batched layout."""
    h = i // (V_HEADS // HEADS)
    return erase_write_reference(
        q[n, :, h], k[n, :, h], v[n, :, i], la[n, :, i], b[n, :, i], w[n, :, i],
        scale=KEY**-0.5, initial_state=None if state is None else state[n, i],
    )  # fmt: skip


def single_head_args(seed, seq_len, key_dim, value_dim, dtype=jnp.float32, **kw):
    inputs = gdn2_inputs(seed, seq_len, key_dim, value_dim, dtype=dtype, **kw)
    return with_state_and_cotangents(inputs, seed, seq_len, key_dim, value_dim, dtype)


def assert_forms_agree(args, dtype, chunked_options, label="", **kw):
    forms.assert_forms_agree("gdn2", args, dtype, chunked_options, label, **kw)


def outputs_and_grads(form, **options):
    return forms.outputs_and_grads("gdn2", form, **options)


# --- the step and the recurrent form against the float64 loop --------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_step_and_recurrent_match_the_float64_loop(dtype):
    # In NumPy: eager slices and products of JAX arrays would compile a program each.
    q, k, v, la, b, w = (np.asarray(x) for x in gdn2_inputs(0, 40, KEY, VALUE, dtype=dtype))
    b = 2.0 * b  # negative eigenvalues allowed
    state = random_state(1, VALUE, KEY, dtype=dtype)
    y_ref, s_ref = erase_write_reference(q, k, v, la, b, w, scale=0.3, initial_state=state)
    y, s = gdn2_recurrent(q, k, v, la, b, w, scale=0.3, initial_state=state)
    assert y.dtype == dtype and s.dtype == dtype
    assert_close(y, y_ref, dtype)
    assert_close(s, s_ref, dtype)
    s1, y1 = gdn2_step(state, q[0], k[0], v[0], la[0], b[0], w[0], scale=0.3)
    y1_ref, s1_ref = erase_write_reference(
        q[:1], k[:1], v[:1], la[:1], b[:1], w[:1], scale=0.3, initial_state=state
    )
    assert_close(y1, y1_ref[0], dtype)
    assert_close(s1, s1_ref, dtype)


def test_gates_act_on_their_own_axes():
    """One token from a zero state: ``S = (w * v) k^T`` (the write gate scales rows); from
    ``S`` with ``v = 0``: ``S - (S (b * k)) k^T`` (the erase gate weights key channels)."""
    rng = np.random.default_rng(2)
    k, v = rng.standard_normal(4), rng.standard_normal(3)
    b, w = np.asarray([1.0, 0.0, 0.5, 2.0]), np.asarray([0.0, 1.0, 0.25])
    state = rng.standard_normal((3, 4))
    f64 = functools.partial(jnp.asarray, dtype=jnp.float64)
    zero_k, zero_g = np.zeros(4), np.zeros(4)
    written, _ = gdn2_step(f64(np.zeros((3, 4))), *map(f64, (zero_k, k, v, zero_g, b, w)))
    np.testing.assert_allclose(written, np.outer(w * v, k), rtol=1e-14)
    erased, _ = gdn2_step(f64(state), *map(f64, (zero_k, k, 0 * v, zero_g, b, w)))
    np.testing.assert_allclose(erased, state - np.outer(state @ (b * k), k), rtol=1e-14)


# --- the chunked form against the recurrent one ------------------------------------------------


@pytest.mark.parametrize("schedule", ["in_scan", "hoisted", "associative"])
def test_chunked_equals_recurrent_values_and_gradients(schedule):
    # T off the chunk grid, odd K and V.
    args = single_head_args(130, 130, 16, 24)
    options = dict(chunk_size=64, schedule=schedule)
    assert_forms_agree(args, jnp.float32, options, schedule)


def test_chunked_with_the_gpu_scores_equals_recurrent(monkeypatch):
    """The whole op as it runs on a GPU (every platform choice takes its GPU branch: the
    scores of every level at once, ``channel_levels.all_levels``, the scores' pullback
    ``LEVELS_GROUP`` chunks a group), on this CPU: values and every gradient against the
    recurrent form, with more chunks than a group, the last group shorter."""
    monkeypatch.setattr(jax.lax, "platform_dependent", forms.as_on_an_nvidia_gpu)
    args = single_head_args(132, 16 * (LEVELS_GROUP + 3) - 5, 8, 6)
    options = dict(chunk_size=16, schedule="associative")
    assert_forms_agree(args, jnp.float32, options, "GPU branches", shared=False)


def test_hoisted_gradients_in_groups_of_chunks_equal_recurrent():
    """More chunks than the hoisted backward takes at a time (``GRADS_GROUP``, and
    ``CPU_GRADS_GROUP`` on this CPU), the last group shorter."""
    assert (GRADS_GROUP + 3) % CPU_GRADS_GROUP
    args = single_head_args(131, 16 * (GRADS_GROUP + 3) - 5, 8, 6)
    options = dict(chunk_size=16, schedule="hoisted")
    assert_forms_agree(args, jnp.float32, options, "hoisted, in groups")


def test_chunked_equals_recurrent_in_float64(schedule="hoisted"):
    """Exact to float64 tolerance on values and every gradient, with strong decays, erase
    gates up to 2 and a padded tail, in the schedule whose backward is hoisted out of the
    state pass (the float32 test above runs both)."""
    q, k, v, la, b, w, *rest = single_head_args(
        40, 300, 8, 6, dtype=jnp.float64, log_alpha_range=(-3.0, 0.0)
    )
    args = (q, k, v, la, 2.0 * b, w, *rest)
    assert_forms_agree(args, jnp.float64, dict(chunk_size=64, schedule=schedule), schedule)


def test_chunked_finite_differences_float64():
    q, k, v, la, b, w = gdn2_inputs(50, 37, 4, 3, dtype=jnp.float64)
    state = random_state(51, 3, 4, dtype=jnp.float64)
    run = jax.jit(lambda *a: on_cpu.gdn2_chunked(*a[:6], initial_state=a[6], chunk_size=32))
    check_grads(run, (q, k, v, la, b, w, state), order=1, modes=["rev"], eps=1e-6)


@pytest.mark.parametrize("edge", ["no decay", "channels reset"])
def test_gate_edges_are_finite_and_exact(edge):
    """log_alpha 0 or -inf per channel; b and w exactly 0 and 1 (and 2 for b) per channel."""
    # The shapes and options of a case above: the same compiled programs.
    q, k, v, la, b, w, state, ct_y, ct_s = single_head_args(60, 130, 16, 24)
    # Set in NumPy: eager updates of JAX arrays would compile a program each.
    la, b, w = (np.array(x) for x in (la, b, w))
    if edge == "no decay":
        la[:] = 0.0
    else:
        la[[0, 17, 40, 41, 99], [0, 3, 3, 5, 1]] = -np.inf
        la[:, 2] = -np.inf
    b[::5], b[1::5], b[2::5, :3], b[:, 4] = 0.0, 1.0, 2.0, 0.0
    w[::7], w[1::7], w[:, 5] = 0.0, 1.0, 0.0
    args = (q, k, v, la, b, w, state, ct_y, ct_s)
    y_ref, s_ref = erase_write_reference(q, k, v, la, b, w, scale=16**-0.5, initial_state=state)
    options = dict(chunk_size=64, schedule="in_scan")
    y, s, _ = outputs_and_grads("chunked", **options)(*args)
    assert np.isfinite(y).all() and np.isfinite(s).all()
    assert_close(y, y_ref, jnp.float32, edge)
    assert_close(s, s_ref, jnp.float32, edge)
    assert_forms_agree(args, jnp.float32, options, edge)


def test_residuals_are_the_inputs_and_one_state_per_chunk():
    """What the backward keeps grows with T by the inputs and one [V, K] state per chunk
    (two lengths, so the constant masks the recomputation needs cancel out)."""
    forms.assert_residuals_are_inputs_and_one_state_per_chunk(
        "gdn2", lambda seq_len: single_head_args(70, seq_len, 8, 8)[:7], chunk=64
    )


# --- the batched entry point -------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["chunked", "recurrent"])
def test_batched_grouped_heads_match_the_loop_per_head(impl):
    q, k, v, la, b, w = batched_inputs(3, 33, batch=2)
    state = random_state(4, 2, V_HEADS, VALUE, KEY)
    out, final = gdn2(q, k, v, la, b, w, initial_state=state, impl=impl, chunk_size=16)
    assert out.shape == (2, 33, V_HEADS, VALUE) and final.shape == (2, V_HEADS, VALUE, KEY)
    # Sliced in NumPy: eager slices of JAX arrays would compile a program per shape.
    q, k, v, la, b, w, state, out, final = (
        np.asarray(x) for x in (q, k, v, la, b, w, state, out, final)
    )
    for n in range(2):
        for i in range(V_HEADS):
            y, s = loop_per_head(q, k, v, la, b, w, state, n, i)
            assert_close(out[n, :, i], y, jnp.float32, f"sequence {n}, value head {i}")
            assert_close(final[n, i], s, jnp.float32, f"sequence {n}, value head {i}")


# test_kda.py's programs at these shapes.
kda, gdn = forms.batched("kda"), forms.batched("gated_delta_rule")


@pytest.mark.parametrize("impl", ["chunked", "recurrent"])
def test_one_gate_for_erase_and_write_is_kda_and_equal_channels_the_gated_delta_rule(impl):
    q, k, v, la, beta = random_inputs(5, 45, KEY, VALUE, lead=(1,), heads=(HEADS, V_HEADS))
    state = random_state(6, 1, V_HEADS, VALUE, KEY)
    la_channels = jnp.broadcast_to(la[..., None], (*la.shape, KEY))
    b = jnp.broadcast_to(beta[..., None], (*beta.shape, KEY))
    w = jnp.broadcast_to(beta[..., None], (*beta.shape, VALUE))
    run = functools.partial(gdn2, initial_state=state, impl=impl, chunk_size=32)
    out, final = run(q, k, v, la_channels, b, w)
    out_kda, final_kda = kda(
        q, k, v, la_channels, beta, initial_state=state, impl=impl, chunk_size=32
    )
    out_gdn, final_gdn = gdn(q, k, v, la, beta, initial_state=state, impl=impl, chunk_size=32)
    for expected in ((out_kda, final_kda), (out_gdn, final_gdn)):
        assert_close(out, expected[0], jnp.float32)
        assert_close(final, expected[1], jnp.float32)


def test_packed_sequences_equal_separate_runs():
    cu = [0, 5, 5, 70, 100]  # an empty sequence, and sequences across chunk boundaries
    inputs = batched_inputs(7, 100)
    state = random_state(8, len(cu) - 1, V_HEADS, VALUE, KEY)
    ct_out = random_state(9, 1, 100, V_HEADS, VALUE)
    forms.assert_packed_equals_separate("gdn2", inputs, state, ct_out, cu, loop_per_head)


@pytest.mark.parametrize("schedule", ["in_scan", "hoisted"])
def test_bfloat16_inputs_keep_a_float32_state(schedule):
    """Outputs, final state and every gradient of bfloat16 inputs against the same inputs
    in float32, in both schedules: the hoisted one forms ``w * v`` before its loops only for
    inputs already in float32, so the two dtypes take its two paths."""
    inputs = batched_inputs(10, 45)
    state = random_state(11, 1, V_HEADS, VALUE, KEY)
    low = tuple(x.astype(jnp.bfloat16) for x in inputs)
    run = functools.partial(
        gdn2, initial_state=state, impl="chunked", chunk_size=32, schedule=schedule
    )
    out, final = run(*low)
    assert out.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    out_ref, final_ref = run(*(x.astype(jnp.float32) for x in low))
    assert_close(out, out_ref, jnp.bfloat16)
    assert_close(final, final_ref, jnp.float32)

    def loss(*xs):
        y, s = run(*xs)
        return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(s)

    grad = jax.jit(jax.grad(loss, argnums=tuple(range(6))))
    grads, grads_ref = grad(*low), grad(*(x.astype(jnp.float32) for x in low))
    for name, g, g_ref in zip("q k v log_alpha b w".split(), grads, grads_ref, strict=True):
        assert g.dtype == jnp.bfloat16, name
        assert_close(g, g_ref, jnp.bfloat16, err_msg=name)


def test_long_sequence_is_finite_and_matches_recurrent():
    """The acceptance length, T = 16384, at small dims in one forward of each form."""
    inputs = gdn2_inputs(13, 16384, 8, 8, log_alpha_range=(-0.1, 0))
    y_chk, s_chk = gdn2_chunked(*inputs, chunk_size=64)
    assert np.isfinite(y_chk).all() and np.isfinite(s_chk).all()
    y_rec, s_rec = gdn2_recurrent(*inputs)
    assert_close(y_chk, y_rec, jnp.float32)
    assert_close(s_chk, s_rec, jnp.float32)


# --- bad inputs --------------------------------------------------------------------------------


def test_gates_on_the_wrong_axis_are_refused_naming_the_argument():
    q, k, v, la, b, w = batched_inputs(14, 8)
    with pytest.raises(ValueError, match=r"gdn2: w must have shape \[B, T, HV, V\]"):
        gdn_jax.gdn2(q, k, v, la, b, b)
    with pytest.raises(ValueError, match=r"gdn2: b must have shape \[B, T, HV, K\]"):
        gdn_jax.gdn2(q, k, v, la, w, w)
    with pytest.raises(ValueError, match=r"gdn2: log_alpha must have shape \[B, T, HV, K\]"):
        gdn_jax.gdn2(q, k, v, la[..., 0], b, w)
    q1, k1, v1, la1, b1, w1 = gdn2_inputs(14, 8, KEY, VALUE)
    for fn in (gdn_jax.gdn2_recurrent, gdn_jax.gdn2_chunked):
        with pytest.raises(ValueError, match=rf"{fn.__name__}: w must have shape \[T, V\]"):
            fn(q1, k1, v1, la1, b1, b1)
    with pytest.raises(ValueError, match=r"gdn2_step: b must have shape \[K\]"):
        gdn_jax.gdn2_step(jnp.zeros((VALUE, KEY)), q1[0], k1[0], v1[0], la1[0], w1[0], w1[0])
