"""The Flax layers: wiring against a NumPy reference, padding, packing, decoding, counts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.cpu_schedule import SCHEDULE
from support.layer_forms import assert_layers_agree_with_gradients
from support.reference import grouped_heads_reference
from support.tolerance import assert_close

from gdn_jax.layers import (
    DeltaNet,
    GatedDeltaNet,
    GatedDeltaNet2,
    GatedDeltaProduct,
    GatedLinearAttention,
    KimiDeltaAttention,
    LinearAttention,
    NoWeightDecay,
    SimpleGatedLinearAttention,
    SoftmaxAttention,
)

RECURRENT = [GatedDeltaNet, DeltaNet, SimpleGatedLinearAttention, LinearAttention]
# Every mixer with a recurrent state; KimiDeltaAttention's, GatedDeltaNet2's,
# GatedDeltaProduct's and GatedLinearAttention's own tests are in test_kda_layer.py,
# test_gdn2_layer.py, test_gated_deltaproduct_layer.py and test_gla_layer.py.
STATEFUL = [*RECURRENT, KimiDeltaAttention, GatedDeltaNet2, GatedDeltaProduct, GatedLinearAttention]
# GLA's layer takes flash-linear-attention's arguments: grouped key/value heads, convolutions.
GLA_OPTIONS = dict(expand_k=0.5, num_heads=2, num_kv_heads=1, use_short_conv=True)
HIDDEN = 16


def AttentionWithConv(*args, **kw):
    return SoftmaxAttention(*args, use_short_conv=True, **kw)


ATTENTION = [SoftmaxAttention, AttentionWithConv]


def make(cls, **kw):
    if cls in ATTENTION:
        return cls(HIDDEN, 2, 8, rngs=nnx.Rngs(0))
    if cls is GatedLinearAttention:
        options = dict(GLA_OPTIONS, chunk_size=16, schedule=SCHEDULE, **kw)
        return cls(HIDDEN, rngs=nnx.Rngs(0), **options)
    options = dict(
        num_heads=2, head_dim=4, expand_v=2.0, num_v_heads=4, chunk_size=16, schedule=SCHEDULE
    )
    options.update(kw)
    return cls(HIDDEN, rngs=nnx.Rngs(0), **options)


def inputs(seed, batch, seq_len):
    return jnp.asarray(
        np.random.default_rng(seed).standard_normal((batch, seq_len, HIDDEN)), jnp.float32
    )


def silu(x):
    return x / (1 + np.exp(-x))


def reference_layer(layer, x):
    """The layer's forward for one sequence ``x [T, D]``, in float64 NumPy, from its params."""
    kernel = lambda proj: np.asarray(proj.kernel[...], np.float64)  # noqa: E731
    seq_len = x.shape[0]
    x = np.asarray(x, np.float64)

    def conv(z, module):
        w = np.asarray(module.weight[...], np.float64)
        padded = np.concatenate([np.zeros((w.shape[0] - 1, z.shape[1])), z])
        return silu(sum(w[i] * padded[i : i + seq_len] for i in range(w.shape[0])))

    q = conv(x @ kernel(layer.q_proj), layer.q_conv1d).reshape(seq_len, layer.num_heads, -1)
    k = conv(x @ kernel(layer.k_proj), layer.k_conv1d).reshape(seq_len, layer.num_heads, -1)
    v = conv(x @ kernel(layer.v_proj), layer.v_conv1d).reshape(seq_len, layer.num_v_heads, -1)
    q, k = (z / np.sqrt(np.sum(z * z, -1, keepdims=True) + 1e-6) for z in (q, k))
    shape = (seq_len, layer.num_v_heads)
    beta = 1 / (1 + np.exp(-(x @ kernel(layer.b_proj)))) if layer.delta else np.ones(shape)
    beta = 2 * beta if layer.allow_neg_eigval else beta
    log_alpha = np.zeros(shape)
    if layer.decay:
        gate = x @ kernel(layer.a_proj) + np.asarray(layer.dt_bias[...], np.float64)
        log_alpha = -np.exp(np.asarray(layer.A_log[...], np.float64)) * np.log1p(np.exp(gate))
    o, _ = grouped_heads_reference(
        q, k, v, log_alpha, beta, scale=layer.head_dim**-0.5, delta=layer.delta
    )
    o = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + 1e-5) * np.asarray(layer.o_norm.scale[...])
    o = o * silu(x @ kernel(layer.g_proj)).reshape(o.shape)
    return o.reshape(seq_len, -1) @ kernel(layer.o_proj)


# A layer's calls, each compiled once per layer structure and input shape for all the tests
# below, which pick their shapes to share programs: the reference, padding and packing tests
# run the forward at [2, 21] tokens, the padding and decoding tests the masked forward at
# [2, 30].
forward = nnx.jit(lambda layer, x: layer(x))
masked_forward = nnx.jit(lambda layer, x, mask: layer(x, mask=mask))
packed_forward = nnx.jit(lambda layer, x, cu: layer(x, cu_seqlens=cu))
prefill = nnx.jit(lambda layer, x, cache, mask: layer.prefill(x, cache, mask=mask))
step = nnx.jit(lambda layer, x, cache: layer.step(x, cache))


@pytest.mark.parametrize("cls", RECURRENT)
def test_layer_matches_numpy_reference(cls):
    layer = make(cls, allow_neg_eigval=cls is GatedDeltaNet)
    x = inputs(0, 2, 21)  # two chunks, the second partial
    y = forward(layer, x)
    for b in range(2):
        assert_close(y[b], reference_layer(layer, x[b]), jnp.float32)


@pytest.mark.parametrize("cls", [GatedDeltaNet, LinearAttention])
def test_chunked_and_recurrent_layers_agree_with_gradients(cls):
    # The layer's default schedule, "auto", as users run it.
    chunked, recurrent = make(cls, schedule="auto"), make(cls, impl="recurrent")
    x = inputs(1, 2, 40)

    def loss(layer, x):
        return jnp.sum(layer(x) ** 2)

    assert_layers_agree_with_gradients(chunked, recurrent, x, loss)


def fla_parameter_count(hidden, heads, head_dim, expand_v, v_heads, conv, use_gate, conv_bias):
    """flash-linear-attention GatedDeltaNet's parameter count, from its layer definition."""
    key_dim, head_v = heads * head_dim, int(head_dim * expand_v)
    value_dim = v_heads * head_v
    count = 2 * hidden * key_dim + hidden * value_dim  # q, k, v projections
    count += 2 * hidden * v_heads  # a_proj, b_proj
    count += 2 * v_heads  # A_log, dt_bias
    count += (2 * key_dim + value_dim) * (conv + int(conv_bias))  # three depthwise convs
    count += hidden * value_dim if use_gate else 0  # g_proj
    count += head_v  # o_norm weight, shared by heads
    return count + value_dim * hidden  # o_proj


@pytest.mark.parametrize(
    "config",
    [
        dict(hidden_size=64, num_heads=2, head_dim=16, expand_v=2.0),
        dict(hidden_size=48, num_heads=3, head_dim=8, expand_v=1.0, num_v_heads=6),
        dict(hidden_size=32, num_heads=1, head_dim=20, expand_v=1.5, use_gate=False, conv_size=3),
        dict(hidden_size=32, num_heads=2, head_dim=8, conv_bias=True),
    ],
)
def test_parameter_count_matches_flash_linear_attention(config):
    layer = nnx.eval_shape(lambda: GatedDeltaNet(**config, rngs=nnx.Rngs(0)))
    count = sum(x.size for x in jax.tree.leaves(nnx.state(layer, nnx.Param)))
    expected = fla_parameter_count(
        config["hidden_size"],
        config["num_heads"],
        config["head_dim"],
        config.get("expand_v", 2.0),
        config.get("num_v_heads", config["num_heads"]),
        config.get("conv_size", 4),
        config.get("use_gate", True),
        config.get("conv_bias", False),
    )
    assert count == expected


def test_gate_parameters_are_initialised_and_excluded_from_decay():
    layer = GatedDeltaNet(64, 4, 16, num_v_heads=64, rngs=nnx.Rngs(3))
    decay_free = nnx.state(layer, NoWeightDecay)
    assert set(decay_free.keys()) == {"A_log", "dt_bias"}
    a = np.exp(np.asarray(layer.A_log[...]))
    assert np.all((a > 0) & (a <= 16))
    dt = np.log1p(np.exp(np.asarray(layer.dt_bias[...])))  # softplus(dt_bias) = dt
    assert np.all((dt >= 1e-3 * 0.999) & (dt <= 1e-1 * 1.001))
    assert len(set(np.round(dt, 6))) > 1  # drawn, not a constant


@pytest.mark.parametrize("cls", STATEFUL + ATTENTION)
def test_padding_does_not_change_real_tokens(cls):
    # Row 0 is left-padded, row 1 right-padded; each holds the real tokens of a row of x.
    layer = make(cls)
    real, pad = 21, 9
    x = inputs(2, 2, real)
    # Whatever sits in the padding must not matter, NaN and inf included.
    noise = (inputs(3, 2, pad) * 10).at[:, 1].set(jnp.nan).at[:, -1].set(-jnp.inf)
    padded = jnp.concatenate(
        [jnp.concatenate([noise[:1], x[:1]], 1), jnp.concatenate([x[1:], noise[1:]], 1)]
    )
    mask = np.ones((2, real + pad), np.int32)
    mask[0, :pad], mask[1, real:] = 0, 0
    y_padded = masked_forward(layer, padded, mask)
    y = forward(layer, x)
    assert_close(y_padded[:1, pad:], y[:1], jnp.float32, "left padding")
    assert_close(y_padded[1:, :real], y[1:], jnp.float32, "right padding")


def test_nan_padding_stays_out_of_real_tokens_in_the_hoisted_schedule():
    """The test above runs "in_scan"; in "hoisted" every chunk's work runs batched outside
    the scan."""
    layer = make(GatedDeltaNet, schedule="hoisted")
    # Two rows with the same real tokens after 5 padded ones: NaN in row 0, zeros in row 1.
    pad = jnp.stack([jnp.full((5, HIDDEN), jnp.nan), jnp.zeros((5, HIDDEN))]).astype(jnp.float32)
    x = jnp.concatenate([pad, jnp.tile(inputs(2, 1, 20), (2, 1, 1))], 1)
    mask = jnp.ones((2, 25), jnp.int32).at[:, :5].set(0)
    y = masked_forward(layer, x, mask)
    assert_close(y[0, 5:], y[1, 5:], jnp.float32)


@pytest.mark.parametrize("cls", STATEFUL + ATTENTION)
def test_packed_sequences_equal_separate_runs(cls):
    layer = make(cls)
    cu = [0, 21, 21, 42]  # an empty sequence between two others
    x = inputs(4, 1, 42)
    y = packed_forward(layer, x, jnp.asarray(cu, jnp.int32))
    # The two sequences run separately as the rows of one batch, the padding test's unpadded
    # [2, 21] forward.
    separate = forward(layer, jnp.concatenate([x[:, :21], x[:, 21:]]))
    for row, (lo, hi) in enumerate(((0, 21), (21, 42))):
        assert_close(y[:, lo:hi], separate[row : row + 1], jnp.float32, f"tokens {lo}:{hi}")


@pytest.mark.parametrize("cls", STATEFUL + ATTENTION)
def test_prefill_then_steps_equals_parallel_forward(cls):
    layer = make(cls)
    batch, prompt, total = 2, 22, 30  # the padding test's masked [2, 30] forward
    x = inputs(5, batch, total)
    mask = jnp.ones((batch, total), jnp.int32).at[1, :5].set(0)  # row 1 is left-padded
    full = masked_forward(layer, x, mask)
    cache = layer.init_cache(batch, total)
    y, cache = prefill(layer, x[:, :prompt], cache, mask[:, :prompt])
    outs = [y]
    for t in range(prompt, total):
        y, cache = step(layer, x[:, t : t + 1], cache)
        outs.append(y)
    decoded = jnp.concatenate(outs, axis=1)
    real = np.asarray(mask, bool)
    assert_close(np.asarray(decoded)[real], np.asarray(full)[real], jnp.float32)


def test_padded_prefill_leaves_the_state_of_the_unpadded_prompt():
    layer = make(GatedDeltaNet)
    x = inputs(6, 1, 14)
    prefill_empty = nnx.jit(lambda layer, x, m: layer.prefill(x, mask=m))  # no cache given
    _, cache = prefill_empty(layer, x, jnp.ones((1, 14), jnp.int32))
    padded = jnp.concatenate([jnp.ones((1, 6, HIDDEN), jnp.float32), x], axis=1)
    mask = jnp.concatenate([jnp.zeros((1, 6)), jnp.ones((1, 14))], axis=1).astype(jnp.int32)
    _, cache_padded = prefill_empty(layer, padded, mask)
    assert_close(cache_padded.state, cache.state, jnp.float32)
    for a, e in zip(cache_padded.conv, cache.conv, strict=True):
        assert_close(a, e, jnp.float32)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(num_heads=2, head_dim=4, num_v_heads=3),
            r"num_v_heads=3 must be a multiple of num_heads=2",
        ),
        (dict(num_heads=2, head_dim=4, chunk_size=20), r"chunk_size=20 must be one of"),
        (dict(num_heads=2, head_dim=4, impl="fast"), r"impl='fast' must be one of"),
        (dict(num_heads=2, head_dim=4, schedule="fused"), r"schedule='fused' must be one of"),
        (
            dict(num_heads=2, head_dim=3, expand_v=0.5),
            r"head_dim \* expand_v = 3 \* 0.5 must be a positive integer",
        ),
        (dict(num_heads=0, head_dim=4), r"num_heads=0 must be a positive integer"),
    ],
)
def test_bad_layer_config_raises_at_build(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GatedDeltaNet(HIDDEN, rngs=nnx.Rngs(0), **kwargs)
    with pytest.raises(ValueError, match="head_dim=7 must be even"):
        SoftmaxAttention(HIDDEN, 2, 7, rngs=nnx.Rngs(0))


def test_split_merge_and_plain_jit():
    layer = make(GatedDeltaNet)
    graphdef, state = nnx.split(layer)

    @functools.partial(jax.jit, donate_argnums=())
    def apply(state, x):
        return nnx.merge(graphdef, state)(x)

    x = inputs(7, 2, 20)
    assert_close(apply(state, x)[0], reference_layer(layer, x[0]), jnp.float32)
