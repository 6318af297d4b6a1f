"""Gated linear attention (GLA, one decay per key channel, no delta correction): the step, the
recurrent and chunked forms (every schedule of the channel engine) and the batched entry
point against the float64 loop, each other and simple_gla; the old calls of the name, with
beta, warn once and run simple_gla. flash-linear-attention's naive GLA is
tests/interop/test_gla_torch.py's."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from support import cpu_schedule as on_cpu
from support import forms
from support.forms import with_state_and_cotangents
from support.reference import gla_reference, random_inputs, random_state
from support.tolerance import assert_close

import gdn_jax
from gdn_jax.ops import renamed
from gdn_jax.ops.chunked.channel_backward import CPU_GRADS_GROUP, GRADS_GROUP

RULE = "gated_linear_attention"
HEADS, V_HEADS, KEY, VALUE = 2, 4, 12, 10

gla = forms.batched(RULE)
gla_recurrent = jax.jit(gdn_jax.gated_linear_attention_recurrent, static_argnames="scale")
gla_chunked = jax.jit(
    on_cpu.gated_linear_attention_chunked, static_argnames=("scale", "chunk_size", "schedule")
)
gla_step = jax.jit(gdn_jax.gated_linear_attention_step, static_argnames="scale")


def gla_inputs(seed, seq_len, key_dim, value_dim, **kw):
    """q, k, v and log_alpha per key channel (random_inputs' beta dropped)."""
    return random_inputs(seed, seq_len, key_dim, value_dim, per_channel=True, **kw)[:4]


def single_head_args(seed, seq_len, key_dim, value_dim, dtype=jnp.float32, **kw):
    inputs = gla_inputs(seed, seq_len, key_dim, value_dim, dtype=dtype, **kw)
    return with_state_and_cotangents(inputs, seed, seq_len, key_dim, value_dim, dtype)


def loop_per_head(q, k, v, la, state, n, i):
    """The float64 loop for sequence ``n`` and value head ``i`` of the batched layout."""
    h = i // (V_HEADS // HEADS)
    return gla_reference(
        q[n, :, h], k[n, :, h], v[n, :, i], la[n, :, i], scale=KEY**-0.5,
        initial_state=None if state is None else state[n, i],
    )  # fmt: skip


# --- the step and the recurrent form against the float64 loop --------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_step_and_recurrent_match_the_float64_loop(dtype):
    q, k, v, la = (np.asarray(x) for x in gla_inputs(0, 40, KEY, VALUE, dtype=dtype))
    state = random_state(1, VALUE, KEY, dtype=dtype)
    y_ref, s_ref = gla_reference(q, k, v, la, scale=0.3, initial_state=state)
    y, s = gla_recurrent(q, k, v, la, scale=0.3, initial_state=state)
    assert y.dtype == dtype and s.dtype == dtype
    assert_close(y, y_ref, dtype)
    assert_close(s, s_ref, dtype)
    s1, y1 = gla_step(state, q[0], k[0], v[0], la[0], scale=0.3)
    y1_ref, s1_ref = gla_reference(q[:1], k[:1], v[:1], la[:1], scale=0.3, initial_state=state)
    assert_close(y1, y1_ref[0], dtype)
    assert_close(s1, s1_ref, dtype)


def test_step_token_by_token_equals_the_recurrent_form():
    q, k, v, la = gla_inputs(6, 7, KEY, VALUE)
    state = random_state(7, VALUE, KEY)
    forms.assert_steps_equal_recurrent(RULE, (q, k, v, la), state, jnp.float32)


# --- the chunked form against the recurrent one ------------------------------------------------

CHUNKED_CASES = [
    # (T, K, V, chunk_size, schedule): T off the chunk grid, K and V odd sizes, every schedule
    # of the channel engine, and more chunks than the hoisted backward takes at a time.
    (130, 16, 24, 64, "in_scan"),
    (70, 20, 12, 16, "hoisted"),
    (70, 20, 12, 16, "associative"),
    (16 * (GRADS_GROUP + 3) - 5, 8, 6, 16, "hoisted"),
]
assert (GRADS_GROUP + 3) % CPU_GRADS_GROUP, "the CPU's last group of chunks is a short one"


@pytest.mark.parametrize(("seq_len", "key_dim", "value_dim", "chunk", "schedule"), CHUNKED_CASES)
def test_chunked_equals_recurrent_values_and_gradients(
    seq_len, key_dim, value_dim, chunk, schedule
):
    args = single_head_args(seq_len, seq_len, key_dim, value_dim)
    options = dict(chunk_size=chunk, schedule=schedule)
    forms.assert_forms_agree(RULE, args, jnp.float32, options, f"T={seq_len} {schedule}")


def test_chunked_equals_recurrent_in_float64():
    args = single_head_args(40, 100, 8, 6, dtype=jnp.float64, log_alpha_range=(-3.0, 0.0))
    forms.assert_forms_agree(RULE, args, jnp.float64, dict(chunk_size=64, schedule="in_scan"))


def test_chunked_finite_differences_float64():
    q, k, v, la = gla_inputs(50, 37, 4, 3, dtype=jnp.float64)
    state = random_state(51, 3, 4, dtype=jnp.float64)
    run = jax.jit(lambda *a: on_cpu.gated_linear_attention_chunked(*a[:4], initial_state=a[4],
                                                                    chunk_size=32))  # fmt: skip
    check_grads(run, (q, k, v, la, state), order=1, modes=["rev"], eps=1e-6)


@pytest.mark.parametrize("edge", ["no decay", "channels reset", "mixed"])
def test_gate_edges_are_finite_and_exact(edge):
    # The shapes and options of the first chunked case: the same compiled programs.
    q, k, v, la, state, ct_y, ct_s = single_head_args(60, 130, 16, 24)
    la = np.array(la)  # set in NumPy: eager updates compile
    if edge == "no decay":
        la[:] = 0.0
    elif edge == "channels reset":
        la[[0, 17, 40, 41, 99], [0, 3, 3, 5, 1]] = -np.inf
    else:  # channel 0 never decays, 1 always resets, 2 resets every 16 tokens
        la[:, 0], la[:, 1] = 0.0, -np.inf
        la[:, 2] = np.where(np.arange(130) % 16 == 3, -1e4, -0.01)
    args = (q, k, v, la, state, ct_y, ct_s)
    y_ref, s_ref = gla_reference(q, k, v, la, scale=16**-0.5, initial_state=state)
    y, s, _ = forms.outputs_and_grads(RULE, "chunked", chunk_size=64, schedule="in_scan")(*args)
    assert np.isfinite(y).all() and np.isfinite(s).all()
    assert_close(y, y_ref, jnp.float32, edge)
    assert_close(s, s_ref, jnp.float32, edge)
    forms.assert_forms_agree(RULE, args, jnp.float32, dict(chunk_size=64, schedule="in_scan"))


def test_residuals_are_the_inputs_and_one_state_per_chunk():
    forms.assert_residuals_are_inputs_and_one_state_per_chunk(
        RULE, lambda seq_len: single_head_args(70, seq_len, 8, 8)[:5], chunk=64
    )


# --- the batched entry point -------------------------------------------------------------------


def batched_inputs(seed, seq_len, batch=1):
    return gla_inputs(seed, seq_len, KEY, VALUE, lead=(batch,), heads=(HEADS, V_HEADS))


@pytest.mark.parametrize("impl", ["chunked", "recurrent"])
def test_batched_grouped_heads_match_the_loop_per_head(impl):
    q, k, v, la = batched_inputs(3, 33, batch=2)
    state = random_state(4, 2, V_HEADS, VALUE, KEY)
    out, final = gla(q, k, v, la, initial_state=state, impl=impl, chunk_size=16)
    assert out.shape == (2, 33, V_HEADS, VALUE) and final.shape == (2, V_HEADS, VALUE, KEY)
    q, k, v, la, state, out, final = (np.asarray(x) for x in (q, k, v, la, state, out, final))
    for n in range(2):
        for i in range(V_HEADS):
            y, s = loop_per_head(q, k, v, la, state, n, i)
            assert_close(out[n, :, i], y, jnp.float32, f"sequence {n}, value head {i}")
            assert_close(final[n, i], s, jnp.float32, f"sequence {n}, value head {i}")


def test_equal_channels_are_simple_gla_with_unit_beta():
    q, k, v, la, _ = random_inputs(5, 45, KEY, VALUE, lead=(1,), heads=(HEADS, V_HEADS))
    state = random_state(6, 1, V_HEADS, VALUE, KEY)
    la_channels = jnp.broadcast_to(la[..., None], (*la.shape, KEY))
    out, final = gla(q, k, v, la_channels, initial_state=state, impl="chunked", chunk_size=32)
    simple = forms.batched("simple_gla")
    ones = jnp.ones(la.shape, jnp.float32)
    out_s, final_s = simple(q, k, v, la, ones, initial_state=state, impl="chunked", chunk_size=32)
    assert_close(out, out_s, jnp.float32)
    assert_close(final, final_s, jnp.float32)


def test_packed_sequences_equal_separate_runs():
    cu = [0, 5, 5, 70, 100]  # an empty sequence, and sequences across chunk boundaries
    inputs = batched_inputs(7, 100)
    state = random_state(8, len(cu) - 1, V_HEADS, VALUE, KEY)
    ct_out = random_state(9, 1, 100, V_HEADS, VALUE)
    forms.assert_packed_equals_separate(RULE, inputs, state, ct_out, cu, loop_per_head)


# --- the old calls of the name -----------------------------------------------------------------

OLD_FORMS = {
    # name: (the form, its simple_gla twin, its arguments from q, k, v, log_alpha, beta, state)
    "step": (
        gdn_jax.gated_linear_attention_step,
        gdn_jax.simple_gla_step,
        lambda q, k, v, la, b, s: (
            (s[0, 0], q[0, 0, 0], k[0, 0, 0], v[0, 0, 0], la[0, 0, 0], b[0, 0, 0]),
            {},
        ),
    ),  # fmt: skip
    "recurrent": (
        gdn_jax.gated_linear_attention_recurrent,
        gdn_jax.simple_gla_recurrent,
        lambda q, k, v, la, b, s: (
            (q[0, :, 0], k[0, :, 0], v[0, :, 0], la[0, :, 0], b[0, :, 0]),
            dict(initial_state=s[0, 0]),
        ),
    ),  # fmt: skip
    "chunked": (
        gdn_jax.gated_linear_attention_chunked,
        gdn_jax.simple_gla_chunked,
        lambda q, k, v, la, b, s: (
            (q[0, :, 0], k[0, :, 0], v[0, :, 0], la[0, :, 0], b[0, :, 0]),
            dict(initial_state=s[0, 0], chunk_size=16, schedule="in_scan"),
        ),
    ),  # fmt: skip
    "batched": (
        gdn_jax.gated_linear_attention,
        gdn_jax.simple_gla,
        lambda q, k, v, la, b, s: (
            (q, k, v, la, b),
            dict(initial_state=s, chunk_size=16, schedule="in_scan"),
        ),
    ),  # fmt: skip
}


@pytest.mark.parametrize("form", list(OLD_FORMS))
def test_an_old_call_with_beta_warns_once_and_runs_simple_gla(form, monkeypatch):
    """The scalar-gated rule's calls of the name, with beta: one DeprecationWarning a process
    (two traces, one warning), and simple_gla's results to the bit."""
    monkeypatch.setattr(renamed, "WARNED", set())
    old, new, arguments = OLD_FORMS[form]
    q, k, v, la, b = random_inputs(10, 20, 4, 3, lead=(1,), heads=(1, 1))
    args, options = arguments(q, k, v, la, b, random_state(11, 1, 1, 3, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            jax.eval_shape(functools.partial(old, **options), *args)
    assert [w.category for w in caught] == [DeprecationWarning], [str(w.message) for w in caught]
    assert "simple_gla" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        got = jax.jit(functools.partial(old, **options))(*args)
    want = jax.jit(functools.partial(new, **options))(*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


# --- bad inputs --------------------------------------------------------------------------------


def test_a_per_head_log_alpha_is_refused_naming_the_argument():
    q, k, v, la, _ = random_inputs(14, 8, KEY, VALUE, lead=(1,), heads=(HEADS, V_HEADS))
    with pytest.raises(
        ValueError,
        match=r"gated_linear_attention: log_alpha must have shape \[B, T, HV, K\] \(one gate per "
        r"key channel\) = \(1, 8, 4, 12\), got \(1, 8, 4\)",
    ):
        gdn_jax.gated_linear_attention(q, k, v, la)
    with pytest.raises(ValueError, match=r"gated_linear_attention: impl='mosaic_gpu' is a kernel"):
        gdn_jax.gated_linear_attention(*batched_inputs(14, 8), impl="mosaic_gpu")
