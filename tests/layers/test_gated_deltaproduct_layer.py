"""The Gated DeltaProduct layer: wiring against a NumPy reference, chunked == recurrent with
gradients, flash-linear-attention's parameter count, bad arguments. Padding, packing and
decoding are test_layers.py's, with the other mixers."""

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
from support.reference import householder_reference
from support.tolerance import assert_close
from test_layers import HIDDEN, forward, inputs

from gdn_jax.layers import GatedDeltaProduct

GVA = dict(num_heads=2, head_dim=4, num_v_heads=4, expand_v=2.0, chunk_size=16, schedule=SCHEDULE)


def make(seed=0, **kw):
    layer = GatedDeltaProduct(HIDDEN, rngs=nnx.Rngs(seed), **{**GVA, **kw})
    rng = np.random.default_rng(seed)
    layer.o_norm.scale[...] = jnp.asarray(
        rng.uniform(0.5, 1.5, layer.o_norm.scale.shape), jnp.float32
    )
    return layer


def reference_layer(layer, x):
    """The layer's forward for one sequence ``x [T, D]``, in float64 NumPy, from its params
    (fla's ``GatedDeltaProduct.forward``, written out)."""
    value = param_value
    seq_len, x = x.shape[0], np.asarray(x, np.float64)
    n, heads, v_heads, key_dim = (
        layer.num_householder, layer.num_heads, layer.num_v_heads, layer.head_dim
    )  # fmt: skip

    def conv(z, module):
        w = value(module.weight)
        padded = np.concatenate([np.zeros((w.shape[0] - 1, z.shape[1])), z])
        y = sum(w[i] * padded[i : i + seq_len] for i in range(w.shape[0]))
        return y * sigmoid(y)

    def steps(z, heads):  # head-major (h n d) columns -> [T n, heads, d]
        return z.reshape(seq_len, heads, n, -1).swapaxes(1, 2).reshape(seq_len * n, heads, -1)

    q = conv(x @ value(layer.q_proj.kernel), layer.q_conv1d).reshape(seq_len, heads, key_dim)
    k = steps(conv(x @ value(layer.k_proj.kernel), layer.k_conv1d), heads)
    v = steps(conv(x @ value(layer.v_proj.kernel), layer.v_conv1d), v_heads)
    q, k = (z / np.sqrt(np.sum(z * z, -1, keepdims=True) + 1e-6) for z in (q, k))
    beta = steps(sigmoid(x @ value(layer.b_proj.kernel)), v_heads)[..., 0]
    beta = 2 * beta if layer.allow_neg_eigval else beta
    log_alpha = None
    if layer.use_forget_gate:
        f = x @ value(layer.a_proj.kernel) + value(layer.dt_bias)
        log_alpha = -np.exp(value(layer.A_log)) * np.log1p(np.exp(f))
    group = v_heads // heads
    o = np.stack(
        [
            householder_reference(
                q[:, h // group], k[:, h // group], v[:, h],
                None if log_alpha is None else log_alpha[:, h], beta[:, h], n,
                scale=key_dim**-0.5,
            )[0]
            for h in range(v_heads)
        ],
        axis=1,
    )  # fmt: skip
    o = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + 1e-5) * value(layer.o_norm.scale)
    if layer.use_gate:
        g = x @ value(layer.g_proj.kernel)
        o = o * (g * sigmoid(g)).reshape(o.shape)
    return o.reshape(seq_len, -1) @ value(layer.o_proj.kernel)


@pytest.mark.parametrize(
    "options",
    [dict(num_householder=2), dict(num_householder=3, use_forget_gate=False, use_gate=False)],
    ids=["fla", "three-steps-no-gates"],
)
def test_layer_matches_numpy_reference(options):
    layer = make(**options)
    x = inputs(0, 2, 21)  # fla's form is test_layers.py's layer: one program at this shape
    y = forward(layer, x)
    for b in range(2):
        assert_close(y[b], reference_layer(layer, x[b]), jnp.float32)


def test_chunked_and_recurrent_layers_agree_with_gradients():
    chunked, recurrent = make(schedule="hoisted"), make(impl="recurrent")
    x = inputs(1, 2, 25)
    assert_layers_agree_with_gradients(chunked, recurrent, x)


def fla_parameter_count(hidden, heads, head_dim, expand_v, v_heads, n, conv, forget, gate):
    """flash-linear-attention GatedDeltaProduct's parameter count, from its layer
    definition: k, v, b projections and the k, v convolutions n times as wide."""
    key_dim, head_v = heads * head_dim, int(head_dim * expand_v)
    value_dim = v_heads * head_v
    count = hidden * key_dim * (1 + n) + hidden * value_dim * n  # q, k, v projections
    count += (key_dim * (1 + n) + value_dim * n) * conv  # three depthwise convs, no bias
    count += hidden * v_heads * n  # b_proj
    count += (hidden * v_heads + 2 * v_heads) if forget else 0  # a_proj, A_log, dt_bias
    count += hidden * value_dim if gate else 0  # g_proj
    count += head_v  # o_norm weight
    return count + value_dim * hidden  # o_proj


@pytest.mark.parametrize(
    "config",
    [
        dict(hidden_size=64, num_heads=2, head_dim=16),
        dict(hidden_size=48, num_heads=3, head_dim=8, num_v_heads=6, num_householder=3),
        dict(
            hidden_size=32,
            num_heads=1,
            head_dim=20,
            expand_v=1.5,
            conv_size=3,
            use_forget_gate=False,
        ),
    ],
)
def test_parameter_count_matches_flash_linear_attention(config):
    layer = nnx.eval_shape(lambda: GatedDeltaProduct(**config, rngs=nnx.Rngs(0)))
    assert parameter_count(layer) == fla_parameter_count(
        config["hidden_size"], config["num_heads"], config["head_dim"],
        config.get("expand_v", 2.0), config.get("num_v_heads", config["num_heads"]),
        config.get("num_householder", 2), config.get("conv_size", 4),
        config.get("use_forget_gate", True), True,
    )  # fmt: skip


def test_bad_layer_config_raises_at_build():
    with pytest.raises(
        ValueError, match=r"GatedDeltaProduct: num_householder=0 must be a positive"
    ):
        GatedDeltaProduct(HIDDEN, 2, 4, num_householder=0, rngs=nnx.Rngs(0))
