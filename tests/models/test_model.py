"""The language model: causality, cached decoding, generation, config checks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.cpu_schedule import SCHEDULE
from support.tolerance import assert_close

from gdn_jax.models import LanguageModel, ModelConfig, generate

# One stack holding a mixer of each kind of layer and cache: each test below then covers all of
# them in one compilation. "deltanet", "simple_gla" and "linear" are GatedDeltaNet's base class
# with its delta or decay switched off (the same cache and the same model code): test_layers.py
# checks each one's decoding, padding and packing on its own.
HYBRID = ModelConfig(
    vocab_size=50,
    d_model=16,
    mixers=("gdn", "kda", "attention", "attention_conv"),
    num_heads=2,
    expand_v=2.0,
    chunk_size=16,
    schedule=SCHEDULE,
)


@pytest.fixture(scope="module")
def model():
    return LanguageModel(HYBRID, rngs=nnx.Rngs(0))


def tokens(seed, batch, seq_len, vocab=50):
    """Random ids as a JAX array, put on the device rather than converted (jnp.asarray would
    compile the conversion); the tests below cut and join them in NumPy for the same reason."""
    ids = np.random.default_rng(seed).integers(0, vocab, (batch, seq_len)).astype(np.int32)
    return jax.device_put(ids)


def test_gradient_of_output_at_t_ignores_inputs_after_t(model):
    # nanodo's causality check: d y_t / d x_s == 0 exactly for every s > t, through all mixers.
    x = model.embed(tokens(0, 1, 40))
    t = 17

    @nnx.jit
    def grad_at_t(model, x):
        def out_t(x):
            for block in model.blocks:
                x = block(x)
            return jnp.sum(model.norm(x)[:, t] * jnp.arange(x.shape[-1], dtype=x.dtype)[None, :])

        return jax.grad(out_t)(x)

    g = np.asarray(grad_at_t(model, x))
    assert np.all(g[:, t + 1 :] == 0.0)
    assert np.all(np.abs(g[:, : t + 1]).sum(-1) > 0)  # and it does depend on the past


# One compiled forward for the tests below, which call it at one shape: [2, 12] tokens.
forward = nnx.jit(lambda model, x: model(x))


def test_changing_future_tokens_leaves_past_logits_unchanged(model):
    a = tokens(1, 2, 12)
    b = np.asarray(a).copy()
    b[:, 8:] = tokens(2, 2, 4)
    np.testing.assert_array_equal(
        np.asarray(forward(model, a))[:, :8], np.asarray(forward(model, b))[:, :8]
    )


def test_cached_decoding_equals_full_forward(model):
    batch, prompt, total = 2, 9, 16
    x = np.asarray(tokens(3, batch, total))
    mask = np.ones((batch, total), np.int32)
    mask[0, :4] = 0  # row 0 is left-padded
    full = nnx.jit(lambda model, x, m: model(x, mask=m))(model, x, mask)
    cache = model.init_cache(batch, total)
    logits, cache = nnx.jit(lambda model, x, c, m: model.prefill(x, c, mask=m))(
        model, x[:, :prompt], cache, mask[:, :prompt]
    )
    outs = [logits]
    step = nnx.jit(lambda model, x, c: model.step(x, c))
    for t in range(prompt, total):
        logits, cache = step(model, x[:, t : t + 1], cache)
        outs.append(logits)
    real = mask.astype(bool)
    assert_close(np.concatenate(outs, 1)[real], np.asarray(full)[real], jnp.float32)


def test_greedy_generation_equals_argmax_of_the_full_forward(model):
    # By causality, one forward over prompt + generated tokens gives, at each position, the
    # logits a fresh forward over the prefix would: greedy decoding must pick their argmax.
    prompt = tokens(4, 2, 7)
    generated = generate(model, prompt, max_new_tokens=5)
    assert generated.shape == (2, 5) and generated.dtype == jnp.int32
    logits = np.asarray(forward(model, np.concatenate([prompt, generated], 1)))
    np.testing.assert_array_equal(generated, np.argmax(logits[:, 6:11], axis=-1))


def test_sampling_is_reproducible_and_in_vocabulary(model):
    prompt = tokens(5, 3, 6)
    key = jax.random.key(7)
    a = generate(model, prompt, max_new_tokens=6, temperature=1.0, key=key)
    b = generate(model, prompt, max_new_tokens=6, temperature=1.0, key=key)
    np.testing.assert_array_equal(a, b)
    assert np.all((np.asarray(a) >= 0) & (np.asarray(a) < HYBRID.vocab_size))


def test_generation_arguments_are_checked(model):
    with pytest.raises(ValueError, match="max_new_tokens=0 must be >= 1"):
        generate(model, tokens(0, 1, 3), max_new_tokens=0)
    with pytest.raises(ValueError, match="needs a PRNG key"):
        generate(model, tokens(0, 1, 3), max_new_tokens=2, temperature=0.5)


def test_tied_embeddings_and_no_mlp_change_the_parameter_count():
    def count(config):
        model = LanguageModel(config, rngs=nnx.Rngs(0))
        return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))

    base = ModelConfig(vocab_size=50, d_model=16, mixers=("gdn",))
    tied = dataclasses.replace(base, tie_embeddings=True)
    no_mlp = dataclasses.replace(base, use_mlp=False)
    assert count(base) - count(tied) == 50 * 16
    assert count(base) - count(no_mlp) == 3 * 16 * base.mlp_width + 16  # SwiGLU + its norm


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            dict(mixers=("gdn", "mamba")),
            r"ModelConfig.mixers=.*unknown mixer 'mamba'; allowed: \('gdn'",
        ),
        (dict(mixers=()), r"ModelConfig.mixers=\(\): needs a list of at least one layer"),
        (dict(d_model=30, num_heads=4), r"ModelConfig.num_heads=4: must divide d_model=30"),
        # Per-layer rules are the constructors' to state.
        (
            dict(num_v_heads=3),
            r"GatedDeltaNet: num_v_heads=3 must be a multiple of num_heads=2",
        ),
        (dict(chunk_size=50), r"GatedDeltaNet: chunk_size=50 must be one of \(16, 32, 64, 128\)"),
        (dict(impl="cuda"), r"GatedDeltaNet: impl='cuda' must be one of"),
        (dict(dtype="int8"), r"ModelConfig.dtype='int8': allowed"),
        (
            dict(head_dim=5, mixers=("attention",)),
            r"SoftmaxAttention: head_dim=5 must be even for RoPE",
        ),
    ],
)
def test_bad_model_config_raises_at_build(change, message):
    config = dataclasses.replace(ModelConfig(vocab_size=50, d_model=16), **change)
    with pytest.raises(ValueError, match=message):
        LanguageModel(config, rngs=nnx.Rngs(0))
