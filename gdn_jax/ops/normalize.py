"""Feature normalisation used around the delta rule."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x / sqrt(sum(x**2) + eps)`` over the last axis (flash-linear-attention's ``l2norm``).

    The delta rule's correction ``S (I - beta k k^T)`` is a contraction only for
    ``beta ||k||^2 <= 2``; unit-norm keys make every ``beta`` in ``[0, 2]`` safe.
    """
    return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + eps)
