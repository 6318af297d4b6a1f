"""What the layers check of what they are built and called with (gdn_jax/layers/input_checks.py
and the constructors): hidden states of the wrong width or rank, padding masks, decoding caches
that do not fit the layer or overflow, constructor argument types and dtypes, and arguments a
layer would ignore. Each refusal is a ValueError naming the argument and its shape or value."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.small_model import HYBRID, tokens

from gdn_jax import (
    GatedDeltaNet,
    KimiDeltaAttention,
    LanguageModel,
    LinearAttention,
    ModelConfig,
    SoftmaxAttention,
)
from gdn_jax.layers import (
    CHANNEL_DECAY,
    HEAD_DECAY,
    DeltaNet,
    GatedDeltaNet2,
    GatedDeltaProduct,
    GateInit,
    RecurrentMixer,
    SimpleGatedLinearAttention,
    SwiGLU,
)
from gdn_jax.layers.params import gate_law


@pytest.fixture(scope="module")
def layers():
    rngs = nnx.Rngs(0)
    return GatedDeltaNet(16, 2, 8, chunk_size=16, rngs=rngs), SoftmaxAttention(16, 2, 8, rngs=rngs)


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


def test_integer_layer_inputs_are_refused(layers):
    """Unchecked, the projections took integer activations as they were."""
    for layer in layers:
        with pytest.raises(
            ValueError,
            match=rf"{type(layer).__name__}: x must be a floating array, got dtype int32",
        ):
            layer(jnp.zeros((2, 6, 16), jnp.int32))


@pytest.mark.parametrize(
    ("batch", "cu", "message"),
    [
        (
            2,
            [0, 2, 6],
            r"cu_seqlens packs sequences along T and needs B == 1, got x.shape=\(2, 6, 16\)",
        ),
        (1, [0, 2, 5], r"cu_seqlens must rise from 0 to T=6 without decreasing, got \[0, 2, 5\]"),
        (1, [0.0, 6.0], r"cu_seqlens must be integer, got dtype float"),
        (1, jnp.asarray([0.0, 6.0]), r"cu_seqlens must be integer, got dtype float"),
    ],
)
def test_packed_offsets_are_checked_in_the_layers_view(layers, batch, cu, message):
    """Unchecked by the layer, a list was an AttributeError from the convolution's packed
    layout, and the rest named the layer's op (``gated_delta_product``) and the heads it made
    of x (``q.shape=(2, 6, 2, 8)``), or went through (attention with B == 2)."""
    product = GatedDeltaProduct(16, 2, 8, chunk_size=16, rngs=nnx.Rngs(0))
    for layer in (*layers, product):
        with pytest.raises(ValueError, match=rf"{type(layer).__name__}: {message}"):
            layer(jnp.zeros((batch, 6, 16)), cu_seqlens=cu)


def test_packed_offsets_as_a_list_equal_the_array(layers):
    @nnx.jit
    def both(layer, x):
        return layer(x, cu_seqlens=jnp.asarray([0, 2, 6], jnp.int32)), layer(
            x, cu_seqlens=[0, 2, 6]
        )

    x = jax.random.normal(jax.random.key(0), (1, 6, 16))
    for layer in layers:
        as_array, as_list = both(layer, x)
        np.testing.assert_array_equal(as_list, as_array)


def test_prefill_takes_left_padding_only(layers):
    """A row padded on the right would decode on from a pad: unchecked, the next token's
    output was off by more than its own size. ``LanguageModel.prefill`` and ``generate``
    check the same, with the same helper."""
    x, right = jnp.zeros((2, 6, 16)), jnp.asarray([[1, 1, 1, 1, 0, 0], [1] * 6], jnp.int32)
    message = (
        r"mask row 0 must be left padding \(zeros, then ones, at least one one\), got "
        r"\[1, 1, 1, 1, 0, 0\]"
    )
    for layer in layers:
        with pytest.raises(ValueError, match=rf"{type(layer).__name__}: {message}"):
            layer.prefill(x, mask=right)
        with pytest.raises(ValueError, match=rf"{type(layer).__name__}: {message}"):
            layer.prefill(x, layer.init_cache(2, 8), mask=right)


def test_caches_that_do_not_fit_the_layer_are_named(layers, model):
    """Unchecked, these end in vmap, concatenate, AttributeError or zip errors, or (a cache
    without convolution histories) in no error at all."""
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
    ("cls", "option"),
    [
        (GatedDeltaNet, "use_gate"),
        (GatedDeltaNet, "use_short_conv"),
        (GatedDeltaNet, "conv_bias"),
        (GatedDeltaNet, "allow_neg_eigval"),
        (LinearAttention, "allow_neg_eigval"),  # no delta correction: the type is named first
        (KimiDeltaAttention, "low_rank_gates"),
        (KimiDeltaAttention, "output_gate_bias"),
        (GatedDeltaProduct, "use_forget_gate"),
        (SoftmaxAttention, "use_short_conv"),
    ],
)
def test_layer_switches_are_bools(cls, option):
    # "no" was taken by its truthiness: a layer with the part its user switched off.
    with pytest.raises(ValueError, match=rf"{cls.__name__}: {option}='no' must be a Python bool"):
        cls(16, 2, 8, **{option: "no"}, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, "float8"])
def test_layers_refuse_dtypes_that_are_not_floating(dtype):
    shown = dtype.__name__ if isinstance(dtype, type) else repr(dtype)
    for cls in (GatedDeltaNet, KimiDeltaAttention, SoftmaxAttention):
        for name in ("dtype", "param_dtype"):
            with pytest.raises(
                ValueError, match=rf"{cls.__name__}: {name}={shown} must be a floating dtype"
            ):
                cls(16, 2, 8, **{name: dtype}, rngs=nnx.Rngs(0))


def test_float64_without_64_bit_mode_is_refused():
    with jax.enable_x64(False):
        with pytest.raises(ValueError, match=r"GatedDeltaNet: dtype=float64 needs JAX's 64-bit"):
            GatedDeltaNet(16, 2, 8, dtype=jnp.float64, rngs=nnx.Rngs(0))
        with pytest.raises(
            ValueError, match=r"ModelConfig.param_dtype='float64': needs JAX's 64-bit mode"
        ):
            ModelConfig(param_dtype="float64").validate()
    # Inputs as the dtypes: a float64 NumPy x was computed in float32 without a word.
    x = np.zeros((1, 4, 16), np.float64)
    layer = GatedDeltaNet(16, 2, 8, chunk_size=16, rngs=nnx.Rngs(0))
    with jax.enable_x64(False):
        with pytest.raises(
            ValueError,
            match=r"GatedDeltaNet: x of dtype float64 needs JAX's 64-bit mode, which is off "
            r"\(it would compute in float32\): .*, or cast x to float32",
        ):
            layer(x)
    assert ModelConfig(param_dtype="float64").validate()  # the suite runs with it on


def test_no_layer_accepts_an_argument_it_would_ignore():
    with pytest.raises(ValueError, match=r"LinearAttention: allow_neg_eigval=True widens beta"):
        LinearAttention(16, 2, 8, allow_neg_eigval=True, rngs=nnx.Rngs(0))
    # The model-wide flag reaches only the mixers with a delta correction.
    config = ModelConfig(vocab_size=50, d_model=16, mixers=("gdn", "linear"), allow_neg_eigval=True)
    model = LanguageModel(config, rngs=nnx.Rngs(0))
    assert [block.mixer.allow_neg_eigval for block in model.blocks] == [True, False]


def test_baselines_are_siblings_not_kinds_of_gated_deltanet():
    for cls in (DeltaNet, SimpleGatedLinearAttention, LinearAttention):
        layer = cls(16, 2, 8, rngs=nnx.Rngs(0))
        assert isinstance(layer, RecurrentMixer) and not isinstance(layer, GatedDeltaNet)
    with pytest.raises(ValueError, match=r"RecurrentMixer: build GatedDeltaNet, DeltaNet"):
        RecurrentMixer(16, 2, 8, rngs=nnx.Rngs(0))


ALL_LAYERS = (
    GatedDeltaNet, KimiDeltaAttention, GatedDeltaNet2, GatedDeltaProduct, DeltaNet,
    SimpleGatedLinearAttention, LinearAttention, SoftmaxAttention,
)  # fmt: skip


@pytest.mark.parametrize("cls", ALL_LAYERS, ids=lambda cls: cls.__name__)
def test_every_layer_names_bad_random_streams_and_initialisers(cls):
    """An int or a bare key as ``rngs`` reached Flax as an AttributeError ('int' object has
    no attribute 'params'), an initialiser's name as a TypeError from Flax."""
    name = cls.__name__
    for rngs, shown in ((0, "0"), (np.zeros(2, np.uint32), r"array\(\[0, 0\]")):
        with pytest.raises(TypeError, match=rf"^{name}: rngs={shown}.* must be an nnx.Rngs"):
            cls(16, 2, 8, rngs=rngs)
    with pytest.raises(TypeError, match=rf"^{name}: kernel_init='normal' must be an initialiser"):
        cls(16, 2, 8, kernel_init="normal", rngs=nnx.Rngs(0))


def test_swiglu_names_bad_random_streams():
    with pytest.raises(TypeError, match=r"^SwiGLU: rngs=0 must be an nnx.Rngs"):
        SwiGLU(16, 32, dtype=jnp.float32, param_dtype=jnp.float32, kernel_init=None, rngs=0)


@pytest.mark.parametrize(
    "cls", [GatedDeltaNet, KimiDeltaAttention, GatedDeltaNet2, GatedDeltaProduct]
)
def test_a_gate_law_is_a_gate_init_or_a_mapping_of_its_fields(cls):
    """ModelConfig took a mapping of GateInit's fields; the layers raised AttributeError
    ('dict' object has no attribute 'over')."""
    name, default = (
        cls.__name__,
        CHANNEL_DECAY if cls in (KimiDeltaAttention, GatedDeltaNet2) else HEAD_DECAY,
    )
    assert gate_law(name, {"a_max": 4.0}, default) == gate_law(name, GateInit(a_max=4.0), default)
    nnx.eval_shape(lambda: cls(16, 2, 8, gate_init={"a_max": 4.0}, rngs=nnx.Rngs(0)))
    with pytest.raises(
        TypeError, match=rf"^{name}: gate_init='fast' must be a GateInit, a mapping"
    ):
        cls(16, 2, 8, gate_init="fast", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=rf"^{name}: gate_init has unknown fields \['a_mn'\]"):
        cls(16, 2, 8, gate_init={"a_mn": 1.0}, rngs=nnx.Rngs(0))
