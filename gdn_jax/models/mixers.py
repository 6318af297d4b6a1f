"""The mixer registry: every token mixer a ``LanguageModel`` layer can be, by name.

A mixer is one layer module (a ``layers.TokenMixer``) plus one entry in ``MIXERS``: how to
build it from a ``ModelConfig`` and one line that says what it is. The config's allowed
names (``ModelConfig.mixers``), ``build_mixer`` (in ``lm.py``), the sweep's ``--mixers`` and the tests that
every mixer must pass (``tests/models/test_mixers.py``) all read this table;
docs/architecture.md says how to add one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from flax import nnx

from gdn_jax.layers import (
    DeltaNet,
    GatedDeltaNet,
    GatedDeltaNet2,
    GatedDeltaProduct,
    GatedLinearAttention,
    KimiDeltaAttention,
    LinearAttention,
    SoftmaxAttention,
    TokenMixer,
)


@dataclasses.dataclass(frozen=True)
class MixerSpec:
    """One registered mixer: ``build(config, common)`` makes its ``layer`` (a class) from a
    ``ModelConfig`` and the keyword arguments every mixer takes (``common_kwargs``)."""

    layer: type
    build: Callable[..., TokenMixer]
    summary: str  # what it is, in a line (the README's results table says the same)


def recurrent_kwargs(config) -> dict:
    """What every recurrent mixer takes from the config besides its head layout."""
    return dict(
        expand_v=config.expand_v,
        num_v_heads=config.num_v_heads,
        use_gate=config.use_gate,
        use_short_conv=config.use_short_conv,
        conv_size=config.conv_size,
        norm_eps=config.norm_eps,
        chunk_size=config.chunk_size,
        impl=config.impl,
        schedule=config.schedule,
    )


def recurrent(
    layer, *, negative_eigenvalues: bool, gate_init: str | None, options: tuple[str, ...] = ()
) -> Callable[..., TokenMixer]:
    """The builder of a recurrent ``layer``; ``negative_eigenvalues``: whether it takes the
    model-wide ``allow_neg_eigval`` (the mixers with a delta correction); ``gate_init``: the
    config field that holds its decay gate's initial law (``"head_gate_init"`` or
    ``"channel_gate_init"``), or ``None`` for a mixer without a decay gate; ``options``: the
    config fields it takes as constructor arguments of the same name."""

    def build(config, common):
        extra = dict(allow_neg_eigval=config.allow_neg_eigval) if negative_eigenvalues else {}
        extra.update({name: getattr(config, name) for name in options})
        if gate_init is not None:
            extra["gate_init"] = getattr(config, gate_init)
        heads = (config.d_model, config.num_heads, config.key_head_dim)
        return layer(*heads, **recurrent_kwargs(config), **extra, **common)

    return build


def delta_product(config, common) -> TokenMixer:
    """Gated DeltaProduct with the config's ``num_householder`` steps a token."""
    heads = (config.d_model, config.num_heads, config.key_head_dim)
    return GatedDeltaProduct(
        *heads, **recurrent_kwargs(config), allow_neg_eigval=config.allow_neg_eigval,
        num_householder=config.num_householder, gate_init=config.head_gate_init, **common,
    )  # fmt: skip


def attention(*, short_conv: bool) -> Callable[..., TokenMixer]:
    def build(config, common):
        return SoftmaxAttention(
            config.d_model,
            config.num_heads,
            config.key_head_dim,
            window=config.window,
            rope_theta=config.rope_theta,
            use_short_conv=short_conv,
            conv_size=config.conv_size,
            **common,
        )

    return build


MIXERS: dict[str, MixerSpec] = {
    "gdn": MixerSpec(
        GatedDeltaNet,
        recurrent(GatedDeltaNet, negative_eigenvalues=True, gate_init="head_gate_init"),
        "Gated DeltaNet: decay and delta correction",
    ),
    "deltanet": MixerSpec(
        DeltaNet,
        recurrent(DeltaNet, negative_eigenvalues=True, gate_init=None),
        "DeltaNet: delta correction, no decay (`log_alpha = 0`)",
    ),
    "gated_linear": MixerSpec(
        GatedLinearAttention,
        recurrent(GatedLinearAttention, negative_eigenvalues=False, gate_init="head_gate_init"),
        "gated linear attention, Mamba2-style scalar decay, no delta",
    ),
    "linear": MixerSpec(
        LinearAttention,
        recurrent(LinearAttention, negative_eigenvalues=False, gate_init=None),
        "plain linear attention: neither",
    ),
    "kda": MixerSpec(
        KimiDeltaAttention,
        recurrent(
            KimiDeltaAttention,
            negative_eigenvalues=True,
            gate_init="channel_gate_init",
            options=("low_rank_gates",),
        ),
        "Kimi Delta Attention: delta correction, one decay per key channel",
    ),
    "gdn2": MixerSpec(
        GatedDeltaNet2,
        recurrent(GatedDeltaNet2, negative_eigenvalues=True, gate_init="channel_gate_init"),
        "Gated DeltaNet-2: per-channel decay, erase gate on the keys, write gate on the values",
    ),
    "gated_deltaproduct": MixerSpec(
        GatedDeltaProduct,
        delta_product,
        "Gated DeltaProduct: `num_householder` delta steps a token, one decay",
    ),
    "attention": MixerSpec(
        SoftmaxAttention,
        attention(short_conv=False),
        "causal softmax attention with rotary embeddings",
    ),
    # The control that separates what the convolution contributes to recall from the mixer.
    "attention_conv": MixerSpec(
        SoftmaxAttention,
        attention(short_conv=True),
        "attention with the short convolutions of the recurrent mixers",
    ),
}


def common_kwargs(config, rngs: nnx.Rngs) -> dict:
    """The dtypes, the projections' initialisation and the random streams of every mixer."""
    return dict(
        dtype=config.jnp_dtype,
        param_dtype=config.jnp_param_dtype,
        kernel_init=nnx.initializers.normal(
            config.init_std if config.mixer_init_std is None else config.mixer_init_std
        ),
        rngs=rngs,
    )
