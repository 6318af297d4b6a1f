"""The GLA layer (flash-linear-attention's ``GatedLinearAttention``): its parameter count
against fla's layer definition, its wiring against a float64 NumPy reference, chunked ==
recurrent with gradients, bad arguments, and the old names (the scalar-gated layer's
constructor form, the mixer name ``gated_linear``) warning once and building
``SimpleGatedLinearAttention``. Padding, packing and decoding are test_layers.py's."""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.cpu_schedule import SCHEDULE
from support.layer_forms import (
    assert_layers_agree_with_gradients,
    param_value,
    parameter_count,
    sigmoid,
)
from support.reference import gla_reference
from support.tolerance import assert_close
from test_layers import HIDDEN, forward, inputs

import gdn_jax
from gdn_jax.layers import GatedLinearAttention, SimpleGatedLinearAttention
from gdn_jax.models import ModelConfig
from gdn_jax.ops import renamed


def fla_parameter_count(
    hidden_size=1024, expand_k=0.5, expand_v=1.0, num_heads=4, num_kv_heads=None,
    use_short_conv=False, conv_size=4, conv_bias=False, use_output_gate=True,
    elementwise_affine=True, gate_low_rank_dim=16, **_,
):  # fmt: skip
    """flash-linear-attention's ``GatedLinearAttention`` (fla/layers/gla.py) counted from its
    module definition, shape by shape."""
    groups = num_heads // (num_kv_heads or num_heads)
    key_dim, value_dim = int(hidden_size * expand_k), int(hidden_size * expand_v)
    k_per_group, v_per_group = key_dim // groups, value_dim // groups
    count = hidden_size * key_dim  # q_proj: Linear(hidden_size, key_dim), no bias
    count += hidden_size * k_per_group  # k_proj: Linear(hidden_size, key_dim_per_group)
    count += hidden_size * v_per_group  # v_proj: Linear(hidden_size, value_dim_per_group)
    count += hidden_size * value_dim if use_output_gate else 0  # g_proj, no bias
    if use_short_conv:  # ShortConvolution(d): depthwise Conv1d weight [d, 1, W], bias [d]
        count += (key_dim + k_per_group + v_per_group) * (conv_size + int(conv_bias))
    # gk_proj: Linear(hidden_size, r, bias=False), Linear(r, key_dim_per_group, bias=True)
    count += hidden_size * gate_low_rank_dim + gate_low_rank_dim * k_per_group + k_per_group
    count += value_dim * hidden_size  # o_proj: Linear(value_dim, hidden_size), no bias
    # g_norm_swish_gate (FusedRMSNormGated) or g_norm (RMSNorm): weight [head_v_dim]
    return count + (value_dim // num_heads if elementwise_affine else 0)


@pytest.mark.parametrize(
    "config",
    [
        dict(),  # fla's defaults: hidden_size 1024, 4 heads of 128 keys and 256 values
        dict(hidden_size=64, num_heads=4, num_kv_heads=2, use_short_conv=True),
        dict(hidden_size=48, expand_k=1.0, expand_v=2.0, num_heads=3, use_output_gate=False),
        dict(hidden_size=32, num_heads=2, use_short_conv=True, conv_size=3, conv_bias=True,
             elementwise_affine=False, gate_low_rank_dim=8, num_kv_heads=1),
    ],
)  # fmt: skip
def test_parameter_count_matches_flash_linear_attention(config):
    layer = nnx.eval_shape(lambda: GatedLinearAttention(**config, rngs=nnx.Rngs(0)))
    assert parameter_count(layer) == fla_parameter_count(**config)


def make(seed=0, **kw):
    """A small GLA layer with grouped key/value heads, whose zero- or one-initialised
    parameters (the decay's bias, the norm's weight) are drawn too, so that a dropped one
    shows."""
    options = dict(
        expand_k=0.5, expand_v=1.0, num_heads=2, num_kv_heads=1, use_short_conv=True,
        chunk_size=16, schedule=SCHEDULE,
    )  # fmt: skip
    layer = GatedLinearAttention(HIDDEN, rngs=nnx.Rngs(seed), **{**options, **kw})
    rng = np.random.default_rng(seed)
    bias = rng.standard_normal(layer.gk_b_proj.bias.shape)
    layer.gk_b_proj.bias[...] = jnp.asarray(bias, jnp.float32)
    if layer.o_norm.scale is not None:
        scale = rng.uniform(0.5, 1.5, layer.o_norm.scale.shape)
        layer.o_norm.scale[...] = jnp.asarray(scale, jnp.float32)
    return layer


def reference_layer(layer, x, feature_map):
    """The layer's forward for one sequence ``x [T, D]``, in float64 NumPy, from its
    parameters, as flash-linear-attention's layer computes it."""
    seq_len, x = x.shape[0], np.asarray(x, np.float64)
    heads, groups = layer.num_heads, layer.groups
    silu = lambda z: z * sigmoid(z)  # noqa: E731

    def conv(z, module):
        w = param_value(module.weight)
        padded = np.concatenate([np.zeros((w.shape[0] - 1, z.shape[1])), z])
        return silu(sum(w[i] * padded[i : i + seq_len] for i in range(w.shape[0])))

    def repeated(z, width):  # [T, kv_heads * width] -> [T, heads, width], each head g times
        return np.repeat(z.reshape(seq_len, heads // groups, width), groups, axis=1)

    q = conv(x @ param_value(layer.q_proj.kernel), layer.q_conv1d)
    q = q.reshape(seq_len, heads, -1)
    k = repeated(conv(x @ param_value(layer.k_proj.kernel), layer.k_conv1d), layer.head_dim)
    v = repeated(conv(x @ param_value(layer.v_proj.kernel), layer.v_conv1d), layer.head_v_dim)
    q, k = feature_map(q), feature_map(k)
    logits = x @ param_value(layer.gk_a_proj.kernel) @ param_value(layer.gk_b_proj.kernel)
    logits = repeated(logits + param_value(layer.gk_b_proj.bias), layer.head_dim)
    log_alpha = -np.logaddexp(0, -logits) / layer.gate_logit_normalizer
    if layer.clamp_min is not None:
        log_alpha = np.maximum(log_alpha, layer.clamp_min)
    o = np.stack(
        [
            gla_reference(q[:, h], k[:, h], v[:, h], log_alpha[:, h], scale=layer.head_dim**-0.5)[0]
            for h in range(heads)
        ],
        axis=1,
    )
    o = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + 1e-5) * param_value(layer.o_norm.scale)
    o = o * silu(x @ param_value(layer.g_proj.kernel)).reshape(o.shape)
    return o.reshape(seq_len, -1) @ param_value(layer.o_proj.kernel)


@pytest.mark.parametrize(
    ("options", "feature_map"),
    [
        ({}, lambda z: z),
        (dict(feature_map="relu", clamp_min=-0.02), lambda z: np.maximum(z, 0)),
    ],
    ids=["plain", "feature map and clamp"],
)
def test_layer_matches_numpy_reference(options, feature_map):
    layer = make(**options)
    x = inputs(0, 2, 21)  # two chunks, the second partial
    y = forward(layer, x)
    for b in range(2):
        assert_close(y[b], reference_layer(layer, x[b], feature_map), jnp.float32)


def test_chunked_and_recurrent_layers_agree_with_gradients():
    chunked, recurrent = make(schedule="auto"), make(impl="recurrent")
    assert_layers_agree_with_gradients(chunked, recurrent, inputs(1, 2, 40))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_heads=3, num_kv_heads=2), r"num_kv_heads=2 must divide num_heads=3"),
        (
            dict(expand_k=0.25, num_heads=3),
            r"key dim int\(hidden_size \* expand_k\) = 4 must be a positive multiple of "
            r"num_heads=3",
        ),
        (dict(gate_fn="swiglu"), r"gate_fn='swiglu' must be one of"),
        (dict(feature_map="softmax"), r"feature_map='softmax' must be one of"),
        (dict(clamp_min=0.5), r"clamp_min"),
        (dict(gate_logit_normalizer=0), r"gate_logit_normalizer=0 must be a finite number > 0"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs, message):
    with pytest.raises(ValueError, match="GatedLinearAttention: " + message):
        GatedLinearAttention(HIDDEN, **{"num_heads": 2, **kwargs}, rngs=nnx.Rngs(0))


def test_the_old_constructor_form_warns_once_and_builds_simple_gla(monkeypatch):
    """``GatedLinearAttention(hidden_size, num_heads, head_dim, ...)``, the scalar-gated
    layer's form, builds ``SimpleGatedLinearAttention`` with its parameters and outputs, with
    one DeprecationWarning a process."""
    monkeypatch.setattr(renamed, "WARNED", set())
    options = dict(chunk_size=16, schedule=SCHEDULE, rngs=nnx.Rngs(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = gdn_jax.GatedLinearAttention(HIDDEN, 2, 4, **options)
        again = GatedLinearAttention(HIDDEN, num_heads=2, head_dim=4, **options)
    assert [w.category for w in caught] == [DeprecationWarning], [str(w.message) for w in caught]
    assert "SimpleGatedLinearAttention" in str(caught[0].message)
    assert type(old) is SimpleGatedLinearAttention and type(again) is SimpleGatedLinearAttention
    new = SimpleGatedLinearAttention(HIDDEN, 2, 4, chunk_size=16, schedule=SCHEDULE,
                                     rngs=nnx.Rngs(0))  # fmt: skip
    for (path, a), (_, b) in zip(
        nnx.to_flat_state(nnx.state(old)), nnx.to_flat_state(nnx.state(new)), strict=True
    ):
        np.testing.assert_array_equal(a.get_value(), b.get_value(), str(path))
    x = inputs(2, 1, 21)
    np.testing.assert_array_equal(forward(old, x), forward(new, x))


def test_the_old_mixer_name_warns_once_and_builds_simple_gla(monkeypatch):
    monkeypatch.setattr(renamed, "WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        configs = [
            ModelConfig(vocab_size=32, d_model=16, mixers=("gated_linear", "gdn", "gated_linear"))
            for _ in range(2)
        ]
    assert [w.category for w in caught] == [DeprecationWarning], [str(w.message) for w in caught]
    assert "'simple_gla'" in str(caught[0].message)
    for config in configs:
        assert config.mixers == ("simple_gla", "gdn", "simple_gla")


def test_the_gla_mixer_is_the_layer_of_the_config_head_layout():
    """The ``gla`` mixer's layer has the config's heads (``num_heads``, ``key_head_dim``,
    ``expand_v``) and refuses separate value heads, which GLA has not."""
    config = ModelConfig(vocab_size=32, d_model=48, num_heads=3, head_dim=8, expand_v=1.5,
                         mixers=("gla",))  # fmt: skip
    layer = nnx.eval_shape(lambda: gdn_jax.models.build_mixer(config, "gla", rngs=nnx.Rngs(0)))
    assert (layer.num_heads, layer.head_dim, layer.head_v_dim) == (3, 8, 12)
    assert layer.q_proj.kernel.shape == (48, 24) and layer.v_proj.kernel.shape == (48, 36)
    grouped = ModelConfig(vocab_size=32, d_model=48, num_heads=3, num_v_heads=6, mixers=("gla",))
    with pytest.raises(ValueError, match=r"num_v_heads=6 must be None or num_heads=3"):
        gdn_jax.models.build_mixer(grouped, "gla", rngs=nnx.Rngs(0))
    assert math.isclose(1.5, layer.head_v_dim / layer.head_dim)
    assert jax.tree.leaves(nnx.state(layer, nnx.Param))
