"""Any gdn_jax layer's parameters under PyTorch's names and in PyTorch's layouts.

A parameter's PyTorch name is its Flax path joined by dots, with the leaf renamed where the
two libraries differ: ``nnx.Linear`` stores ``kernel [in, out]`` where ``nn.Linear`` stores
``weight [out, in]``; a depthwise ``nn.Conv1d`` stores ``[D, 1, W]`` where
``ShortConvolution`` stores ``[W, D]`` (tap ``W-1`` reads the current token in both); a
norm's ``scale`` is PyTorch's ``weight``. Biases and the other vectors keep name and layout.
flash-linear-attention's layers use these names, and the transformers families map theirs
onto them (``family.py``).
"""

from __future__ import annotations

import inspect

import jax.numpy as jnp
import numpy as np
from flax import nnx

from gdn_jax.interop.tensors import as_numpy_dict, check_tensors
from gdn_jax.ops import checks

# How one parameter lies in PyTorch, by the last part of its Flax path.
LINEAR, CONV, SAME = "linear", "conv", "same"


def _torch_name_and_layout(path: tuple[str, ...]) -> tuple[str, str]:
    *module, leaf = path
    if leaf == "kernel":
        return ".".join([*module, "weight"]), LINEAR
    if leaf == "weight" and module and module[-1].endswith("conv1d"):
        return ".".join(path), CONV
    if leaf == "scale":
        return ".".join([*module, "weight"]), SAME
    return ".".join(path), SAME


def _torch_shape(layout: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if layout == LINEAR:
        return shape[::-1]
    if layout == CONV:
        return (shape[1], 1, shape[0])
    return tuple(shape)


def _to_torch(layout: str, x: np.ndarray) -> np.ndarray:
    if layout == LINEAR:
        return np.ascontiguousarray(x.T)
    if layout == CONV:
        return np.ascontiguousarray(x.T[:, None, :])
    return x


def _from_torch(layout: str, x: np.ndarray) -> np.ndarray:
    if layout == LINEAR:
        return x.T
    if layout == CONV:
        return x[:, 0, :].T
    return x


def _torch_names(layer) -> dict[str, tuple[tuple[str, ...], str, tuple]]:
    """``{torch name: (flax path, layout, flax shape)}`` for every parameter of ``layer``."""
    names = {}
    for path, variable in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
        path = tuple(str(p) for p in path)
        name, layout = _torch_name_and_layout(path)
        names[name] = (path, layout, tuple(variable.get_value().shape))
    return names


def _torch_shapes(names: dict) -> dict[str, tuple[int, ...]]:
    return {name: _torch_shape(layout, shape) for name, (_, layout, shape) in names.items()}


def torch_tensor_shapes(layer_class, **layer_kwargs) -> dict[str, tuple[int, ...]]:
    """``{name: PyTorch shape}`` of the state dict that a ``layer_class(**layer_kwargs)``
    holds, from an abstract build (nothing allocated)."""
    layer = nnx.eval_shape(lambda: layer_class(**layer_kwargs, rngs=nnx.Rngs(0)))
    return _torch_shapes(_torch_names(layer))


def load_torch_layer(fn: str, layer_class, state_dict, **layer_kwargs):
    """A ``layer_class(**layer_kwargs)`` holding ``state_dict`` (PyTorch names and layouts).

    ``param_dtype`` casts every tensor; without it each keeps its stored dtype. ``dtype``
    (the compute dtype) defaults to that of ``q_proj.weight``. A missing, unexpected or wrongly
    shaped tensor raises one ``ValueError`` naming each (``fn`` leads the message) before
    anything is built.
    """
    if "rngs" in layer_kwargs:
        raise ValueError(f"{fn}: rngs is not taken; every parameter comes from state_dict")
    _check_layer_kwargs(fn, layer_class, layer_kwargs)
    tensors = as_numpy_dict(fn, state_dict)
    param_dtype = layer_kwargs.pop("param_dtype", None)
    dtype = layer_kwargs.pop("dtype", None)
    checks.check_floating_dtype(fn, dtype=dtype, param_dtype=param_dtype)

    def build(compute, stored):
        return layer_class(**layer_kwargs, dtype=compute, param_dtype=stored, rngs=nnx.Rngs(0))

    names = _torch_names(nnx.eval_shape(lambda: build(jnp.float32, jnp.float32)))
    check_tensors(fn, tensors, _torch_shapes(names))

    wide = [name for name, tensor in tensors.items() if tensor.dtype == np.float64]
    if param_dtype is None and wide:
        try:  # each tensor keeps its float64, which JAX's 64-bit mode must be on to hold
            checks.check_x64(fn, f"state_dict's {wide[0]} of dtype float64", np.float64)
        except ValueError as error:
            raise ValueError(
                f"{error}; or load every tensor as float32 with param_dtype=jnp.float32"
            ) from None
    stored = jnp.dtype(param_dtype or tensors["q_proj.weight"].dtype)
    layer = nnx.eval_shape(lambda: build(jnp.dtype(dtype or stored), stored))
    graphdef, state = nnx.split(layer)
    values = {}
    for name, (path, layout, _) in names.items():
        value = jnp.asarray(_from_torch(layout, tensors[name]), dtype=param_dtype)
        node = values
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    nnx.replace_by_pure_dict(state, values)
    return nnx.merge(graphdef, state)


def _check_layer_kwargs(fn: str, layer_class, layer_kwargs: dict) -> None:
    """``ValueError`` naming the sizes missing from ``layer_kwargs``, or the keywords that
    ``layer_class``'s constructor does not take: Python's own ``TypeError`` names the
    internal class the layer inherits its constructor from."""
    parameters = dict(inspect.signature(layer_class.__init__).parameters)
    for internal in ("self", "rngs"):
        parameters.pop(internal)
    unknown = sorted(set(layer_kwargs) - set(parameters))
    if unknown:
        raise ValueError(
            f"{fn}: {layer_class.__name__} takes no argument {', '.join(unknown)}; it takes "
            f"{', '.join(parameters)}"
        )
    empty = inspect.Parameter.empty
    missing = [n for n, p in parameters.items() if p.default is empty and n not in layer_kwargs]
    if missing:
        raise ValueError(
            f"{fn}: give the layer's sizes as keyword arguments, as to fla's layer: "
            f"{', '.join(f'{name}=...' for name in missing)} are missing"
        )


def torch_state_dict(layer) -> dict[str, np.ndarray]:
    """``layer``'s parameters under PyTorch's names and layouts (``{name: np.ndarray}``, each
    in its parameter dtype), the inverse of ``load_torch_layer``."""
    out = {}
    for path, variable in nnx.to_flat_state(nnx.state(layer, nnx.Param)):
        name, layout = _torch_name_and_layout(tuple(str(p) for p in path))
        out[name] = _to_torch(layout, np.asarray(variable.get_value()))
    return out
