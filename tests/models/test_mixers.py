"""What every registered mixer (``gdn_jax.models.MIXERS``) must do: build from its name,
as the layer the registry says, and implement the ``TokenMixer`` methods with their declared
signatures. Their behaviour (padding, packing, decoding == parallel) is tests/layers/'s."""

import inspect

import numpy as np
from flax import nnx

from gdn_jax.layers import TokenMixer
from gdn_jax.models import MIXERS, LanguageModel, ModelConfig, build_mixer

# The interface tests read the layers' types and signatures, not their values: built
# abstractly, no parameter's initialiser is compiled.


def test_every_mixer_name_builds_its_layer():
    config = ModelConfig(vocab_size=50, d_model=16, mixers=tuple(MIXERS))
    model = nnx.eval_shape(lambda: LanguageModel(config, rngs=nnx.Rngs(0)))
    for name, block in zip(MIXERS, model.blocks, strict=True):
        assert type(block.mixer) is MIXERS[name].layer, name
    layers = dict(zip(MIXERS, model.blocks, strict=True))
    assert layers["attention"].mixer.convs is None
    assert layers["attention_conv"].mixer.convs is not None


def test_every_mixer_implements_the_declared_interface():
    config = ModelConfig(vocab_size=50, d_model=16, mixers=tuple(MIXERS), chunk_size=16)
    for name in MIXERS:
        mixer = nnx.eval_shape(lambda name=name: build_mixer(config, name, rngs=nnx.Rngs(0)))
        assert isinstance(mixer, TokenMixer), name
        for method in ("__call__", "init_cache", "prefill", "step"):
            declared = inspect.signature(getattr(TokenMixer, method)).parameters
            actual = inspect.signature(getattr(type(mixer), method)).parameters
            # The same names, kinds and defaults: no argument accepted and ignored.
            assert [(p.name, p.kind, p.default) for p in actual.values()] == [
                (p.name, p.kind, p.default) for p in declared.values()
            ], (name, method)


KINDS = ("gdn", "kda", "attention")


def test_mixer_init_std_draws_the_projections_of_every_kind_of_mixer():
    """The mixers' projection kernels (``common_kwargs``, which every mixer's build gets)
    are drawn from N(0, mixer_init_std^2), which overrides init_std (the embedding's). One
    mixer of each kind: a head-gated, a channel-gated and attention."""
    config = ModelConfig(vocab_size=64, d_model=32, init_std=0.125, mixer_init_std=0.02)
    for name in KINDS:
        mixer = build_mixer(config, name, rngs=nnx.Rngs(0))
        kernels = [
            np.asarray(value.get_value())
            for path, value in nnx.to_flat_state(nnx.state(mixer, nnx.Param))
            if path[-1] == "kernel" and "proj" in str(path[0]) and np.size(value.get_value()) >= 512
        ]
        assert kernels, name
        for kernel in kernels:
            assert abs(float(np.std(kernel)) - 0.02) < 0.004, name


def test_low_rank_gates_reaches_kda_alone():
    """``ModelConfig.low_rank_gates`` is KDA's constructor argument: false gives its full-rank
    forget gate ``f_proj`` in place of ``f_b_proj(f_a_proj(x))``; the other mixers ignore it."""
    for low_rank in (True, False):
        config = ModelConfig(vocab_size=50, d_model=16, low_rank_gates=low_rank)
        kda = nnx.eval_shape(lambda c=config: build_mixer(c, "kda", rngs=nnx.Rngs(0)))
        assert (kda.f_proj is None) is low_rank
        assert (kda.f_a_proj is None) is not low_rank
    config = ModelConfig(vocab_size=50, d_model=16, low_rank_gates=False)
    gdn2 = nnx.eval_shape(lambda: build_mixer(config, "gdn2", rngs=nnx.Rngs(0)))
    assert gdn2.f_a_proj is not None
