"""A causal language model whose blocks use any registered token mixer (``mixers.py``)."""

from __future__ import annotations

import functools
from typing import no_type_check

import jax.numpy as jnp
from flax import nnx

from gdn_jax.layers import SwiGLU, TokenMixer, input_checks
from gdn_jax.layers.dense import projection_dot_general
from gdn_jax.layers.params import check_build_args
from gdn_jax.models.config import ModelConfig
from gdn_jax.models.mixers import MIXERS, common_kwargs
from gdn_jax.ops import checks


@no_type_check  # a public entry point: it names a bad argument itself
def build_mixer(config: ModelConfig, name: str, *, rngs: nnx.Rngs) -> TokenMixer:
    """The mixer ``name`` (a key of ``MIXERS``) built from ``config`` (a ``ModelConfig``).

    It sits here, above the registry: ``ModelConfig`` reads the registry's names, so the
    registry cannot import the config back to check one."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"build_mixer: config must be a ModelConfig, got {type(config).__name__}")
    if not isinstance(name, str) or name not in MIXERS:
        raise ValueError(f"build_mixer: name={name!r} is not a mixer; allowed: {tuple(MIXERS)}")
    check_build_args("build_mixer", rngs=rngs)
    return MIXERS[name].build(config, common_kwargs(config, rngs))


class Block(nnx.Module):
    """``x + mixer(norm(x))``, then ``x + mlp(norm(x))`` when the config has an MLP."""

    def __init__(self, config: ModelConfig, mixer: str, *, rngs: nnx.Rngs):
        norm = dict(
            epsilon=config.norm_eps, dtype=config.jnp_dtype, param_dtype=config.jnp_param_dtype
        )
        self.mixer_norm = nnx.RMSNorm(config.d_model, **norm, rngs=rngs)
        self.mixer = build_mixer(config, mixer, rngs=rngs)
        # Assigned once each: NNX fixes an attribute's data/static status at first assignment.
        self.mlp_norm = nnx.RMSNorm(config.d_model, **norm, rngs=rngs) if config.use_mlp else None
        mlp = (
            SwiGLU(
                config.d_model,
                config.mlp_width,
                dtype=config.jnp_dtype,
                param_dtype=config.jnp_param_dtype,
                kernel_init=nnx.initializers.normal(config.init_std),
                rngs=rngs,
            )
            if config.use_mlp
            else None
        )
        self.mlp = mlp

    def _mlp(self, x):
        return x if self.mlp is None else x + self.mlp(self.mlp_norm(x))

    def __call__(self, x, *, mask=None, cu_seqlens=None):
        return self._mlp(x + self.mixer(self.mixer_norm(x), mask=mask, cu_seqlens=cu_seqlens))

    def prefill(self, x, cache, *, mask=None):
        y, cache = self.mixer.prefill(self.mixer_norm(x), cache, mask=mask)
        return self._mlp(x + y), cache

    def step(self, x, cache):
        y, cache = self.mixer.step(self.mixer_norm(x), cache)
        return self._mlp(x + y), cache


@functools.lru_cache(maxsize=256)  # a sweep checks many cells of a few models
def check_buildable(config: ModelConfig) -> ModelConfig:
    """Raise the ``ValueError`` that building ``config``'s model would raise, without
    allocating it: the config's own rules, then each layer constructor's."""
    nnx.eval_shape(lambda: LanguageModel(config, rngs=nnx.Rngs(0)))
    return config


class LanguageModel(nnx.Module):
    """Token embedding, ``len(config.mixers)`` blocks, final RMSNorm, LM head.

    Token ids must lie in ``[0, vocab_size)`` (padding, where a mask is 0, excepted): eager
    calls check them; under ``jit``, where they are traced, an id outside is clipped to
    ``0`` or ``vocab_size - 1``, never NaN and never wrapped around.

    ``__call__`` maps tokens ``[B, T]`` to logits ``[B, T, vocab]``; ``hidden`` and ``logits``
    split that in two so a loss can apply the head only where there are labels. Decoding:
    ``init_cache``, ``prefill`` a (left-padded) prompt, then ``step`` one token at a time.
    """

    @no_type_check  # it names a bad argument itself
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, ModelConfig):
            raise TypeError(
                f"LanguageModel: config must be a ModelConfig, got {type(config).__name__} "
                f"{config!r:.60}; build one with ModelConfig(**fields)"
            )
        check_build_args("LanguageModel", rngs=rngs)
        self.config = config.validate()
        self.embed = nnx.Embed(
            config.vocab_size,
            config.d_model,
            dtype=config.jnp_dtype,
            param_dtype=config.jnp_param_dtype,
            embedding_init=nnx.initializers.normal(config.init_std),
            rngs=rngs,
        )
        self.blocks = nnx.List([Block(config, name, rngs=rngs) for name in config.mixers])
        self.norm = nnx.RMSNorm(
            config.d_model,
            epsilon=config.norm_eps,
            dtype=config.jnp_dtype,
            param_dtype=config.jnp_param_dtype,
            rngs=rngs,
        )
        head = (
            nnx.Linear(
                config.d_model,
                config.vocab_size,
                use_bias=False,
                dtype=config.jnp_dtype,
                param_dtype=config.jnp_param_dtype,
                kernel_init=nnx.initializers.normal(config.init_std),
                dot_general=projection_dot_general,
                rngs=rngs,
            )
            if not config.tie_embeddings
            else None
        )
        self.lm_head = head

    def _embed(self, tokens, mask=None):
        name, vocab_size = "LanguageModel", self.config.vocab_size
        checks.check_arrays(name, tokens=tokens)
        checks.require(
            name,
            tokens.ndim == 2 and tokens.shape[1] >= 1 and jnp.issubdtype(tokens.dtype, jnp.integer),
            f"tokens must be integer ids [B, T] with T >= 1, got shape {tokens.shape} and dtype "
            f"{tokens.dtype}",
        )
        if mask is not None:
            input_checks.check_mask(name, mask, *tokens.shape)
        input_checks.check_token_ids(name, "tokens", tokens, vocab_size, mask)
        # Traced ids go unchecked: clipped, an id outside the vocabulary reads the nearest row,
        # where the lookup would give NaN above it and wrap negative ids around.
        return self.embed(jnp.clip(tokens, 0, vocab_size - 1))

    def hidden(self, tokens, *, mask=None, cu_seqlens=None):
        """Final normalised hidden states ``[B, T, D]``."""
        x = self._embed(tokens, mask)
        # Checked in the model's view (its tokens), before the layers check it in theirs.
        cu_seqlens = input_checks.check_packed("LanguageModel", cu_seqlens, tokens, "tokens")
        for block in self.blocks:
            x = block(x, mask=mask, cu_seqlens=cu_seqlens)
        return self.norm(x)

    def logits(self, hidden):
        """The LM head on hidden states of any leading shape ``[..., D] -> [..., vocab]``."""
        return self.embed.attend(hidden) if self.lm_head is None else self.lm_head(hidden)

    def __call__(self, tokens, *, mask=None, cu_seqlens=None):
        return self.logits(self.hidden(tokens, mask=mask, cu_seqlens=cu_seqlens))

    def init_cache(self, batch_size: int, max_len: int) -> tuple:
        """Per-layer caches; ``max_len`` bounds prompt plus generated tokens (attention only)."""
        return tuple(block.mixer.init_cache(batch_size, max_len) for block in self.blocks)

    def _check_cache(self, cache):
        checks.require(
            "LanguageModel",
            isinstance(cache, tuple) and len(cache) == len(self.blocks),
            f"cache must be a tuple of {len(self.blocks)} layer caches (from init_cache), got "
            f"{type(cache).__name__} of length {len(cache) if isinstance(cache, tuple) else '-'}",
        )

    def prefill(self, tokens, cache, *, mask=None):
        """Run a prompt ``[B, T]`` (left-padded with ``mask``): ``(logits, cache)``. A row
        padded elsewhere would decode on from a pad token: a concrete ``mask`` is checked."""
        self._check_cache(cache)
        x, new_cache = self._embed(tokens, mask), []
        if mask is not None:
            input_checks.check_left_padding("LanguageModel", mask)
        for block, layer_cache in zip(self.blocks, cache, strict=True):
            x, layer_cache = block.prefill(x, layer_cache, mask=mask)
            new_cache.append(layer_cache)
        return self.logits(self.norm(x)), tuple(new_cache)

    def step(self, tokens, cache):
        """One token per row ``[B, 1]``: ``(logits [B, 1, vocab], cache)``."""
        self._check_cache(cache)
        x, new_cache = self._embed(tokens), []
        for block, layer_cache in zip(self.blocks, cache, strict=True):
            x, layer_cache = block.step(x, layer_cache)
            new_cache.append(layer_cache)
        return self.logits(self.norm(x)), tuple(new_cache)
