"""Bad inputs to the layers, models and ops that used to give wrong results or raw errors:
each is now a ValueError naming the argument and its shape or value."""

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.cpu_schedule import SCHEDULE
from support.reference import random_inputs
from support.tolerance import assert_close

import gdn_jax
from gdn_jax import GatedDeltaNet, LanguageModel, ModelConfig, SoftmaxAttention, generate
from gdn_jax.layers import input_checks

HYBRID = ModelConfig(
    vocab_size=50, d_model=16, mixers=("gdn", "attention"), chunk_size=16, schedule=SCHEDULE
)


@pytest.fixture(scope="module")
def model():
    return LanguageModel(HYBRID, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def layers():
    rngs = nnx.Rngs(0)
    return GatedDeltaNet(16, 2, 8, chunk_size=16, rngs=rngs), SoftmaxAttention(16, 2, 8, rngs=rngs)


def tokens(batch, seq_len):
    return jnp.asarray(np.random.default_rng(0).integers(0, 50, (batch, seq_len)), jnp.int32)


def test_top_level_exports():
    assert gdn_jax.GatedDeltaNet is GatedDeltaNet and gdn_jax.LanguageModel is LanguageModel


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -1.0])
def test_generate_refuses_a_temperature_that_is_not_a_finite_positive_number(model, temperature):
    with pytest.raises(ValueError, match=r"generate: temperature=(nan|inf|-1.0) must be"):
        generate(model, tokens(1, 3), max_new_tokens=2, temperature=temperature)


@pytest.mark.parametrize("prompt", [jnp.zeros((2, 0), jnp.int32), jnp.zeros((3,), jnp.int32)])
def test_generate_refuses_an_empty_or_one_dimensional_prompt(model, prompt):
    with pytest.raises(ValueError, match=r"generate: prompt must be integer tokens \[B, T\]"):
        generate(model, prompt, max_new_tokens=2)


def test_an_attention_cache_never_overflows_in_eager_decoding(layers):
    # Attention alone, since the overflow is its cache's, and the prompt jitted: eagerly, each
    # primitive of a layer is a program of its own to compile (228 with the hybrid). The
    # steps run eagerly, where the cache's length is known.
    model = LanguageModel(dataclasses.replace(HYBRID, mixers=("attention",)), rngs=nnx.Rngs(0))
    cache = model.init_cache(1, 4)
    _, cache = nnx.jit(lambda model, x, cache: model.prefill(x, cache))(model, tokens(1, 3), cache)
    _, cache = model.step(tokens(1, 1), cache)  # the 4th slot: fits
    with pytest.raises(ValueError, match=r"1 more token\(s\) do not fit a cache of max_len=4"):
        model.step(tokens(1, 1), cache)
    attention = layers[1]
    with pytest.raises(ValueError, match=r"5 more token\(s\) do not fit a cache of max_len=3"):
        attention.prefill(jnp.zeros((1, 5, 16)), attention.init_cache(1, 3))


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        (jnp.ones((6,)), r"mask must have shape \[B, T\] = \(2, 6\), got \(6,\)"),
        (jnp.ones((1, 6)), r"mask must have shape \[B, T\] = \(2, 6\), got \(1, 6\)"),
        (jnp.ones((2, 5)), r"mask must have shape \[B, T\] = \(2, 6\), got \(2, 5\)"),
        (jnp.full((2, 6), 2.0), r"mask must hold only 0 and 1, got values \[2.0\]"),
    ],
)
def test_masks_are_checked_by_every_mixer(layers, model, mask, message):
    x = jnp.zeros((2, 6, 16))
    for layer in layers:
        with pytest.raises(ValueError, match=message):
            layer(x, mask=mask)
    with pytest.raises(ValueError, match=message):
        model(tokens(2, 6), mask=mask)


@pytest.mark.parametrize("x", [jnp.zeros((2, 6, 12)), jnp.zeros((6, 16)), jnp.zeros((2, 0, 16))])
def test_layer_inputs_of_the_wrong_width_or_rank(layers, x):
    for layer in layers:
        with pytest.raises(ValueError, match=r"x must have shape \[B, T, hidden_size\] with "):
            layer(x)


def test_model_tokens_of_the_wrong_rank_or_dtype(model):
    for bad in (tokens(2, 6)[0], tokens(2, 6).astype(jnp.float32)):
        with pytest.raises(ValueError, match=r"LanguageModel: tokens must be integer ids \[B, T\]"):
            model(bad)


def test_array_scalars_are_refused_as_not_a_python_number(model):
    """A 0-d array used to get "must be a finite number > 0", which it may well be."""
    q, k, v, la, b = random_inputs(0, 8, 4, 4)
    message = r"gated_delta_rule_chunked: scale must be a Python number, got an array of shape"
    for scale in (jnp.asarray(0.5), np.asarray(0.5)):
        with pytest.raises(ValueError, match=message):
            gdn_jax.gated_delta_rule_chunked(q, k, v, la, b, scale=scale)
    for temperature in (jnp.asarray(0.7), jnp.asarray(0.0)):
        with pytest.raises(ValueError, match=r"generate: temperature must be a Python number"):
            generate(model, tokens(1, 3), max_new_tokens=2, temperature=temperature)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(expand_v="2"), r"GatedDeltaNet: expand_v='2' must be a finite number > 0"),
        (dict(num_heads=2.5), r"GatedDeltaNet: num_heads=2.5 must be a positive integer"),
        (dict(num_heads=True), r"GatedDeltaNet: num_heads=True must be a positive integer"),
    ],
)
def test_layer_constructor_types(kwargs, message):
    args = dict(hidden_size=16, num_heads=2, head_dim=8) | kwargs
    with pytest.raises(ValueError, match=message):
        GatedDeltaNet(**args, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_heads", True, "must be a positive integer"),
        ("head_dim", 8.0, "must be a positive integer or None"),
        ("expand_v", "2", "must be a number"),
        ("use_gate", 1, "must be true or false"),
    ],
)
def test_model_config_field_types(field, value, message):
    with pytest.raises(ValueError, match=rf"ModelConfig.{field}={value!r}: {message}"):
        ModelConfig(**{field: value}).validate()


def test_no_layer_accepts_an_argument_it_would_ignore():
    from gdn_jax import LinearAttention

    with pytest.raises(ValueError, match=r"LinearAttention: allow_neg_eigval=True widens beta"):
        LinearAttention(16, 2, 8, allow_neg_eigval=True, rngs=nnx.Rngs(0))
    # The model-wide flag reaches only the mixers with a delta correction.
    config = ModelConfig(vocab_size=50, d_model=16, mixers=("gdn", "linear"), allow_neg_eigval=True)
    model = LanguageModel(config, rngs=nnx.Rngs(0))
    assert [block.mixer.allow_neg_eigval for block in model.blocks] == [True, False]


def test_baselines_are_siblings_not_kinds_of_gated_deltanet():
    from gdn_jax.layers import DeltaNet, GatedLinearAttention, LinearAttention, RecurrentMixer

    for cls in (DeltaNet, GatedLinearAttention, LinearAttention):
        layer = cls(16, 2, 8, rngs=nnx.Rngs(0))
        assert isinstance(layer, RecurrentMixer) and not isinstance(layer, GatedDeltaNet)
    with pytest.raises(ValueError, match=r"RecurrentMixer: build GatedDeltaNet, DeltaNet"):
        RecurrentMixer(16, 2, 8, rngs=nnx.Rngs(0))


def test_caches_that_do_not_fit_the_layer_are_named(layers, model):
    """These used to give vmap, concatenate, AttributeError or zip errors, or (a cache
    without convolution histories) no error at all."""
    gdn, attention = layers
    plain = GatedDeltaNet(16, 2, 8, use_short_conv=False, chunk_size=16, rngs=nnx.Rngs(0))
    narrow = GatedDeltaNet(16, 2, 4, use_short_conv=False, chunk_size=16, rngs=nnx.Rngs(0))
    conv_shapes = r"\(\(2, 3, 16\), \(2, 3, 16\), \(2, 3, 32\)\)"
    cases = [
        (gdn, gdn.init_cache(3), rf"cache.conv must have shape {conv_shapes} .*, got \(\(3, 3"),
        (gdn, plain.init_cache(2), rf"cache.conv must have shape {conv_shapes} .*, got None"),
        (plain, gdn.init_cache(2), r"cache.conv must have shape None .*, got \(\(2, 3, 16\)"),
        (gdn, gdn.init_cache(2)._replace(conv=gdn.init_cache(2).conv[:2]), "cache.conv must"),
        (
            plain,
            narrow.init_cache(2),
            r"cache.state must .* \(2, 2, 16, 8\) .*, got \(2, 2, 8, 4\)",
        ),
        (gdn, attention.init_cache(2, 4), "cache must be a RecurrentCache .*, got KVCache"),
        (attention, gdn.init_cache(2), "cache must be a KVCache .*, got RecurrentCache"),
        (attention, attention.init_cache(3, 4), r"cache.k must .* \(2, 4, 2, 8\) .*, got \(3, 4"),
    ]
    x = jnp.zeros((2, 1, 16))
    for layer, cache, message in cases:
        name = type(layer).__name__
        for call in (layer.step, layer.prefill):
            with pytest.raises(ValueError, match=f"{name}: {message}"):
                call(x, cache)
    short = model.init_cache(1, 4)[:1]
    message = r"LanguageModel: cache must be a tuple of 2 layer caches .*, got tuple of length 1"
    for call in (model.step, model.prefill):
        with pytest.raises(ValueError, match=message):
            call(tokens(1, 1), short)


def test_token_ids_outside_the_vocabulary(model):
    """They used to give NaN logits (50) or read another token's row (-5 read token 45)."""
    for bad in (50, -5):
        ids = tokens(1, 4).at[0, 2].set(bad)
        message = rf"LanguageModel: tokens must be ids in \[0, vocab_size=50\), got \[{bad}\]"
        with pytest.raises(ValueError, match=message):
            model(ids)
        with pytest.raises(ValueError, match=message):
            model.prefill(ids, model.init_cache(1, 4))
        with pytest.raises(ValueError, match=r"generate: prompt must be ids in \[0, vocab_size"):
            generate(model, ids, max_new_tokens=1)
    # Under jit they cannot be checked, and are clipped, the documented way: -5 reads token
    # 0 and 50 token 49. Padding may hold any id: it is neither checked nor read.
    forward = nnx.jit(lambda model, ids, mask: model(ids, mask=mask))
    mask = jnp.ones((1, 5), jnp.int32).at[0, 0].set(0)
    clipped = jnp.asarray([[0, 0, 49, 7, 3]], jnp.int32)
    outside = jnp.asarray([[-7, -5, 50, 7, 3]], jnp.int32)
    expected = forward(model, clipped, mask)
    assert_close(forward(model, outside, mask), expected, jnp.float32)
    input_checks.check_token_ids("LanguageModel", "tokens", outside.at[0, 1:3].set(0), 50, mask)


def test_generate_checks_mask_values_and_the_key(model):
    """A mask of 2s used to pass (its values are traced in the jitted decoder), and an int
    key gave JAX's own TypeError."""
    with pytest.raises(ValueError, match=r"generate: mask must hold only 0 and 1, got values \[2"):
        generate(model, tokens(1, 3), mask=jnp.full((1, 3), 2), max_new_tokens=1)
    for key in (0, jnp.zeros(3, jnp.uint32)):
        with pytest.raises(ValueError, match=r"generate: key must be a PRNG key from jax.random"):
            generate(model, tokens(1, 3), max_new_tokens=1, temperature=1.0, key=key)


@pytest.mark.parametrize(
    ("row", "mask"),
    [
        (1, [[0, 1, 1], [1, 1, 0]]),  # right padding: it would decode on from the pad
        (0, [[1, 0, 1], [1, 1, 1]]),  # a hole
        (1, [[1, 1, 1], [0, 0, 0]]),  # no token at all
    ],
)
def test_generate_and_prefill_refuse_a_mask_that_is_not_left_padding(model, row, mask):
    mask = jnp.asarray(mask, jnp.int32)
    shown = re.escape(str(np.asarray(mask[row]).tolist()))
    message = (
        rf"mask row {row} must be left padding \(zeros, then ones, at least one one\), got {shown}"
    )
    with pytest.raises(ValueError, match=rf"generate: {message}"):
        generate(model, tokens(2, 3), mask=mask, max_new_tokens=2)
    with pytest.raises(ValueError, match=rf"LanguageModel: {message}"):
        model.prefill(tokens(2, 3), model.init_cache(2, 5), mask=mask)


def test_numpy_numbers_are_taken_wherever_python_numbers_are(model):
    from gdn_jax import KimiDeltaAttention

    q, k, v, la, b = random_inputs(0, 20, 4, 4)
    y, _ = gdn_jax.gated_delta_rule_chunked(q, k, v, la, b, chunk_size=np.int64(16))
    expected, _ = gdn_jax.gated_delta_rule_chunked(q, k, v, la, b, chunk_size=16)
    assert_close(y, expected, jnp.float32)
    layer = GatedDeltaNet(16, 2, 8, chunk_size=np.int32(16), rngs=nnx.Rngs(0))
    assert type(layer.chunk_size) is int
    kda = KimiDeltaAttention(16, 2, 8, gate_lower_bound=np.float32(-5), rngs=nnx.Rngs(0))
    assert kda.gate_lower_bound == -5.0
    out = generate(model, tokens(1, 3), max_new_tokens=np.int64(2))
    assert out.shape == (1, 2)
    assert ModelConfig(d_model=np.int64(16), num_heads=np.int64(2)).validate().d_model == 16
    with pytest.raises(ValueError, match=r"chunk_size=np.True_ must be one of"):
        gdn_jax.gated_delta_rule_chunked(q, k, v, la, b, chunk_size=np.True_)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, "float8"])
def test_layers_refuse_dtypes_that_are_not_floating(dtype):
    from gdn_jax import KimiDeltaAttention

    shown = dtype.__name__ if isinstance(dtype, type) else repr(dtype)
    for cls in (GatedDeltaNet, KimiDeltaAttention, SoftmaxAttention):
        for name in ("dtype", "param_dtype"):
            with pytest.raises(
                ValueError, match=rf"{cls.__name__}: {name}={shown} must be a floating dtype"
            ):
                cls(16, 2, 8, **{name: dtype}, rngs=nnx.Rngs(0))


def test_float64_without_64_bit_mode_is_refused():
    import jax

    with jax.enable_x64(False):
        with pytest.raises(ValueError, match=r"GatedDeltaNet: dtype=float64 needs JAX's 64-bit"):
            GatedDeltaNet(16, 2, 8, dtype=jnp.float64, rngs=nnx.Rngs(0))
        with pytest.raises(
            ValueError, match=r"ModelConfig.param_dtype='float64': needs JAX's 64-bit mode"
        ):
            ModelConfig(param_dtype="float64").validate()
    assert ModelConfig(param_dtype="float64").validate()  # the suite runs with it on
