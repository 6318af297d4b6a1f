"""Bad arguments to the ops raise ValueError at trace time, naming the argument and showing
its shape or value: shapes, dtypes, options (chunk_size, scale, impl, schedule) and Python
lists where arrays go (forward-mode autodiff through the chunked forms: test_forward_mode.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.reference import random_inputs
from support.tolerance import assert_close

import gdn_jax
from gdn_jax import GatedDeltaNet


def batched_inputs(batch=1, seq_len=8, heads=2, v_heads=2, key_dim=4, value_dim=3):
    return list(
        random_inputs(0, seq_len, key_dim, value_dim, lead=(batch,), heads=(heads, v_heads))
    )


def call(args, **kw):
    return gdn_jax.gated_delta_rule(*args, **kw)


@pytest.mark.parametrize(
    ("index", "shape", "message"),
    [
        (0, (1, 8, 2), r"q must be \[B, T, H, K\] \(rank 4\), got shape \(1, 8, 2\)"),
        (
            1,
            (1, 8, 2, 5),
            r"k must have shape \[B, T, H, K\] like q = \(1, 8, 2, 4\), got \(1, 8, 2, 5\)",
        ),
        (1, (1, 7, 2, 4), r"k must have shape .* got \(1, 7, 2, 4\)"),
        (
            2,
            (1, 9, 2, 3),
            r"v must have shape \[B, T, HV, V\] = \(1, 8, 2, 3\), got \(1, 9, 2, 3\)",
        ),
        (3, (1, 8, 3), r"log_alpha must have shape \[B, T, HV\] = \(1, 8, 2\), got \(1, 8, 3\)"),
        (4, (1, 8), r"beta must have shape \[B, T, HV\] = \(1, 8, 2\), got \(1, 8\)"),
    ],
)
def test_shape_mismatches(index, shape, message):
    args = batched_inputs()
    args[index] = jnp.zeros(shape, jnp.float32)
    with pytest.raises(ValueError, match=message):
        call(args)


def test_value_heads_must_be_a_multiple_of_query_heads():
    args = batched_inputs(heads=2, v_heads=3)
    with pytest.raises(ValueError, match=r"HV=3 .* multiple of query/key heads H=2"):
        call(args)


def test_initial_state_shape():
    args = batched_inputs()
    with pytest.raises(
        ValueError,
        match=r"initial_state must have shape \[B, HV, V, K\] = \(1, 2, 3, 4\), got \(1, 2, 4, 3\)",
    ):
        call(args, initial_state=jnp.zeros((1, 2, 4, 3)))


def test_cu_seqlens_needs_batch_one():
    args = batched_inputs(batch=2)
    with pytest.raises(ValueError, match=r"cu_seqlens .* needs B == 1, got q.shape=\(2, 8, 2, 4\)"):
        call(args, cu_seqlens=jnp.asarray([0, 8], jnp.int32))


@pytest.mark.parametrize(
    ("cu", "message"),
    [
        (jnp.asarray([0, 3, 7], jnp.int32), r"rise from 0 to T=8 .* got \[0, 3, 7\]"),
        (jnp.asarray([0, 5, 3, 8], jnp.int32), r"without decreasing, got \[0, 5, 3, 8\]"),
        (jnp.asarray([0.0, 8.0]), r"cu_seqlens must be integer, got dtype float"),
        (jnp.asarray([[0, 8]], jnp.int32), r"cu_seqlens must be a 1-D int array"),
    ],
)
def test_bad_cu_seqlens(cu, message):
    with pytest.raises(ValueError, match=message):
        call(batched_inputs(), cu_seqlens=cu)


@pytest.mark.parametrize(
    ("cu", "message"),
    [
        ([0, 3, 7], r"gated_delta_rule: cu_seqlens must rise from 0 to T=8 .* got \[0, 3, 7\]"),
        ((0.0, 8.0), r"gated_delta_rule: cu_seqlens must be integer, got dtype float"),
        ([False, True], r"gated_delta_rule: cu_seqlens must be integer, got dtype bool"),
        (
            "0,8",
            r"gated_delta_rule: cu_seqlens must be a 1-D int array \[N\+1\] \(or a list of "
            r"ints\), got '0,8'",
        ),
    ],
)
def test_cu_seqlens_array_likes_are_checked_as_arrays(cu, message):
    """Unchecked, a list ended in an AttributeError ('list' object has no attribute
    'astype') from the packed layout."""
    with pytest.raises(ValueError, match=message):
        call(batched_inputs(), cu_seqlens=cu)


def test_cu_seqlens_given_as_a_list_equals_the_array():
    @jax.jit
    def both(*args):
        as_array = call(args, cu_seqlens=jnp.asarray([0, 3, 8], jnp.int32), chunk_size=16)
        return as_array, call(args, cu_seqlens=[0, 3, 8], chunk_size=16)

    as_array, as_list = both(*batched_inputs())
    for got, expected in zip(as_list, as_array, strict=True):
        np.testing.assert_array_equal(got, expected)


def test_packed_initial_state_is_per_sequence():
    with pytest.raises(
        ValueError, match=r"initial_state must have shape \[N, HV, V, K\] = \(2, 2, 3, 4\)"
    ):
        call(
            batched_inputs(),
            cu_seqlens=jnp.asarray([0, 4, 8], jnp.int32),
            initial_state=jnp.zeros((1, 2, 3, 4)),
        )


@pytest.mark.parametrize("chunk_size", [8, 48, 256])
def test_unsupported_chunk_size(chunk_size):
    with pytest.raises(
        ValueError, match=rf"chunk_size={chunk_size} must be one of \(16, 32, 64, 128\)"
    ):
        call(batched_inputs(), chunk_size=chunk_size)
    q, k, v, la, b = random_inputs(0, 8, 4, 4)
    with pytest.raises(ValueError, match="chunk_size"):
        gdn_jax.gated_delta_rule_chunked(q, k, v, la, b, chunk_size=chunk_size)


def test_chunk_size_must_be_an_int():
    q, k, v, la, b = random_inputs(0, 8, 4, 4)
    with pytest.raises(ValueError, match=r"chunk_size=64.0 must be one of"):
        gdn_jax.gated_delta_rule_chunked(q, k, v, la, b, chunk_size=64.0)
    with pytest.raises(ValueError, match=r"GatedDeltaNet: chunk_size=64.0 must be one of"):
        GatedDeltaNet(16, 2, 8, chunk_size=64.0, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan")])
def test_scale_must_be_a_finite_positive_number(scale):
    q, k, v, la, b = random_inputs(0, 8, 4, 4)
    message = r"scale=.* must be a finite number > 0"
    for fn in (gdn_jax.gated_delta_rule_chunked, gdn_jax.gated_delta_rule_recurrent):
        with pytest.raises(ValueError, match=message):
            fn(q, k, v, la, b, scale=scale)
    with pytest.raises(ValueError, match=message):
        gdn_jax.gated_delta_rule(
            q[None, :, None],
            k[None, :, None],
            v[None, :, None],
            la[None, :, None],
            b[None, :, None],
            scale=scale,
        )


def test_python_lists_are_named_not_attribute_errors():
    """Lists of inputs are refused; a list of offsets is taken as an array (above)."""
    q, k, v, la, b = random_inputs(0, 8, 4, 4)
    with pytest.raises(ValueError, match=r"gated_delta_rule_chunked: q must be an array, got list"):
        gdn_jax.gated_delta_rule_chunked(np.asarray(q).tolist(), k, v, la, b)


def test_unknown_impl():
    message = r"impl='triton' must be one of \('auto', 'chunked', 'recurrent', 'mosaic_gpu'\)"
    with pytest.raises(ValueError, match=message):
        call(batched_inputs(), impl="triton")


def test_unknown_schedule():
    message = r"schedule='fused' must be one of \('auto', 'hoisted', 'associative', 'in_scan'\)"
    with pytest.raises(ValueError, match=message):
        call(batched_inputs(), schedule="fused")
    q, k, v, la, b = random_inputs(0, 8, 4, 4)
    with pytest.raises(ValueError, match=message):
        gdn_jax.gated_delta_rule_chunked(q, k, v, la, b, schedule="fused")


def test_chunk_size_and_schedule_are_checked_whatever_the_impl():
    """With impl="recurrent" they went unchecked: a typo that waited for the impl to change."""
    for options, message in (
        (dict(schedule="bogus"), r"^gated_delta_rule: schedule='bogus' must be one of"),
        (dict(chunk_size=7), r"^gated_delta_rule: chunk_size=7 must be one of"),
    ):
        with pytest.raises(ValueError, match=message):
            call(batched_inputs(), impl="recurrent", **options)


def test_a_positive_log_alpha_is_named_where_its_values_are_known():
    """At +2 every output was NaN without a word; under jax.jit the values are not known,
    and the docstring says so."""
    args = batched_inputs()
    args[3] = np.asarray(args[3]).copy()
    args[3][0, 5, 1] = 2.0
    for impl in ("recurrent", "chunked"):
        with pytest.raises(
            ValueError,
            match=r"^gated_delta_rule: log_alpha must be <= 0 \(decays in log space\), got 2 "
            r"at index \(0, 5, 1\) \(largest 2, shape \(1, 8, 2\)\)$",
        ):
            call(args, impl=impl)
    q, k, v, la, b = random_inputs(0, 8, 4, 4)
    with pytest.raises(ValueError, match=r"^gated_delta_step: log_alpha must be <= 0"):
        gdn_jax.gated_delta_step(np.zeros((4, 4), np.float32), q[0], k[0], v[0], 0.5, b[0])
    assert "A value above 0 is refused where it is concrete" in " ".join(
        gdn_jax.gated_delta_rule.__doc__.split()
    )


def test_integer_inputs():
    args = batched_inputs()
    args[0] = jnp.zeros((1, 8, 2, 4), jnp.int32)
    with pytest.raises(ValueError, match="q must be a floating array, got dtype int32"):
        call(args)
    q, k, v, la, b = random_inputs(0, 8, 4, 4)
    with pytest.raises(ValueError, match="beta must be a floating array"):
        gdn_jax.gated_delta_rule_recurrent(q, k, v, la, jnp.ones(8, jnp.int32))


def test_float64_without_64_bit_mode_is_refused_naming_the_array():
    """Unchecked, JAX computed in float32 and warned twice from the op's internals."""
    args = [np.asarray(x) for x in batched_inputs()]
    wide = [x.astype(np.float64) for x in args]
    fix = (
        r"needs JAX's 64-bit mode, which is off \(it would compute in float32\): set "
        r"JAX_ENABLE_X64=1, or call jax.config.update\('jax_enable_x64', True\) before "
        r"anything else, or cast"
    )
    state = np.zeros((1, 2, 3, 4), np.float64)
    q, k, v, la, b = (x[0, :, 0] for x in wide)
    with jax.enable_x64(False):
        with pytest.raises(ValueError, match=rf"gated_delta_rule: q of dtype float64 {fix} q to"):
            call(wide)
        with pytest.raises(
            ValueError, match=rf"gated_delta_rule: initial_state of dtype float64 {fix} initial"
        ):
            call(args, initial_state=state)
        with pytest.raises(ValueError, match=r"gated_delta_rule_recurrent: q of dtype float64"):
            gdn_jax.gated_delta_rule_recurrent(q, k, v, la, b)
        with pytest.raises(ValueError, match=rf"gated_delta_step: state of dtype float64 {fix}"):
            gdn_jax.gated_delta_step(state[0, 0], q[0], k[0], v[0], la[0], b[0])


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("no", r"use_qk_l2norm='no' must be a Python bool \(True or False\)"),
        (1, r"use_qk_l2norm=1 must be a Python bool \(True or False\)"),
        (
            np.ones((), bool),
            r"use_qk_l2norm must be a Python bool, known while tracing, got an array of shape "
            r"\(\) and dtype bool \(a jit argument is one unless static\): make it static "
            r"\(static_argnames\) or pass bool\(use_qk_l2norm\) outside jit",
        ),
    ],
)
def test_use_qk_l2norm_must_be_a_python_bool(flag, message):
    """Unchecked, "no" was taken as True and a flag traced under jit was JAX's raw
    TracerBoolConversionError."""
    with pytest.raises(ValueError, match=rf"gated_delta_rule: {message}"):
        call(batched_inputs(), use_qk_l2norm=flag)
    if isinstance(flag, np.ndarray):
        traced = jax.jit(lambda flag: call(batched_inputs(), use_qk_l2norm=flag))
        with pytest.raises(ValueError, match=rf"gated_delta_rule: {message}"):
            traced.lower(True)


def test_mixed_qkv_dtypes():
    args = batched_inputs()
    args[2] = args[2].astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="q, k, v must share one dtype"):
        call(args)


def test_single_head_shapes():
    q, k, v, la, b = random_inputs(0, 8, 4, 3)
    with pytest.raises(
        ValueError,
        match=r"gated_delta_rule_chunked: k must have shape \[T, K\] like q = \(8, 4\), got \(8, 5\)",
    ):
        gdn_jax.gated_delta_rule_chunked(q, jnp.zeros((8, 5), jnp.float32), v, la, b)
    with pytest.raises(
        ValueError,
        match=r"gated_delta_rule_recurrent: initial_state must have shape \[V, K\] = \(3, 4\), got \(4, 3\)",
    ):
        gdn_jax.gated_delta_rule_recurrent(
            q, k, v, la, b, initial_state=jnp.zeros((4, 3), jnp.float32)
        )
    with pytest.raises(ValueError, match=r"log_alpha must have shape \[T\] = \(8,\), got \(8, 1\)"):
        gdn_jax.gated_delta_rule_recurrent(q, k, v, la[:, None], b)


def test_step_shapes():
    state = jnp.zeros((3, 4))
    q, k, v = jnp.zeros(4), jnp.zeros(4), jnp.zeros(3)
    with pytest.raises(
        ValueError, match=r"state must have shape \[V, K\] = \(3, 4\), got \(4, 3\)"
    ):
        gdn_jax.gated_delta_step(state.T, q, k, v, jnp.zeros(()), jnp.zeros(()))
    with pytest.raises(ValueError, match=r"beta must have shape a scalar = \(\), got \(1,\)"):
        gdn_jax.gated_delta_step(state, q, k, v, jnp.zeros(()), jnp.zeros(1))


def test_errors_are_raised_while_tracing_under_jit():
    args = batched_inputs(heads=2, v_heads=3)
    with pytest.raises(ValueError, match="multiple of query/key heads"):
        jax.jit(gdn_jax.gated_delta_rule).lower(*args)


@pytest.mark.parametrize(("key_dim", "value_dim"), [(0, 3), (4, 0)])
def test_empty_feature_dims_are_shape_errors_in_every_op(key_dim, value_dim):
    """Unchecked, K = 0 is a ZeroDivisionError from the default scale ``K ** -0.5``."""
    name, layout = ("q", "K") if key_dim == 0 else ("v", "V")
    message = rf"{name} must be .* with {layout} >= 1, got shape"
    q, v, gates = jnp.zeros((8, key_dim)), jnp.zeros((8, value_dim)), jnp.zeros(8)
    for fn in (gdn_jax.gated_delta_rule_chunked, gdn_jax.gated_delta_rule_recurrent):
        with pytest.raises(ValueError, match=message):
            fn(q, q, v, gates, gates)
    batched = [x[None, :, None] for x in (q, q, v, gates, gates)]
    with pytest.raises(ValueError, match=rf"gated_delta_rule: {message}"):
        call(batched)
    with pytest.raises(ValueError, match=rf"gated_delta_step: {message}"):
        gdn_jax.gated_delta_step(jnp.zeros((value_dim, key_dim)), q[0], q[0], v[0], 0.0, 1.0)


def test_step_takes_python_numbers_as_gates():
    """Unchecked, Python ints raise an AttributeError while the error message is built."""
    state = jnp.asarray(np.random.default_rng(0).normal(size=(3, 4)), jnp.float32)
    q, k, v = jnp.ones(4, jnp.float32), jnp.full(4, 0.5, jnp.float32), jnp.ones(3, jnp.float32)
    expected = gdn_jax.gated_delta_step(
        state, q, k, v, jnp.zeros((), jnp.float32), jnp.ones((), jnp.float32)
    )
    for log_alpha, beta in ((0, 1), (0.0, 1.0)):
        new_state, y = gdn_jax.gated_delta_step(state, q, k, v, log_alpha, beta)
        assert new_state.dtype == jnp.float32 and y.dtype == jnp.float32
        assert_close(new_state, expected[0], jnp.float32)
        assert_close(y, expected[1], jnp.float32)
    with pytest.raises(ValueError, match="gated_delta_step: beta must be a floating array"):
        gdn_jax.gated_delta_step(state, q, k, v, 0, True)


X, X_INT = np.ones((3, 4), np.float32), np.ones((3, 4), np.int32)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        # 0 was a ZeroDivisionError and -4 a complex scale.
        (lambda: gdn_jax.default_scale(0), r"key_dim=0 must be a positive integer$"),
        (lambda: gdn_jax.default_scale(-4), r"key_dim=-4 must be a positive integer$"),
        (lambda: gdn_jax.default_scale(True), r"key_dim=True must be a positive integer$"),
        (lambda: gdn_jax.default_scale("4"), r"key_dim='4' must be a positive integer$"),
        # eps=0 made a zero vector NaN.
        (lambda: gdn_jax.l2_normalize(X, eps=0), r"eps=0 must be a finite number > 0$"),
        (lambda: gdn_jax.l2_normalize(X, eps=-1e-6), r"eps=-1e-06 must be a finite number > 0$"),
        (lambda: gdn_jax.l2_normalize([1.0, 2.0]), r"x must be an array, got list$"),
        (lambda: gdn_jax.l2_normalize(X_INT), r"x must be a floating array, got dtype int32$"),
        # Outside shard_map: JAX's NameError "unbound axis name: seq".
        (lambda: gdn_jax.halo_from_previous(X, 1, "seq"),
         r"axis_name='seq' is not an axis of an enclosing jax.shard_map"),
    ],
)  # fmt: skip
def test_the_public_helpers_name_a_bad_argument(call, message):
    with pytest.raises(ValueError, match=r"^(default_scale|l2_normalize|halo_from_previous): "):
        call()
    with pytest.raises(ValueError, match=message):
        call()
