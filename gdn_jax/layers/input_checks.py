"""Trace-time checks of what a layer or a model is called with: hidden states, padding
masks, token ids, decoding caches and PRNG keys. Errors read as in ``gdn_jax.ops.checks``:
``"{fn}: {argument} must ..., got ..."``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gdn_jax.ops.checks import (
    as_cu_seqlens,
    check_arrays,
    check_cu_seqlens,
    check_floating,
    is_concrete,
)


def check_mask(fn: str, mask, batch: int, seq_len: int) -> None:
    """A ``[B, T]`` padding mask of booleans or 0/1 numbers; its values are checked when
    concrete. Broadcasting a ``[T]`` mask over the batch would hide a bug, so it is refused."""
    check_arrays(fn, mask=mask)
    if tuple(mask.shape) != (batch, seq_len):
        raise ValueError(
            f"{fn}: mask must have shape [B, T] = {(batch, seq_len)}, got {mask.shape}"
        )
    if is_concrete(mask) and mask.dtype != bool:
        values = np.unique(np.asarray(mask))
        if not np.isin(values, (0, 1)).all():
            raise ValueError(f"{fn}: mask must hold only 0 and 1, got values {values.tolist()[:8]}")


def check_left_padding(fn: str, mask) -> None:
    """A concrete ``[B, T]`` mask pads each row on the left only: zeros, then ones, and at
    least one one, so that a row's last token is its last real one, which decoding continues
    from. Traced masks cannot be checked."""
    if not is_concrete(mask):
        return
    real = np.asarray(mask).astype(bool)
    for row, tokens in enumerate(real):
        if not tokens.any() or not tokens[tokens.argmax() :].all():
            shown = tokens.astype(int).tolist()
            shown = shown if len(shown) <= 16 else [*shown[:8], "...", *shown[-8:]]
            raise ValueError(
                f"{fn}: mask row {row} must be left padding (zeros, then ones, at least one "
                f"one), got {shown}"
            )


def check_token_ids(fn: str, name: str, tokens, vocab_size: int, mask=None) -> None:
    """Token ids ``name`` lie in ``[0, vocab_size)``, checked when ``tokens`` (and ``mask``) are
    concrete; where ``mask`` is 0 an id is padding and may be anything. Traced ids cannot be
    checked: the model clips them instead (``LanguageModel``)."""
    if not (is_concrete(tokens) and is_concrete(mask)):
        return
    ids = np.asarray(tokens)
    if mask is not None:
        ids = ids[np.asarray(mask).astype(bool)]
    outside = np.unique(ids[(ids < 0) | (ids >= vocab_size)])
    if outside.size:
        raise ValueError(
            f"{fn}: {name} must be ids in [0, vocab_size={vocab_size}), got {outside.tolist()[:8]}"
        )


def check_key(fn: str, key) -> None:
    """One PRNG key: a typed one (``jax.random.key``, shape ``()``) or a legacy raw
    ``uint32 [2]`` (``jax.random.PRNGKey``); an int seed is not a key."""
    dtype = getattr(key, "dtype", None)
    typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    typed = typed and np.shape(key) == ()
    raw = dtype == jnp.uint32 and np.shape(key) == (2,)
    if not (typed or raw):
        described = (
            repr(key) if dtype is None else f"an array of shape {np.shape(key)} and dtype {dtype}"
        )
        raise ValueError(f"{fn}: key must be a PRNG key from jax.random.key(seed), got {described}")


def check_hidden(fn: str, x, hidden_size: int) -> None:
    """A layer input ``[B, T, hidden_size]`` with at least one token, floating as the ops
    take their inputs (``checks.check_floating``): integers there are token ids, which
    ``LanguageModel`` embeds before its layers."""
    check_arrays(fn, x=x)
    if x.ndim != 3 or x.shape[-1] != hidden_size or x.shape[1] < 1:
        raise ValueError(
            f"{fn}: x must have shape [B, T, hidden_size] with hidden_size={hidden_size} and "
            f"T >= 1, got {x.shape}"
        )
    check_floating(fn, x=x)


def check_packed(fn: str, cu_seqlens, x, name: str = "x"):
    """A layer's or model's ``cu_seqlens`` for its input ``x [B, T, ...]`` (checked first),
    called ``name``, as an array (``as_cu_seqlens``; None stays None). Checked here rather
    than left to the op, so that the error shows the caller's input, not the heads the layer
    made of it."""
    cu_seqlens = as_cu_seqlens(fn, cu_seqlens)
    if cu_seqlens is not None:
        check_cu_seqlens(fn, cu_seqlens, name, x.shape)
    return cu_seqlens


def _shapes(x):
    """The shape of an array, nested like ``x`` for tuples, None for None."""
    if x is None:
        return None
    if isinstance(x, tuple | list):
        return tuple(_shapes(item) for item in x)
    return tuple(np.shape(x))


def check_cache(fn: str, cache, expected) -> None:
    """A decoding ``cache`` has the type and, field by field, the shapes of ``expected``, the
    layer's own empty cache for this batch (its ``init_cache`` under ``jax.eval_shape``). A
    cache of another layer, batch size, head count or head dim, or with or without
    convolution histories where the layer differs, is refused naming the field."""
    if type(cache) is not type(expected):
        raise ValueError(
            f"{fn}: cache must be a {type(expected).__name__} (from init_cache), "
            f"got {type(cache).__name__}"
        )
    for name in expected._fields:
        want, got = _shapes(getattr(expected, name)), _shapes(getattr(cache, name))
        if got != want:
            raise ValueError(
                f"{fn}: cache.{name} must have shape {want} for this layer and batch, got {got}"
            )
