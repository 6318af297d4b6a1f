"""Autoregressive generation under ``jax.jit``: prefill the prompt, then scan token steps."""

from __future__ import annotations

import functools
import numbers
from typing import no_type_check

import jax
import jax.numpy as jnp
from flax import nnx

from gdn_jax.layers import input_checks
from gdn_jax.models.lm import LanguageModel
from gdn_jax.ops import checks


def _pick(logits, key, temperature):
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature"))
def _generate(graphdef, state, prompt, mask, key, *, max_new_tokens, temperature):
    model = nnx.merge(graphdef, state)
    batch, prompt_len = prompt.shape
    cache = model.init_cache(batch, prompt_len + max_new_tokens)
    logits, cache = model.prefill(prompt, cache, mask=mask)
    keys = jax.random.split(key, max_new_tokens)
    first = _pick(logits[:, -1].astype(jnp.float32), keys[0], temperature)

    def body(carry, key):
        token, cache = carry
        logits, cache = model.step(token[:, None], cache)
        following = _pick(logits[:, 0].astype(jnp.float32), key, temperature)
        return (following, cache), following

    _, rest = jax.lax.scan(body, (first, cache), keys[1:])
    return jnp.concatenate([first[:, None], rest.T], axis=1)


@no_type_check  # a public entry point: checks.py names its bad arguments
def generate(model, prompt, *, mask=None, max_new_tokens: int, temperature: float = 0.0, key=None):
    """Continue ``prompt [B, T]`` by ``max_new_tokens`` tokens.

    Args:
      model: a ``LanguageModel``.
      prompt: int tokens ``[B, T]`` in ``[0, vocab_size)``; rows of different lengths are
        left-padded, with ``mask`` ``[B, T]`` (0 or 1) set to 0 on the padding: each row
        zeros, then ones, at least one (a concrete mask is checked).
      max_new_tokens: how many tokens to generate (>= 1).
      temperature: 0 for greedy decoding, else sampling from ``softmax(logits / temperature)``.
      key: PRNG key (``jax.random.key(seed)``, or a raw ``uint32 [2]`` one from
        ``jax.random.PRNGKey``), needed when sampling.

    Returns:
      The generated tokens ``[B, max_new_tokens]`` (int32). One compilation per model
      structure, prompt shape, ``max_new_tokens`` and ``temperature``.
    """
    if not isinstance(model, LanguageModel):  # a layer has no vocabulary to decode from
        raise TypeError(
            f"generate: model must be a LanguageModel, got {type(model).__name__} (a layer "
            "decodes with its prefill and step)"
        )
    checks.require(
        "generate",
        isinstance(max_new_tokens, numbers.Integral)
        and checks.is_real_number(max_new_tokens)
        and bool(max_new_tokens >= 1),
        f"max_new_tokens={max_new_tokens!r} must be >= 1 (an integer)",
    )
    greedy = isinstance(temperature, numbers.Real) and temperature == 0
    if not greedy:
        checks.check_positive_number("generate", temperature=temperature)
    checks.check_arrays("generate", prompt=prompt, mask=mask)
    checks.require(
        "generate",
        prompt.ndim == 2 and prompt.shape[1] >= 1 and jnp.issubdtype(prompt.dtype, jnp.integer),
        f"prompt must be integer tokens [B, T] with T >= 1, got shape {prompt.shape} and dtype "
        f"{prompt.dtype}",
    )
    checks.require(
        "generate",
        temperature == 0 or key is not None,
        "sampling (temperature > 0) needs a PRNG key",
    )
    # Checked here, where they are concrete: inside the jitted decoder nothing could be.
    if mask is not None:
        input_checks.check_mask("generate", mask, *prompt.shape)
    input_checks.check_token_ids("generate", "prompt", prompt, model.config.vocab_size, mask)
    if mask is not None:
        input_checks.check_left_padding("generate", mask)
    if key is not None:
        input_checks.check_key("generate", key)
    key = jax.random.key(0) if key is None else key
    mask = jnp.ones(prompt.shape, jnp.int32) if mask is None else mask
    graphdef, state = nnx.split(model)
    return _generate(
        graphdef,
        state,
        prompt,
        mask,
        key,
        max_new_tokens=int(max_new_tokens),
        temperature=float(temperature),
    )
