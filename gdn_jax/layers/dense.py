"""The product of the layers' projections, ``x [..., D_in] @ kernel [D_in, D_out]``, with its
pullback written out.

JAX's own pullback forms the kernel's gradient as ``g^T x`` (``[D_out, D_in]``) and then
transposes it. For tokens ``[B, T, D_in]`` XLA:CPU turns that into a copy of the output's
cotangent with the token axis minor, fused into whatever made the cotangent (after a short
convolution: its four shifted taps and the SiLU's derivative, read in transposed order): on
the MQAR training step that copy was a fifth of the step's time. Here the kernel's gradient
is the one product ``x^T g`` over every leading axis, in the kernel's own order, which XLA
computes without moving the cotangent (docs/benchmarks.md, "Projection pullbacks").

Forward-mode autodiff (``jax.jvp``, ``jax.jacfwd``) has no rule for a ``jax.custom_vjp``, so
inputs it traces take ``jax.lax.dot_general`` and its own rules; reverse mode, and forward
over reverse (``jax.hessian``), take the written pullback.
"""

from __future__ import annotations

import functools

import jax
from jaxtyping import Array, Float

from gdn_jax.ops.checks import forward_traced


def _is_linear(lhs, rhs, dimension_numbers) -> bool:
    """Whether ``dimension_numbers`` are ``nnx.Linear``'s: ``lhs``'s last axis against the
    first of a 2-D ``rhs``, no batch axes."""
    contracting, batch = dimension_numbers
    return (
        rhs.ndim == 2
        and lhs.ndim >= 1
        and tuple(map(tuple, contracting)) == ((lhs.ndim - 1,), (0,))
        and tuple(map(tuple, batch)) == ((), ())
    )


def projection_dot_general(
    lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None
):
    """``jax.lax.dot_general`` for ``nnx.Linear(..., dot_general=projection_dot_general)``:
    the same values, with the pullback of ``project`` where ``nnx.Linear`` calls it (its
    product, no output dtype or sharding asked for, no forward-mode tracer); otherwise
    ``jax.lax.dot_general`` itself."""
    plain = (
        forward_traced(lhs)
        or forward_traced(rhs)
        or preferred_element_type is not None
        or out_sharding is not None
        or not _is_linear(lhs, rhs, dimension_numbers)
    )
    if plain:
        return jax.lax.dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision=precision,
            preferred_element_type=preferred_element_type,
            out_sharding=out_sharding,
        )
    return project(lhs, rhs, precision)


def project(
    x: Float[Array, "... D_in"], kernel: Float[Array, "D_in D_out"], precision=None
) -> Float[Array, "... D_out"]:
    """``x @ kernel`` over ``x``'s last axis, with the pullback above."""
    return _project(precision, x, kernel)


def _product(precision, x, kernel):
    return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _project(precision, x, kernel):
    return _product(precision, x, kernel)


def _project_fwd(precision, x, kernel):
    return _product(precision, x, kernel), (x, kernel)


def _project_bwd(precision, residuals, g):
    x, kernel = residuals
    d_x = jax.lax.dot_general(g, kernel, (((g.ndim - 1,), (1,)), ((), ())), precision=precision)
    leading = tuple(range(x.ndim - 1))
    d_kernel = jax.lax.dot_general(x, g, ((leading, leading), ((), ())), precision=precision)
    return d_x.astype(x.dtype), d_kernel.astype(kernel.dtype)


_project.defvjp(_project_fwd, _project_bwd)
