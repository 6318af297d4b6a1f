"""Inverse of a unit lower-triangular matrix from matmuls alone.

Blockwise inversion uses only ``dot``, slices and reshapes, runs on every backend and is
batched across chunks and heads by ``vmap``; docs/benchmarks.md records why it is used instead
of ``jax.lax.linalg.triangular_solve``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


@jax.custom_jvp
def unit_lower_inverse(strict: Float[Array, "C C"]) -> Float[Array, "C C"]:
    """``(I + strict)^{-1}`` for strictly lower-triangular ``strict``; ``C`` a power of two.

    Doubling the block size each level, with ``X11``, ``X22`` the inverses of the two
    diagonal blocks and ``A21`` the block below them:

        [[A11, 0], [A21, A22]]^{-1} = [[X11, 0], [-X22 A21 X11, X22]],

    which costs about ``2 C^3 / 3`` flops over ``log2(C)`` levels of batched matmuls.

    Its derivative is the closed form ``d(I + A)^{-1} = -X dA X`` (two products), a
    ``custom_jvp`` so that both modes take it: reverse mode transposes it to ``-X^T dX X^T``
    rather than running back through the levels (whose diagonal blocks, when they were a
    gather, transposed to scatter-adds that XLA:CPU runs as a loop over elements), and
    forward mode runs it where a ``custom_vjp`` could not. The chunked forms call this in
    their hand-written forward and backward, so forward over reverse (``jax.hessian``, a
    Hessian-vector product) through them differentiates it forward.
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


@unit_lower_inverse.defjvp
def _unit_lower_inverse_jvp(primals, tangents):
    (strict,), (d_strict,) = primals, tangents
    inverse = unit_lower_inverse(strict)
    # Only the strict lower triangle of A is read; X (dA X) transposes to (X^T dX) X^T.
    return inverse, -(inverse @ (jnp.tril(d_strict, -1) @ inverse))
