"""What LanguageModel, ModelConfig and generate check of what they are given: token ids of the
wrong rank or dtype or outside the vocabulary, empty or 1-d prompts, masks that are not left
padding or hold values other than 0 and 1, temperatures and PRNG keys, config field types, and
the NumPy numbers they take where Python numbers are. Each refusal is a ValueError naming the
argument and its value."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.reference import random_inputs
from support.small_model import tokens
from support.tolerance import assert_close

import gdn_jax
from gdn_jax import GatedDeltaNet, KimiDeltaAttention, LanguageModel, ModelConfig, generate
from gdn_jax.layers import GateInit, input_checks
from gdn_jax.models import build_mixer
from gdn_jax.models.lm import check_buildable


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -1.0])
def test_generate_refuses_a_temperature_that_is_not_a_finite_positive_number(model, temperature):
    with pytest.raises(ValueError, match=r"generate: temperature=(nan|inf|-1.0) must be"):
        generate(model, tokens(1, 3), max_new_tokens=2, temperature=temperature)


# The prompts' shapes: made at collection, each jnp.zeros would be a program to compile in
# every process that collects this module.
@pytest.mark.parametrize("prompt", [(2, 0), (3,)])
def test_generate_refuses_an_empty_or_one_dimensional_prompt(model, prompt):
    with pytest.raises(ValueError, match=r"generate: prompt must be integer tokens \[B, T\]"):
        generate(model, jnp.zeros(prompt, jnp.int32), max_new_tokens=2)


def test_model_tokens_of_the_wrong_rank_or_dtype(model):
    for bad in (tokens(2, 6)[0], tokens(2, 6).astype(jnp.float32)):
        with pytest.raises(ValueError, match=r"LanguageModel: tokens must be integer ids \[B, T\]"):
            model(bad)


def test_packed_offsets_are_checked_in_the_models_view(model):
    """They were checked by the first layer, which named its x [B, T, D], not the tokens."""
    with pytest.raises(
        ValueError,
        match=r"^LanguageModel: cu_seqlens packs sequences along T and needs B == 1, "
        r"got tokens.shape=\(2, 6\)$",
    ):
        model(tokens(2, 6), cu_seqlens=[0, 2, 6])
    with pytest.raises(ValueError, match=r"^LanguageModel: cu_seqlens must rise from 0 to T=6"):
        model(tokens(1, 6), cu_seqlens=[0, 2, 5])


def test_token_ids_outside_the_vocabulary(model):
    """Unchecked, they give NaN logits (50) or read another token's row (-5 reads token 45)."""
    for bad in (50, -5):
        ids = np.asarray(tokens(1, 4)).copy()
        ids[0, 2] = bad
        ids = jax.device_put(ids)  # a JAX array, as a user's; jnp's .at[].set() compiles
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
    mask = jax.device_put(np.asarray([[0, 1, 1, 1, 1]], np.int32))
    clipped = jax.device_put(np.asarray([[0, 0, 49, 7, 3]], np.int32))
    outside = jax.device_put(np.asarray([[-7, -5, 50, 7, 3]], np.int32))
    expected = forward(model, clipped, mask)
    assert_close(forward(model, outside, mask), expected, jnp.float32)
    inside = jax.device_put(np.asarray([[-7, 0, 0, 7, 3]], np.int32))
    input_checks.check_token_ids("LanguageModel", "tokens", inside, 50, mask)


def test_generate_checks_mask_values_and_the_key(model):
    """Unchecked, a mask of 2s passes (its values are traced in the jitted decoder), and an
    int key gives JAX's own TypeError."""
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


def test_array_scalars_are_refused_as_not_a_python_number(model):
    """Unchecked, a 0-d array is told "must be a finite number > 0", which it may well be."""
    q, k, v, la, b = random_inputs(0, 8, 4, 4)
    message = r"gated_delta_rule_chunked: scale must be a Python number, got an array of shape"
    for scale in (jnp.asarray(0.5), np.asarray(0.5)):
        with pytest.raises(ValueError, match=message):
            gdn_jax.gated_delta_rule_chunked(q, k, v, la, b, scale=scale)
    for temperature in (jnp.asarray(0.7), jnp.asarray(0.0)):
        with pytest.raises(ValueError, match=r"generate: temperature must be a Python number"):
            generate(model, tokens(1, 3), max_new_tokens=2, temperature=temperature)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_heads", True, "must be a positive integer"),
        ("head_dim", 8.0, "must be a positive integer or None"),
        ("expand_v", "2", "must be a number"),
        ("use_gate", 1, "must be true or false"),
        ("low_rank_gates", "no", "must be true or false"),
        ("mixer_init_std", -1.0, r"must be a finite positive number or None"),
        ("mixer_init_std", float("inf"), r"must be a finite positive number or None"),
        ("init_std", float("inf"), r"must be finite and positive"),
        ("init_std", float("nan"), r"must be finite and positive"),
        ("mixers", 3, r"needs a list of at least one layer, each one of \('gdn'"),
        ("mixers", "g", r"unknown mixer 'g'; allowed: \('gdn'"),
        ("head_gate_init", 1e-4, r"must be a GateInit or a mapping of its fields \['a_max'"),
        ("channel_gate_init", {"dtmin": 1e-4}, r"must be a GateInit or a mapping of its fields"),
    ],
)
def test_model_config_field_types(field, value, message):
    shown = re.escape(repr((value,) if field == "mixers" and isinstance(value, str) else value))
    with pytest.raises(ValueError, match=rf"ModelConfig.{field}={shown}: {message}"):
        ModelConfig(**{field: value}).validate()


def test_model_config_takes_one_mixer_name_and_a_gate_law_as_a_mapping():
    """As a YAML file and the CLI's --set read them: one name is a one-layer stack (it was
    read letter by letter: "unknown mixer 'g'"), a mapping of GateInit's fields is that law
    (it reached the layer raw: AttributeError: 'dict' object has no attribute 'over')."""
    config = ModelConfig(
        vocab_size=16, d_model=16, mixers="gdn", head_gate_init={"dt_min": 1e-4}
    ).validate()
    assert config.mixers == ("gdn",)
    assert config.head_gate_init == GateInit(dt_min=1e-4)
    assert ModelConfig(mixers=["gdn", "attention"]).mixers == ("gdn", "attention")
    hash(config)  # the models and compiled steps are cached on it
    check_buildable(config)


def test_numpy_numbers_are_taken_wherever_python_numbers_are(model):
    q, k, v, la, b = random_inputs(0, 20, 4, 4)

    # Both in one program: eagerly, each would compile its operations one by one.
    @jax.jit
    def outputs(q, k, v, la, b):
        y, _ = gdn_jax.gated_delta_rule_chunked(q, k, v, la, b, chunk_size=np.int64(16))
        expected, _ = gdn_jax.gated_delta_rule_chunked(q, k, v, la, b, chunk_size=16)
        return y, expected

    assert_close(*outputs(q, k, v, la, b), jnp.float32)
    # Only their settings are read: built abstractly, no initialiser is compiled.
    layer = nnx.eval_shape(
        lambda: GatedDeltaNet(16, 2, 8, chunk_size=np.int32(16), rngs=nnx.Rngs(0))
    )
    assert type(layer.chunk_size) is int
    kda = nnx.eval_shape(
        lambda: KimiDeltaAttention(16, 2, 8, gate_lower_bound=np.float32(-5), rngs=nnx.Rngs(0))
    )
    assert kda.gate_lower_bound == -5.0
    out = generate(model, tokens(1, 3), max_new_tokens=np.int64(2))
    assert out.shape == (1, 2)
    assert ModelConfig(d_model=np.int64(16), num_heads=np.int64(2)).validate().d_model == 16
    with pytest.raises(ValueError, match=r"chunk_size=np.True_ must be one of"):
        gdn_jax.gated_delta_rule_chunked(q, k, v, la, b, chunk_size=np.True_)


def test_the_model_generate_and_build_mixer_name_what_they_are_given(model):
    """Each was an AttributeError: ``LanguageModel(dict)`` ('dict' object has no attribute
    'validate'), ``generate(layer, ...)`` ('GatedDeltaNet' object has no attribute
    'config'), ``build_mixer({}, ...)``; a mixer name not in MIXERS was a KeyError."""
    config = ModelConfig(vocab_size=64, d_model=16, mixers=("gdn",))
    cases = [
        (lambda: LanguageModel({"vocab_size": 64}, rngs=nnx.Rngs(0)), TypeError,
         r"^LanguageModel: config must be a ModelConfig, got dict"),
        (lambda: LanguageModel(config, rngs=0), TypeError, r"^LanguageModel: rngs=0 must be"),
        (lambda: generate(model.blocks[0].mixer, tokens(1, 3), max_new_tokens=2), TypeError,
         r"^generate: model must be a LanguageModel, got GatedDeltaNet"),
        (lambda: build_mixer({}, "gdn", rngs=nnx.Rngs(0)), TypeError,
         r"^build_mixer: config must be a ModelConfig, got dict"),
        (lambda: build_mixer(config, "rnn", rngs=nnx.Rngs(0)), ValueError,
         r"^build_mixer: name='rnn' is not a mixer; allowed: \('gdn', "),
        (lambda: build_mixer(config, "gdn", rngs=3), TypeError, r"^build_mixer: rngs=3 must be"),
    ]  # fmt: skip
    for call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
