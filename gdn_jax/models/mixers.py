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
from fractions import Fraction

from flax import nnx

from gdn_jax.layers import (
    DeltaNet,
    GatedDeltaNet,
    GatedDeltaNet2,
    GatedDeltaProduct,
    GatedLinearAttention,
    KimiDeltaAttention,
    LinearAttention,
    SimpleGatedLinearAttention,
    SoftmaxAttention,
    TokenMixer,
)
from gdn_jax.ops import checks


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


def gla(config, common) -> TokenMixer:
    """GLA with the config's head layout in flash-linear-attention's terms: ``expand_k`` and
    ``expand_v`` as exact fractions of ``d_model`` (``num_heads * key_head_dim`` and that
    times ``expand_v``), the output gate ``use_gate``; one value head a key head."""
    checks.require(
        "build_mixer",
        config.num_v_heads in (None, config.num_heads),
        f"mixer 'gla' has one value head a key head; num_v_heads={config.num_v_heads} must be "
        f"None or num_heads={config.num_heads}",
    )
    key_dim = config.num_heads * config.key_head_dim
    return GatedLinearAttention(
        config.d_model, expand_k=Fraction(key_dim, config.d_model),
        expand_v=Fraction(key_dim, config.d_model) * Fraction(config.expand_v),
        num_heads=config.num_heads, use_short_conv=config.use_short_conv,
        conv_size=config.conv_size, use_output_gate=config.use_gate, norm_eps=config.norm_eps,
        chunk_size=config.chunk_size, impl=config.impl, schedule=config.schedule, **common,
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
    "simple_gla": MixerSpec(
        SimpleGatedLinearAttention,
        recurrent(
            SimpleGatedLinearAttention, negative_eigenvalues=False, gate_init="head_gate_init"
        ),
        "simple gated linear attention, Mamba2-style scalar decay, no delta",
    ),
    "gla": MixerSpec(
        GatedLinearAttention,
        gla,
        "gated linear attention (GLA): one decay per key channel, no delta",
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


# Mixer names that changed: a config that names one builds the new one, with a
# DeprecationWarning once a process (``ModelConfig``).
RENAMED = {"gated_linear": "simple_gla"}


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
