"""What one chunk writes, as WY factors that need no state: ``U = u - w S^T``.

Every rule of the family writes its corrections this way; ``two_products`` and its backward
are the shared part, ``DELTA`` and ``LINEAR`` the scalar-decay rules' (the per-channel ones,
KDA and GDN-2, build their system in ``ops/chunked/channel.py``).

Inside a chunk starting from state ``S`` (Yang et al., 2025, Sec. 3.3), token ``t`` writes
the correction ``U_t = beta_t (v_t - alpha_t S_{t-1} k_t)`` along ``k_t``. Substituting
``S_{t-1}`` gives a unit lower-triangular system for all corrections at once (the UT transform)

    (I + A) U = diag(beta) V - diag(beta exp(g)) K S^T,   A_ti = beta_t exp(g_t - g_i) k_t.k_i, i < t

so with ``T = (I + A)^{-1}`` the corrections are ``U = u - w S^T`` for the WY factors
``u = T diag(beta) V`` and ``w = T diag(beta exp(g)) K``, which depend on the chunk's own tokens
only and are computed for all chunks at once. Without the delta correction (gated linear
attention) ``U = diag(beta) V`` and there is no ``w``.

Backward, from the cotangent ``dU`` of the corrections: ``U = T (diag(beta) V -
diag(beta exp(g)) K S^T)``, so with ``dVb = T^T dU`` the cotangents of ``diag(beta) V`` and
``diag(beta exp(g)) K`` are ``dVb`` and ``-dVb S``, and that of ``A`` is ``-dVb U^T`` on the
strict lower triangle, since ``d(I + A)^{-1} = -T dA T``. Neither ``w`` nor ``u`` is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Float

from gdn_jax.ops.chunked.decays import ChunkDecays
from gdn_jax.ops.chunked.triangular import unit_lower_inverse


class FactorGrads(NamedTuple):
    """Cotangents from the WY factors of one chunk. ``gram`` is that of ``k k^T`` (``None``
    without the delta correction), left for the caller to fold into its own ``dk`` product."""

    k: Float[Array, "C K"]
    gram: Float[Array, "C C"] | None
    v: Float[Array, "C V"]
    beta: Float[Array, " C"]
    within: Float[Array, "C C"]
    from_start: Float[Array, " C"]


def two_products(strict, erase, write):
    """``(w = T erase [C, K], u = T write [C, V], T [C, C])`` for ``T = (I + strict)^{-1}``,
    ``strict`` strictly lower triangular: the WY factors of every delta rule of the family,
    whatever its decays. They are two products with ``T``: one with ``[erase | write]``
    made XLA:TPU keep the product and its two halves at once, and ran slower on CPU."""
    inverse = unit_lower_inverse(strict)
    return inverse @ erase, inverse @ write, inverse


def two_products_bwd(inverse, start, corrections, d_corrections):
    """``(d_write, d_erase, d_strict)`` from the cotangent ``dU`` of the corrections ``U = u
    - w S^T`` (module docstring), given ``T``, the start state ``S`` and ``U``."""
    d_write = inverse.T @ d_corrections
    return d_write, -(d_write @ start), -jnp.tril(d_write @ corrections.T, -1)


def delta_factors(k, v, beta, decays: ChunkDecays):
    """``(w [C, K], u [C, V], T [C, C])`` for k ``[C, K]``, v ``[C, V]``, beta ``[C]``: the
    erase vectors ``diag(beta exp(g)) K``, the writes ``diag(beta) V``."""
    strict = jnp.tril(beta[:, None] * (k @ k.T) * decays.within, -1)
    return two_products(strict, k * (beta * decays.from_start)[:, None], v * beta[:, None])


def delta_factors_bwd(
    k, v, beta, decays: ChunkDecays, inverse, start, corrections, d_corrections
) -> FactorGrads:
    """The cotangents from ``dU [C, V]`` given ``T``, the start state ``S`` and ``U``.

    ``k k^T`` is formed again here rather than passed in: XLA merges the two products in one
    program unless they are kept apart, as the hoisted backward does off CPU, which forms it
    again after its loop rather than keep a ``[C, C]`` array per chunk through it."""
    gram = k @ k.T
    d_v_beta, d_k_beta, d_strict = two_products_bwd(inverse, start, corrections, d_corrections)
    d_decayed = d_strict * decays.within  # cotangent of beta_t * (k k^T)_ti
    d_k_proj = (d_k_beta * k).sum(1)
    return FactorGrads(
        k=d_k_beta * (beta * decays.from_start)[:, None],
        gram=d_decayed * beta[:, None],
        v=d_v_beta * beta[:, None],
        beta=(d_v_beta * v).sum(1) + decays.from_start * d_k_proj + (d_decayed * gram).sum(1),
        within=d_strict * beta[:, None] * gram,
        from_start=beta * d_k_proj,
    )


def linear_factors(k, v, beta, decays: ChunkDecays):
    """``(None, u = diag(beta) V, None)``: each token writes its own value."""
    del k, decays
    return None, v * beta[:, None], None


def linear_factors_bwd(
    k, v, beta, decays: ChunkDecays, inverse, start, corrections, d_corrections
) -> FactorGrads:
    """The cotangents from ``dU`` of ``U = diag(beta) V``."""
    del inverse, start, corrections
    zero = jnp.zeros_like(beta)
    return FactorGrads(
        k=jnp.zeros_like(k),
        gram=None,
        v=d_corrections * beta[:, None],
        beta=(d_corrections * v).sum(1),
        within=jnp.zeros_like(decays.within),
        from_start=zero,
    )


class WriteRule(NamedTuple):
    """How a chunk's tokens write to the state, for the scalar-decay rules of
    ``ops/chunked/scalar.py``: their factors and the factors' backward."""

    factors: Callable
    factors_bwd: Callable


DELTA = WriteRule(delta_factors, delta_factors_bwd)
LINEAR = WriteRule(linear_factors, linear_factors_bwd)
