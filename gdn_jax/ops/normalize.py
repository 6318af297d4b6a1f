"""Feature normalisation used around the delta rule."""

from __future__ import annotations

from typing import no_type_check

import jax
import jax.numpy as jnp

from gdn_jax.ops import checks


@no_type_check  # a public entry point: checks.py names its bad arguments
def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x / sqrt(sum(x**2) + eps)`` over the last axis (flash-linear-attention's ``l2norm``):
    ``x`` a floating array, ``eps`` a finite number > 0 (0 made a zero vector NaN).

    The delta rule's correction ``S (I - beta k k^T)`` is a contraction only for
    ``beta ||k||^2 <= 2``; unit-norm keys make every ``beta`` in ``[0, 2]`` safe.
    """
    fn = "l2_normalize"
    checks.check_arrays(fn, x=x)
    checks.check_floating(fn, x=x)
    checks.check_positive_number(fn, eps=eps)
    return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + eps)
