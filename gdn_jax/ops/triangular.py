"""Inverse of a unit lower-triangular matrix from matmuls alone.

Blockwise inversion uses only ``dot``, slices and reshapes, runs on every backend and is
batched across chunks and heads by ``vmap``; docs/benchmarks.md records why it is used instead
of ``jax.lax.linalg.triangular_solve``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


@jax.custom_vjp
def unit_lower_inverse(strict: Float[Array, "C C"]) -> Float[Array, "C C"]:
    """``(I + strict)^{-1}`` for strictly lower-triangular ``strict``; ``C`` a power of two.

    Doubling the block size each level, with ``X11``, ``X22`` the inverses of the two
    diagonal blocks and ``A21`` the block below them:

        [[A11, 0], [A21, A22]]^{-1} = [[X11, 0], [-X22 A21 X11, X22]],

    which costs about ``2 C^3 / 3`` flops over ``log2(C)`` levels of batched matmuls.

    Its gradient (taken by autodiff in the KDA chunked form) is the closed form of
    ``d(I + A)^{-1} = -X dA X``, two products, rather than autodiff back through the
    levels (whose diagonal blocks, when they were a gather, transposed to scatter-adds that
    XLA:CPU runs as a loop over elements).
    """
    size = strict.shape[-1]
    if size & (size - 1):
        raise ValueError(f"unit_lower_inverse: size {size} must be a power of two")
    # The A21 blocks of every level, found by halving the diagonal blocks with slices: a
    # diagonal taken across blocks would be a gather, which XLA:TPU runs as a while loop.
    below = {}
    diag, block = strict[None], size // 2
    while block >= 1:
        below[block] = diag[:, block:, :block]
        halves = jnp.stack([diag[:, :block, :block], diag[:, block:, block:]], axis=1)
        diag, block = halves.reshape(-1, block, block), block // 2
    inverse = jnp.ones((size, 1, 1), strict.dtype)  # the 1x1 diagonal blocks of I + strict
    block = 1
    while block < size:
        x11, x22 = inverse[0::2], inverse[1::2]
        x21 = -(x22 @ below[block] @ x11)
        top = jnp.concatenate([x11, jnp.zeros_like(x11)], axis=2)
        bottom = jnp.concatenate([x21, x22], axis=2)
        inverse = jnp.concatenate([top, bottom], axis=1)
        block *= 2
    return inverse[0]


def _unit_lower_inverse_fwd(strict):
    inverse = unit_lower_inverse(strict)
    return inverse, inverse


def _unit_lower_inverse_bwd(inverse, d_inverse):
    # The pullback of X = (I + A)^{-1} is -X^T dX X^T, on the strict lower triangle of A.
    return (-jnp.tril(inverse.T @ d_inverse @ inverse.T, -1),)


unit_lower_inverse.defvjp(_unit_lower_inverse_fwd, _unit_lower_inverse_bwd)
