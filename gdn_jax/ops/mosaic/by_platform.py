"""A kernel call whose form is chosen when the program is lowered: compiled for CUDA,
interpreted for any other platform.

Tracing on a host without a GPU cannot tell whether the program will be lowered for one:
``jax.jit(f).trace(args placed on a GPU target's device).lower()`` lowers for CUDA what was
traced on a CPU. ``jax.lax.platform_dependent`` cannot choose here: an interpreted kernel's
callbacks are ordered effects, which a branch without them cannot stand beside. So one
primitive carries both forms and its lowering rule for each platform lowers one: the
interpreted form's effects are the primitive's, and the compiled form passes their tokens
through unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.extend import core as jex_core
from jax.interpreters import batching, mlir

kernel_p = jex_core.Primitive("gdn_jax_mosaic_kernel")
kernel_p.multiple_results = True


class _Forms:
    """The two forms of one kernel call on flat arguments, with the interpreted form's output
    shapes and effects. Hashed by identity: each call binds its own."""

    def __init__(self, compiled: Callable, interpreted: Callable, out_avals, effects, refusal):
        self.compiled, self.interpreted = compiled, interpreted
        self.out_avals, self.effects = tuple(out_avals), effects
        self.refusal = refusal


def call(compiled: Callable, interpreted: Callable, *args, refusal=lambda: None):
    """``compiled(*args)`` where the program is lowered for CUDA, ``interpreted(*args)``
    elsewhere (both take and return pytrees of arrays). ``refusal() -> str | None``: why
    the interpreted form cannot run here, asked when it is lowered (a RuntimeError)."""
    flat, tree = jax.tree.flatten(args)

    def flat_form(form):
        return lambda *xs: jax.tree.leaves(form(*jax.tree.unflatten(tree, xs)))

    traced, shapes = jax.make_jaxpr(
        lambda *xs: interpreted(*jax.tree.unflatten(tree, xs)), return_shape=True
    )(*flat)
    forms = _Forms(
        flat_form(compiled), flat_form(interpreted), traced.out_avals, traced.effects, refusal
    )
    out_tree = jax.tree.structure(shapes)
    return jax.tree.unflatten(out_tree, kernel_p.bind(*flat, forms=forms))


def _abstract_eval(*avals, forms):
    del avals
    return forms.out_avals, forms.effects


def _lowering(which: str):
    def lower(ctx, *args, forms):
        if which == "interpreted" and (reason := forms.refusal()) is not None:
            raise RuntimeError(reason)
        return mlir.lower_fun(getattr(forms, which), multiple_results=True)(ctx, *args)

    return lower


def _batched(args, dims, *, forms):
    """vmap: both forms vmapped, the batch axis first."""
    moved = [
        x if d is None else jax.numpy.moveaxis(x, d, 0) for x, d in zip(args, dims, strict=True)
    ]
    in_axes = tuple(None if d is None else 0 for d in dims)
    outs = call(
        jax.vmap(lambda *xs: forms.compiled(*xs), in_axes=in_axes),
        jax.vmap(lambda *xs: forms.interpreted(*xs), in_axes=in_axes),
        *moved,
        refusal=forms.refusal,
    )
    return outs, [0] * len(outs)


kernel_p.def_effectful_abstract_eval(_abstract_eval)
mlir.register_lowering(kernel_p, _lowering("interpreted"))
mlir.register_lowering(kernel_p, _lowering("compiled"), platform="cuda")
batching.primitive_batchers[kernel_p] = _batched
