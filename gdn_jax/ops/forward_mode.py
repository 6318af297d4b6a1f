"""Forward-mode autodiff through the chunked forms: one named ``ValueError`` on every route.

The chunked forms' gradient is a hand-derived reverse-mode rule (a ``jax.custom_vjp``),
which JAX can transpose but not run forward. Whether a call is differentiated forward is not
known when the op is traced: under ``jax.jit``, ``nnx.jit`` or ``jax.linearize`` JAX first
traces the op and differentiates the traced program afterwards, and forward over reverse
(``jax.hessian``, a ``jax.jvp`` of ``jax.grad``) reaches the op with forward-mode tracers
that are never run through it forward. So the question is asked where the answer is
decided: the inputs pass through an identity whose tangents go through ``_REVERSE_ONLY``, a
primitive that is linear with the identity as its transpose, and that raises the error
wherever it would be computed (evaluated, batched as ``jax.jacfwd`` does, or compiled).
Reverse mode only transposes it, so the reverse-mode program is unchanged; forward over
reverse transposes it inside and differentiates the transposed program, which holds none.
``jax.linearize`` of a function that calls the op is refused when it traces the op, since
its trace says it is no ``jax.vjp``; of a ``jax.jit`` of one, when its linear function runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir


def _refuse(*args, message: str, **kwargs):
    raise ValueError(message)


_REVERSE_ONLY = Primitive("reverse_mode_only")
_REVERSE_ONLY.multiple_results = True
_REVERSE_ONLY.def_impl(_refuse)
_REVERSE_ONLY.def_abstract_eval(lambda *avals, message: avals)
ad.primitive_jvps[_REVERSE_ONLY] = lambda primals, tangents, *, message: _refuse(message=message)
ad.primitive_transposes[_REVERSE_ONLY] = lambda cts, *args, message: list(cts)
batching.primitive_batchers[_REVERSE_ONLY] = _refuse
mlir.register_lowering(_REVERSE_ONLY, _refuse)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _through(op: tuple[str, str], names: tuple[str, ...], arrays: tuple) -> tuple:
    """``arrays``: the inputs called ``names`` of ``op``, ``(its name, what to use for
    forward mode instead)``."""
    return arrays


@functools.partial(_through.defjvp, symbolic_zeros=True)
def _through_jvp(op, names, primals, tangents):
    (arrays,), (tangents,) = primals, tangents
    live = [i for i, t in enumerate(tangents) if not isinstance(t, SymbolicZero)]
    if not live:
        return arrays, tangents
    message = _message(op, [names[i] for i in live])
    guarded = _REVERSE_ONLY.bind(*(tangents[i] for i in live), message=message)
    out = list(tangents)
    for i, tangent in zip(live, guarded, strict=True):
        out[i] = tangent
    return arrays, tuple(out)


def _message(op: tuple[str, str], reached: list[str]) -> str:
    return (
        f"{op[0]}: forward-mode autodiff (jax.jvp, jax.jacfwd, jax.linearize) reaches "
        f"{', '.join(reached)}, but the chunked form differentiates in reverse mode only (a "
        f"hand-written custom_vjp); for forward mode use {op[1]} (jax.grad, jax.vjp, "
        "jax.hessian and other forward over reverse work with either)"
    )


def _linearized(x) -> bool:
    """Whether ``x`` is an input of ``jax.linearize`` itself, whose linear function would
    run the tangents forward: JAX's linearize trace tells it from ``jax.vjp``'s (its
    ``is_vjp``, a private attribute; a JAX without it answers False)."""
    return getattr(getattr(x, "_trace", None), "is_vjp", True) is False


def reverse_mode_only(fn: str, instead: str, gate_names, q, k, v, gates: tuple, initial_state):
    """``(q, k, v, gates, initial_state)`` as the chunked form of op ``fn`` is to take them
    (``gates`` named ``gate_names``; None entries and Python numbers allowed): forward-mode
    autodiff that reaches any of them raises ``ValueError`` naming ``fn``, those inputs and
    ``instead`` (what to use for forward mode), however the op is traced; reverse mode and
    forward over reverse run as they would without it."""
    names = ("q", "k", "v", *gate_names, "initial_state")
    arrays = (q, k, v, *gates, initial_state)
    traced = [
        i
        for i, x in enumerate(arrays)
        if isinstance(x, jax.core.Tracer) and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    linearized = [names[i] for i in traced if _linearized(arrays[i])]
    if linearized:  # raised here, not when the linear function is first called
        raise ValueError(_message((fn, instead), linearized))
    if traced:  # else nothing here can carry a tangent
        passed = _through(
            (fn, instead), tuple(names[i] for i in traced), tuple(arrays[i] for i in traced)
        )
        arrays = list(arrays)
        for i, x in zip(traced, passed, strict=True):
            arrays[i] = x
    q, k, v, *gates, initial_state = arrays
    return q, k, v, tuple(gates), initial_state


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _once(message: str, arrays: tuple) -> tuple:
    return arrays


@functools.partial(_once.defjvp, symbolic_zeros=True)
def _once_jvp(message, primals, tangents):
    (arrays,), (tangents,) = primals, tangents
    if all(isinstance(t, SymbolicZero) for t in tangents):
        return arrays, tangents
    raise ValueError(message)


def first_order_only(message: str, tree):
    """``tree`` as it is, for a backward that JAX cannot differentiate again (a kernel's):
    differentiating it (forward over reverse, ``jax.hessian``, a gradient of a gradient)
    raises ``ValueError(message)`` when traced, where JAX would fail on the kernel itself."""
    leaves, treedef = jax.tree.flatten(tree)
    floating = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.inexact)]
    passed = _once(message, tuple(leaves[i] for i in floating))
    for i, x in zip(floating, passed, strict=True):
        leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)
