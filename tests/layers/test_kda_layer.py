"""The Kimi Delta Attention layer: wiring against a NumPy reference, chunked == recurrent with
gradients, initialisation, bad arguments (the parameter counts of fla and transformers are
tests/interop/test_interop_kda.py's). Padding, packing and decoding are test_layers.py's, with
the other mixers."""

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
from support.reference import grouped_heads_reference
from support.tolerance import assert_close
from test_layers import HIDDEN, forward, inputs

from gdn_jax.layers import KimiDeltaAttention, NoWeightDecay

GVA = dict(num_heads=2, head_dim=4, num_v_heads=4, expand_v=2.0, chunk_size=16, schedule=SCHEDULE)
# The forms of the transformers families: full-rank gates, a bounded gate, no gate bias.
BAILING_FORM = dict(low_rank_gates=False, output_gate_bias=False, gate_lower_bound=-3.0)


def make(seed=0, **kw):
    """A layer whose zero- or one-initialised parameters (the gate bias, the norm scale) are
    drawn too, so that a dropped one shows."""
    layer = KimiDeltaAttention(HIDDEN, rngs=nnx.Rngs(seed), **{**GVA, **kw})
    rng = np.random.default_rng(seed)
    layer.o_norm.scale[...] = jnp.asarray(
        rng.uniform(0.5, 1.5, layer.o_norm.scale.shape), jnp.float32
    )
    layer.A_log[...] = jnp.asarray(rng.uniform(-1.0, 1.5, layer.A_log.shape), jnp.float32)
    if layer.g_b_proj is not None and layer.g_b_proj.bias is not None:
        bias = rng.standard_normal(layer.g_b_proj.bias.shape)
        layer.g_b_proj.bias[...] = jnp.asarray(bias, jnp.float32)
    return layer


def reference_layer(layer, x):
    """The layer's forward for one sequence ``x [T, D]``, in float64 NumPy, from its params."""
    value = param_value
    seq_len, x = x.shape[0], np.asarray(x, np.float64)

    def linear(proj, z):
        y = z @ value(proj.kernel)
        return y if proj.bias is None else y + value(proj.bias)

    def conv(z, module):
        w = value(module.weight)
        padded = np.concatenate([np.zeros((w.shape[0] - 1, z.shape[1])), z])
        y = sum(w[i] * padded[i : i + seq_len] for i in range(w.shape[0]))
        return y * sigmoid(y)

    heads, v_heads, key_dim = layer.num_heads, layer.num_v_heads, layer.head_dim
    q = conv(linear(layer.q_proj, x), layer.q_conv1d).reshape(seq_len, heads, key_dim)
    k = conv(linear(layer.k_proj, x), layer.k_conv1d).reshape(seq_len, heads, key_dim)
    v = conv(linear(layer.v_proj, x), layer.v_conv1d).reshape(seq_len, v_heads, -1)
    q, k = (z / np.sqrt(np.sum(z * z, -1, keepdims=True) + 1e-6) for z in (q, k))
    beta = sigmoid(linear(layer.b_proj, x)) * (2 if layer.allow_neg_eigval else 1)
    if layer.low_rank_gates:
        f = linear(layer.f_b_proj, linear(layer.f_a_proj, x))
        g = linear(layer.g_b_proj, linear(layer.g_a_proj, x))
    else:
        f, g = linear(layer.f_proj, x), linear(layer.g_proj, x)
    f = (f + value(layer.dt_bias)).reshape(seq_len, v_heads, key_dim)
    rate = np.exp(value(layer.A_log))[:, None]
    bound = layer.gate_lower_bound
    log_alpha = -rate * np.log1p(np.exp(f)) if bound is None else bound * sigmoid(rate * f)
    o, _ = grouped_heads_reference(q, k, v, log_alpha, beta, scale=key_dim**-0.5)
    o = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + 1e-5) * value(layer.o_norm.scale)
    o = o * sigmoid(g).reshape(o.shape)
    return o.reshape(seq_len, -1) @ value(layer.o_proj.kernel)


@pytest.mark.parametrize(
    "options", [dict(allow_neg_eigval=True), BAILING_FORM], ids=["fla", "bailing-form"]
)
def test_layer_matches_numpy_reference(options):
    layer = make(**options)
    x = inputs(0, 2, 37)
    y = forward(layer, x)
    for b in range(2):
        assert_close(y[b], reference_layer(layer, x[b]), jnp.float32)


def test_chunked_and_recurrent_layers_agree_with_gradients():
    chunked = make(gate_lower_bound=-4.0, schedule="auto")
    recurrent = make(gate_lower_bound=-4.0, impl="recurrent")
    x = inputs(1, 2, 40)
    assert_layers_agree_with_gradients(chunked, recurrent, x)


def fla_parameter_count(hidden, heads, head_dim, expand_v, v_heads, conv, conv_bias):
    """flash-linear-attention KimiDeltaAttention's parameter count, from its layer definition:
    the f_proj and g_proj pairs of rank head_v_dim, one gate per value head and key channel,
    a bias on g_proj's second linear."""
    key_dim, head_v = heads * head_dim, int(head_dim * expand_v)
    value_dim, gate_dim = v_heads * head_v, v_heads * head_dim
    count = 2 * hidden * key_dim + hidden * value_dim  # q, k, v projections
    count += (2 * key_dim + value_dim) * (conv + int(conv_bias))  # three depthwise convs
    count += hidden * head_v + head_v * gate_dim  # f_proj
    count += hidden * v_heads + v_heads + gate_dim  # b_proj, A_log, dt_bias
    count += hidden * head_v + head_v * value_dim + value_dim  # g_proj with its bias
    count += head_v  # o_norm weight, shared by heads
    return count + value_dim * hidden  # o_proj


@pytest.mark.parametrize(
    "config",
    [
        dict(hidden_size=64, num_heads=2, head_dim=16),
        dict(hidden_size=48, num_heads=3, head_dim=8, expand_v=2.0, num_v_heads=6),
        dict(hidden_size=32, num_heads=1, head_dim=20, expand_v=1.5, conv_size=3, conv_bias=True),
    ],
)
def test_parameter_count_matches_flash_linear_attention(config):
    layer = nnx.eval_shape(lambda: KimiDeltaAttention(**config, rngs=nnx.Rngs(0)))
    assert parameter_count(layer) == fla_parameter_count(
        config["hidden_size"],
        config["num_heads"],
        config["head_dim"],
        config.get("expand_v", 1.0),
        config.get("num_v_heads", config["num_heads"]),
        config.get("conv_size", 4),
        config.get("conv_bias", False),
    )


def test_gate_parameters_are_initialised_and_excluded_from_decay():
    layer = KimiDeltaAttention(64, 4, 16, rngs=nnx.Rngs(3))
    assert set(nnx.state(layer, NoWeightDecay).keys()) == {"A_log", "dt_bias"}
    a = np.exp(np.asarray(layer.A_log[...]))
    assert np.all((a >= 1) & (a <= 16)) and len(set(np.round(a, 4))) > 1
    dt = np.log1p(np.exp(np.asarray(layer.dt_bias[...])))  # softplus(dt_bias) = dt
    assert np.all((dt >= 1e-3 * 0.999) & (dt <= 1e-1 * 1.001))
    assert len(set(np.round(dt, 6))) > 1  # drawn, not a constant
    np.testing.assert_array_equal(layer.g_b_proj.bias[...], 0)
    bounded = KimiDeltaAttention(64, 4, 16, gate_lower_bound=-5.0, rngs=nnx.Rngs(3))
    # exp(A_log) = 1 scales the sigmoid's input: the bound's own initialisation.
    np.testing.assert_array_equal(bounded.A_log[...], 0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(gate_lower_bound=0.0), r"gate_lower_bound=0.0 must be a finite negative number"),
        (dict(gate_lower_bound=float("nan")), r"gate_lower_bound=nan must be a finite negative"),
        (dict(gate_lower_bound=-float("inf")), r"gate_lower_bound=-inf must be a finite neg"),
        (dict(gate_lower_bound="-5"), r"gate_lower_bound='-5' must be a finite negative"),
        (dict(num_v_heads=3), r"num_v_heads=3 must be a multiple of num_heads=2"),
        (dict(chunk_size=20), r"chunk_size=20 must be one of"),
        (dict(schedule="fused"), r"schedule='fused' must be one of"),
    ],
)
def test_bad_layer_config_raises_at_build(kwargs, message):
    with pytest.raises(ValueError, match=f"KimiDeltaAttention: {message}"):
        KimiDeltaAttention(HIDDEN, 2, 4, rngs=nnx.Rngs(0), **kwargs)
