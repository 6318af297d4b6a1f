"""Weights in and out of PyTorch, proven against transformers' Qwen3-Next layer itself."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from support.cpu_schedule import SCHEDULE  # noqa: E402
from support.lazy import Lazy  # noqa: E402
from support.tolerance import assert_relative_rms  # noqa: E402

from gdn_jax import GatedDeltaNet  # noqa: E402
from gdn_jax.interop import (  # noqa: E402
    export_fla_layer,
    export_qwen3_next_layer,
    gdn_jax_cache_to_qwen3_next,
    load_fla_layer,
    load_layer,
    load_qwen3_next_layer,
    qwen3_next_cache_to_gdn_jax,
    qwen3_next_layer_prefixes,
    read_safetensors,
)

torch = Lazy("torch")
transformers = Lazy("transformers")
Qwen3NextGatedDeltaNet = Lazy(
    "transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextGatedDeltaNet"
)

# transformers' own tester shape, and Qwen3-Next's real head shape at a small width.
TESTER = dict(
    hidden_size=64,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)
REAL_HEADS = dict(
    hidden_size=64,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
)


def qwen_config(conv=4, **shape):
    return transformers.Qwen3NextConfig(
        **(shape or TESTER),
        linear_conv_kernel_dim=conv,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )


def torch_layer(config, seed=0, dtype=None):
    """A random Qwen3-Next layer of ``dtype`` (default float32); the norm weight and dt_bias,
    which start as ones, are drawn too so that a swapped or dropped one shows."""
    torch.manual_seed(seed)
    layer = Qwen3NextGatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():
        layer.norm.weight.uniform_(0.5, 1.5)
        layer.dt_bias.normal_()
    return layer.to(dtype or torch.float32)


def numpy_state(module):
    """A torch state dict as NumPy, bfloat16 through ml_dtypes (tensor.numpy() refuses it)."""
    out = {}
    for name, t in module.state_dict().items():
        t = t.detach()
        if t.dtype == torch.bfloat16:
            out[name] = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        else:
            out[name] = t.numpy()
    return out


def to_torch(x, dtype):
    return torch.from_numpy(np.asarray(x, np.float32)).to(dtype)


def run_torch(layer, x, **kw):
    with torch.no_grad():
        return layer(to_torch(x, next(layer.parameters()).dtype), **kw).float().numpy()


# The layers run under one jit, not op by op: one compilation per shape instead of one per
# operation. They take the NumPy inputs as they are: jnp.asarray would compile a program of
# its own for each shape.
forward = nnx.jit(lambda layer, x, **kw: layer(x, **kw))
prefill = nnx.jit(lambda layer, x: layer.prefill(x))
step = nnx.jit(lambda layer, x, cache: layer.step(x, cache))


def hidden(seed, batch, seq_len, width=64):
    return np.random.default_rng(seed).standard_normal((batch, seq_len, width)).astype(np.float32)


# One token, part of a chunk, a whole chunk, one past it, and a whole and a part.
LENGTHS = (1, 37, 64, 65, 100)


def packed(lengths, seed):
    """The sequences of ``lengths`` side by side in one row, and their ``cu_seqlens``: one
    compilation covers every length."""
    bounds = np.cumsum((0, *lengths))
    return hidden(seed, 1, int(bounds[-1])), bounds


@pytest.mark.parametrize(
    ("shape", "conv", "lengths"),
    [(TESTER, 4, (1, 37, 100)), (TESTER, 2, (64, 65)), (REAL_HEADS, 4, (20, 70))],
    ids=["tester", "tester-conv2", "real-heads"],
)
def test_outputs_equal_transformers(shape, conv, lengths):
    config = qwen_config(conv, **shape)
    reference = torch_layer(config)
    layer = load_qwen3_next_layer(numpy_state(reference), config.to_dict(), schedule=SCHEDULE)
    for seq_len in lengths:
        x = hidden(seq_len, 2, seq_len)
        assert_relative_rms(forward(layer, x), run_torch(reference, x), jnp.float32, f"T={seq_len}")


def assert_left_padding_matches(layer, reference, x, pad):
    """Row 1 of ``x [2, T, D]`` left-padded by ``pad`` tokens against transformers'
    attention_mask: transformers zeroes the padded inputs, gdn_jax masks them out."""
    mask = np.ones(x.shape[:2], np.int32)
    mask[1, :pad] = 0
    x = x.copy()
    x[1, :pad] = 0
    expected = run_torch(reference, x, attention_mask=torch.from_numpy(mask))
    y = np.asarray(forward(layer, x, mask=mask))
    assert_relative_rms(y[0], expected[0], jnp.float32, "unpadded row")
    assert_relative_rms(y[1, pad:], expected[1, pad:], jnp.float32, "left-padded row")


def assert_packed_matches(layer, reference, x, bounds, what=""):
    """The sequences packed in ``x [1, T, D]`` at offsets ``bounds``, in one gdn_jax call,
    against transformers run on each sequence alone."""
    y = np.asarray(forward(layer, x, cu_seqlens=np.asarray(bounds, np.int32)))
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        expected = run_torch(reference, x[:, lo:hi])
        assert_relative_rms(y[:, lo:hi], expected, jnp.float32, f"{what} T={hi - lo} at {lo}")


def test_padding_mask_and_packing_on_converted_weights():
    config = qwen_config()
    reference = torch_layer(config, seed=1)
    layer = load_qwen3_next_layer(numpy_state(reference), config.to_dict(), schedule=SCHEDULE)
    # The shapes of test_interop_families.py's tests of Qwen3.5, whose layers are these: the
    # programs compiled for one serve the other. T = 65 crosses a chunk boundary by one token.
    assert_left_padding_matches(layer, reference, hidden(2, 2, 65), pad=7)
    assert_packed_matches(layer, reference, *packed(LENGTHS, seed=3))


def transformers_cache(layer):
    cache = layer_cache = transformers.DynamicCache(config=layer.config)
    return cache, layer_cache.layers[0]


def transformers_decoding(reference, prompt, tokens):
    """transformers' outputs for ``prompt`` and then each of ``tokens`` in turn, and its
    ``(conv_state, recurrent_state)`` after the prompt."""
    cache, stored = transformers_cache(reference)
    expected = [run_torch(reference, prompt, cache=cache)]
    torch_conv = stored.conv_states[0].numpy().copy()
    torch_state = stored.recurrent_states[0].numpy().copy()
    for t in range(tokens.shape[1]):
        expected.append(run_torch(reference, tokens[:, t : t + 1], cache=cache))
    return expected, torch_conv, torch_state


def assert_decoding_matches(layer, caches, tokens, expected):
    """Decoding ``tokens`` one at a time from each of ``caches`` gives ``expected[1:]``."""
    for start in caches:
        c = start
        for t in range(tokens.shape[1]):
            y, c = step(layer, tokens[:, t : t + 1], c)
            assert_relative_rms(y, expected[t + 1], jnp.float32, f"decode step {t}")


def assert_family_decoding_matches(family, reference, config):
    """A loaded layer's prefill and cache match transformers', its cache converts both ways
    bit-exactly, and decoding six tokens from either cache matches transformers'."""
    layer = load_layer(numpy_state(reference), config.to_dict(), schedule=SCHEDULE)
    prompt, tokens = hidden(4, 2, 45), hidden(5, 2, 6)

    expected, torch_conv, torch_state = transformers_decoding(reference, prompt, tokens)

    y, gdn_cache = prefill(layer, prompt)
    assert_relative_rms(y, expected[0], jnp.float32, "prefill")
    conv, state = family.cache_from_gdn_jax(gdn_cache)
    # The oldest column of transformers' conv state is never read again; gdn_jax keeps W-1.
    assert_relative_rms(conv[..., 1:], torch_conv[..., 1:], jnp.float32, "conv cache")
    assert_relative_rms(state, torch_state, jnp.float32, "recurrent state")
    # transformers' cache -> gdn_jax -> transformers is bit-exact (but for that column).
    conv_back, state_back = family.cache_from_gdn_jax(
        family.cache_to_gdn_jax(torch_conv, torch_state)
    )
    np.testing.assert_array_equal(conv_back[..., 1:], torch_conv[..., 1:])
    np.testing.assert_array_equal(state_back, torch_state)

    assert_decoding_matches(
        layer, (gdn_cache, family.cache_to_gdn_jax(torch_conv, torch_state)), tokens, expected
    )


def test_prefill_cache_and_decoding_equal_transformers():
    config = qwen_config()
    reference = torch_layer(config, seed=2)
    reference.config = config
    layer = load_qwen3_next_layer(numpy_state(reference), config.to_dict(), schedule=SCHEDULE)
    prompt, tokens = hidden(4, 2, 45), hidden(5, 2, 6)

    expected, torch_conv, torch_state = transformers_decoding(reference, prompt, tokens)

    y, gdn_cache = prefill(layer, prompt)
    assert_relative_rms(y, expected[0], jnp.float32, "prefill")
    conv, state = gdn_jax_cache_to_qwen3_next(gdn_cache)
    assert conv.shape == torch_conv.shape and state.shape == torch_state.shape
    # The oldest column of transformers' conv state is never read again; gdn_jax keeps W-1.
    assert_relative_rms(conv[..., 1:], torch_conv[..., 1:], jnp.float32, "conv cache")
    assert_relative_rms(state, torch_state, jnp.float32, "recurrent state")

    # Decode from gdn_jax's own prefill cache and from transformers' cache, converted.
    assert_decoding_matches(
        layer, (gdn_cache, qwen3_next_cache_to_gdn_jax(torch_conv, torch_state)), tokens, expected
    )


def test_bfloat16_weights_and_inputs():
    config = qwen_config()
    reference = torch_layer(config, seed=3, dtype=torch.bfloat16)
    weights = numpy_state(reference)
    layer = load_qwen3_next_layer(weights, config.to_dict())
    assert layer.q_proj.kernel[...].dtype == jnp.bfloat16  # kept as stored
    x = hidden(6, 2, 70).astype(ml_dtypes.bfloat16)
    # Flax's RMSNorm promotes bfloat16 to float32 for its statistics, which the suite's
    # strict promotion (conftest.py) refuses; users run with JAX's standard promotion.
    with jax.numpy_dtype_promotion("standard"):
        y = forward(layer, x)
    assert y.dtype == jnp.bfloat16
    assert_relative_rms(y, run_torch(reference, x), jnp.bfloat16)
    cast = load_qwen3_next_layer(weights, config.to_dict(), dtype=jnp.float32)
    assert cast.o_proj.kernel[...].dtype == jnp.float32


def test_checkpoint_saved_by_transformers(tmp_path):
    """Every linear-attention layer of a tiny Qwen3NextForCausalLM, read back from the shards
    that save_pretrained writes, maps that layer's real input to its real output."""
    config = transformers.Qwen3NextConfig(
        vocab_size=96,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        linear_conv_kernel_dim=4,
        **TESTER,
    )
    torch.manual_seed(4)
    model = transformers.Qwen3NextForCausalLM(config).eval()
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()

    prefixes = qwen3_next_layer_prefixes(config.to_dict())
    assert sorted(prefixes) == [0, 1, 2]
    # A config.json written before layer_types existed names only the interval.
    older = {"num_hidden_layers": 8, "full_attention_interval": 4}
    assert sorted(qwen3_next_layer_prefixes(older)) == [0, 1, 2, 4, 5, 6]
    assert_checkpoint_layers_match(model, tmp_path, prefixes, load_qwen3_next_layer)


def assert_checkpoint_layers_match(model, path, prefixes, load, layer=None):
    """Each linear-attention layer ``load`` reads from the checkpoint at ``path`` maps the
    input that layer of ``model`` saw to the output it gave. ``layer(model, i)`` is the
    i-th decoder layer's linear attention (default ``model.model.layers[i].linear_attn``)."""
    layer = layer or (lambda model, i: model.model.layers[i].linear_attn)
    seen = {}

    def capture(i):
        def hook(module, args, kwargs, output):
            seen[i] = (kwargs["hidden_states"].numpy().copy(), output.numpy().copy())

        return hook

    for i in prefixes:
        layer(model, i).register_forward_hook(capture(i), with_kwargs=True)
    with torch.no_grad():
        vocab_size = model.config.get_text_config().vocab_size
        model(torch.randint(0, vocab_size, (2, 50)), use_cache=False)
    for i, prefix in prefixes.items():
        layer = load(read_safetensors(path, prefix), model.config.to_dict())
        x, expected = seen[i]
        assert_relative_rms(forward(layer, x), expected, jnp.float32, f"layer {i}")


def gdn_layer(**kw):
    options = dict(num_heads=2, head_dim=8, num_v_heads=4, expand_v=1.5, norm_eps=1e-6)
    options.update(kw)
    return GatedDeltaNet(32, rngs=nnx.Rngs(7), **options)


def params(layer):
    return {
        ".".join(map(str, path)): np.asarray(v.get_value())
        for path, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))
    }


def assert_same_params(a, b):
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert pa[name].dtype == pb[name].dtype, name
        np.testing.assert_array_equal(pa[name], pb[name], err_msg=name)


# The config of ``gdn_layer`` in the transformers families' names.
GDN_LAYER_CONFIG = dict(
    hidden_size=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
)


def assert_round_trip_exact(layer, export, load, config):
    """``load(export(layer), config)`` has the layer's parameters bit for bit, and exporting
    it again gives the same tensors under the same names. Returns the loaded layer."""
    weights = export(layer)
    back = load(weights, config)
    assert_same_params(back, layer)
    again = export(back)
    assert again.keys() == weights.keys()
    for name, value in weights.items():
        np.testing.assert_array_equal(again[name], value, err_msg=name)
    return back


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_qwen3_next_round_trip_is_exact(param_dtype):
    layer = gdn_layer(param_dtype=param_dtype, dtype=param_dtype)
    back = assert_round_trip_exact(
        layer, export_qwen3_next_layer, load_qwen3_next_layer, GDN_LAYER_CONFIG
    )
    x = hidden(8, 1, 9, 32).astype(jnp.dtype(param_dtype))
    with jax.numpy_dtype_promotion("standard"):  # Flax's RMSNorm in bfloat16, see above
        np.testing.assert_array_equal(
            np.asarray(forward(back, x), np.float32), np.asarray(forward(layer, x), np.float32)
        )


@pytest.mark.parametrize(
    "options", [{}, {"conv_bias": True}, {"use_gate": False}, {"use_short_conv": False}]
)
def test_fla_round_trip_is_exact(options):
    kwargs = dict(hidden_size=32, num_heads=2, head_dim=8, num_v_heads=4, expand_v=1.5, **options)
    layer = GatedDeltaNet(**kwargs, rngs=nnx.Rngs(9))
    weights = export_fla_layer(layer)
    assert weights["q_proj.weight"].shape == (16, 32)  # PyTorch's [out, in]
    if layer.q_conv1d is not None:
        assert weights["q_conv1d.weight"].shape == (16, 1, 4)  # nn.Conv1d's [D, 1, W]
    assert_same_params(load_fla_layer(weights, **kwargs), layer)


def test_cache_round_trip_is_exact():
    layer = gdn_layer()
    # Jitted: eagerly, every primitive of the prefill is a program to compile (84).
    _, cache = nnx.jit(lambda layer, x: layer.prefill(x))(layer, hidden(10, 2, 11, 32))
    back = qwen3_next_cache_to_gdn_jax(*gdn_jax_cache_to_qwen3_next(cache))
    for a, b in zip(back.conv, cache.conv, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(back.state, cache.state)


# --- malformed input: one ValueError naming the tensor or argument, nothing built ---------


def random_qwen_weights():
    config = qwen_config()
    return numpy_state(torch_layer(config)), config.to_dict()


def test_missing_extra_and_misshapen_tensors_are_named():
    weights, config = random_qwen_weights()
    missing = {k: v for k, v in weights.items() if k != "dt_bias"}
    with pytest.raises(ValueError, match=r"missing tensor 'dt_bias' \(expected shape \(8,\)\)"):
        load_qwen3_next_layer(missing, config)
    with pytest.raises(ValueError, match=r"unexpected tensor 'conv1d.bias' \(shape \(256,\)\)"):
        load_qwen3_next_layer({**weights, "conv1d.bias": np.zeros(256, np.float32)}, config)
    short = {**weights, "out_proj.weight": weights["out_proj.weight"][:, :100]}
    with pytest.raises(
        ValueError, match=r"'out_proj.weight' has shape \(64, 100\), the config needs \(64, 128\)"
    ):
        load_qwen3_next_layer(short, config)
    with pytest.raises(ValueError, match=r"tensor 'A_log' must be floating point"):
        load_qwen3_next_layer({**weights, "A_log": np.arange(8)}, config)
    fla = export_fla_layer(load_qwen3_next_layer(weights, config))
    del fla["g_proj.weight"]
    with pytest.raises(ValueError, match=r"load_fla_layer: missing tensor 'g_proj.weight'"):
        load_fla_layer(fla, hidden_size=64, num_heads=4, head_dim=16, num_v_heads=8, expand_v=1.0)
    # Both were a TypeError naming RecurrentMixer.__init__, a class the user never met.
    with pytest.raises(
        ValueError,
        match=r"^load_fla_layer: give the layer's sizes as keyword arguments, as to fla's "
        r"layer: hidden_size=..., num_heads=..., head_dim=... are missing$",
    ):
        load_fla_layer(fla)
    with pytest.raises(
        ValueError, match=r"^load_fla_layer: GatedDeltaNet takes no argument hiden_size; it takes "
    ):
        load_fla_layer(fla, hiden_size=64, num_heads=4, head_dim=16)


def test_float64_tensors_without_64_bit_mode_name_the_loaders_param_dtype():
    """The hint was only JAX_ENABLE_X64=1, from GatedDeltaNet's constructor, where the
    loader's own param_dtype=jnp.float32 is the fix."""
    kwargs = dict(hidden_size=32, num_heads=2, head_dim=8)
    layer = GatedDeltaNet(**kwargs, rngs=nnx.Rngs(9))
    wide = {name: t.astype(np.float64) for name, t in export_fla_layer(layer).items()}
    with jax.enable_x64(False):
        with pytest.raises(
            ValueError,
            match=r"^load_fla_layer: state_dict's A_log of dtype float64 needs JAX's 64-bit "
            r"mode, which is off .*; or load every tensor as float32 with "
            r"param_dtype=jnp.float32$",
        ):
            load_fla_layer(wide, **kwargs, dtype=jnp.float32)
        assert_same_params(load_fla_layer(wide, **kwargs, param_dtype=jnp.float32), layer)


def test_config_that_does_not_fit_the_tensors():
    weights, config = random_qwen_weights()
    with pytest.raises(
        ValueError,
        match=r"'in_proj_qkvz.weight' has shape \(384, 64\), the config needs \(640, 64\)",
    ):
        load_qwen3_next_layer(weights, {**config, "linear_value_head_dim": 32})
    with pytest.raises(ValueError, match=r"config lacks linear_conv_kernel_dim"):
        load_qwen3_next_layer(
            weights, {k: v for k, v in config.items() if k != "linear_conv_kernel_dim"}
        )
    with pytest.raises(ValueError, match=r"linear_num_value_heads=6 must be a multiple of"):
        load_qwen3_next_layer(weights, {**config, "linear_num_value_heads": 6})
    with pytest.raises(ValueError, match=r"hidden_act='gelu'"):
        load_qwen3_next_layer(weights, {**config, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match=r"rms_norm_eps='1e-6' must be a finite number > 0"):
        load_qwen3_next_layer(weights, {**config, "rms_norm_eps": "1e-6"})
    with pytest.raises(ValueError, match=r"state_dict must be a mapping"):
        load_qwen3_next_layer(list(weights.values()), config)


def test_layers_qwen3_next_cannot_hold_are_refused():
    with pytest.raises(ValueError, match=r"use_gate=False"):
        export_qwen3_next_layer(gdn_layer(use_gate=False))
    with pytest.raises(ValueError, match=r"allow_neg_eigval=True"):
        export_qwen3_next_layer(gdn_layer(allow_neg_eigval=True))
    from gdn_jax import LinearAttention

    with pytest.raises(ValueError, match=r"must be a GatedDeltaNet, got LinearAttention"):
        export_fla_layer(LinearAttention(32, 2, 8, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"rngs is not taken"):
        load_fla_layer({}, hidden_size=32, num_heads=2, head_dim=8, rngs=nnx.Rngs(0))


def test_malformed_caches_are_refused():
    with pytest.raises(
        ValueError, match=r"conv_state must be \[B, channels, W\].*\(2, 96, 4\) and \(3, 2, 8, 8\)"
    ):
        qwen3_next_cache_to_gdn_jax(np.zeros((2, 96, 4)), np.zeros((3, 2, 8, 8)))
    with pytest.raises(ValueError, match=r"conv_state \(2, 90, 4\) does not fit"):
        qwen3_next_cache_to_gdn_jax(np.zeros((2, 90, 4)), np.zeros((2, 2, 8, 8)))
    with pytest.raises(ValueError, match=r"RecurrentCache with convolution histories"):
        # Only the layer's cache is read: built abstractly, no initialiser is compiled.
        layer = nnx.eval_shape(lambda: gdn_layer(use_short_conv=False))
        gdn_jax_cache_to_qwen3_next(layer.init_cache(1))


def test_read_safetensors_errors(tmp_path):
    from safetensors.numpy import save_file

    save_file(
        {"a.x": np.zeros(3, np.float32), "b.y": np.ones(2, np.float32)}, tmp_path / "m.safetensors"
    )
    assert read_safetensors(tmp_path / "m.safetensors", "a.").keys() == {"x"}
    with pytest.MonkeyPatch.context() as patch:  # "~" is the home, as in a shell
        patch.setenv("HOME", str(tmp_path))
        assert read_safetensors("~/m.safetensors", "a.").keys() == {"x"}
    with pytest.raises(ValueError, match=r"no tensor in .* starts with prefix 'c.'"):
        read_safetensors(tmp_path / "m.safetensors", "c.")
    with pytest.raises(ValueError, match=r"neither a file nor a directory"):
        read_safetensors(tmp_path / "nothing")
    with pytest.raises(ValueError, match=r"has neither model.safetensors.index.json nor"):
        read_safetensors(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a.x": "m.safetensors", "a.z": "gone.safetensors"}}'
    )
    with pytest.raises(ValueError, match=r"the index names gone.safetensors"):
        read_safetensors(tmp_path, "a.")
    # 123 was pathlib's TypeError naming neither the function nor the argument.
    with pytest.raises(TypeError, match=r"^read_safetensors: path=123 must be a file or dir"):
        read_safetensors(123)
    with pytest.raises(TypeError, match=r"^read_safetensors: prefix=1 must be a string$"):
        read_safetensors(tmp_path, 1)


def test_bfloat16_checkpoint_keeps_its_dtype(tmp_path):
    from safetensors.torch import save_file

    reference = torch_layer(qwen_config(), seed=11, dtype=torch.bfloat16)
    prefixed = {f"model.layers.0.linear_attn.{k}": v for k, v in reference.state_dict().items()}
    save_file({k: v.contiguous() for k, v in prefixed.items()}, tmp_path / "model.safetensors")
    read = read_safetensors(tmp_path, "model.layers.0.linear_attn.")
    expected = numpy_state(reference)
    assert read.keys() == expected.keys()
    for name, value in expected.items():
        assert read[name].dtype == ml_dtypes.bfloat16, name
        np.testing.assert_array_equal(read[name], value, err_msg=name)


def test_unreadable_shards_and_malformed_indexes_are_named(tmp_path):
    """A truncated shard or another file gave safetensors' own error without the file's
    name, and a weight_map list an AttributeError."""
    from safetensors.numpy import save_file

    save_file({"a.x": np.zeros(64, np.float32)}, tmp_path / "whole.safetensors")
    data = (tmp_path / "whole.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    (tmp_path / "other.safetensors").write_bytes(b"not a safetensors file at all")
    for name in ("cut", "other"):
        with pytest.raises(ValueError, match=rf"{name}.safetensors is not a readable safetensors"):
            read_safetensors(tmp_path / f"{name}.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": ["a.x"]}')
    with pytest.raises(ValueError, match=r"index.json field weight_map must map tensor names"):
        read_safetensors(tmp_path)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            dict(num_hidden_layers=4, full_attention_interval=0),
            r"full_attention_interval=0 must be a positive integer",
        ),
        (dict(num_hidden_layers="4"), r"num_hidden_layers='4' must be a positive integer"),
        (
            dict(layer_types=["linear-attention", "full_attention"]),
            r"layer_types names unknown kinds \['linear-attention'\]; known: \('linear_attention', 'full_attention', 'sliding_attention', 'indexed_attention'\)",
        ),
    ],
)
def test_layer_layout_values_are_checked(config, message):
    with pytest.raises(ValueError, match=f"qwen3_next_layer_prefixes: config {message}"):
        qwen3_next_layer_prefixes(config)


def test_the_dtype_must_be_floating():
    weights, config = random_qwen_weights()
    with pytest.raises(ValueError, match=r"load_qwen3_next_layer: dtype=int32 must be a floating"):
        load_qwen3_next_layer(weights, config, dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"load_fla_layer: param_dtype=int32 must be a floating"):
        load_fla_layer({}, hidden_size=32, num_heads=2, head_dim=8, param_dtype=jnp.int32)


def test_the_schedule_reaches_the_layer_and_is_checked():
    weights, config = random_qwen_weights()
    assert load_qwen3_next_layer(weights, config).schedule == "auto"
    assert load_layer(weights, config, schedule="hoisted").schedule == "hoisted"
    with pytest.raises(ValueError, match=r"load_qwen3_next_layer: schedule='fused' must be one"):
        load_layer(weights, config, schedule="fused")
