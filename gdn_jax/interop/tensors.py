"""PyTorch state dicts as plain ``{name: numpy array}`` mappings, checked whole before use."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def as_numpy_dict(fn: str, state_dict) -> dict[str, np.ndarray]:
    """``state_dict`` as ``{name: np.ndarray}``, each value read with ``np.asarray`` (NumPy
    arrays, as ``safetensors.numpy`` and ``tensor.numpy()`` give; bfloat16 through
    ``ml_dtypes``)."""
    if not isinstance(state_dict, Mapping):
        raise ValueError(
            f"{fn}: state_dict must be a mapping of tensor names to arrays, "
            f"got {type(state_dict).__name__}"
        )
    out = {}
    for name, value in state_dict.items():
        if not isinstance(name, str):
            raise ValueError(f"{fn}: state_dict keys must be strings, got {name!r}")
        try:
            array = np.asarray(value)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(
                f"{fn}: tensor {name!r} cannot be read as a NumPy array ({error}); pass "
                "tensor.float().numpy() or what safetensors.numpy gives"
            ) from None
        if not np.issubdtype(array.dtype, np.floating) and array.dtype.name != "bfloat16":
            raise ValueError(f"{fn}: tensor {name!r} must be floating point, got {array.dtype}")
        out[name] = array
    return out


def check_tensors(
    fn: str, tensors: Mapping[str, np.ndarray], expected: Mapping[str, tuple[int, ...]]
) -> None:
    """Raise one ``ValueError`` listing every missing, unexpected or wrongly shaped tensor of
    ``tensors`` against the ``expected`` names and shapes (what the config asks for)."""
    problems = [
        f"missing tensor {name!r} (expected shape {tuple(shape)})"
        for name, shape in expected.items()
        if name not in tensors
    ]
    problems += [
        f"unexpected tensor {name!r} (shape {tuple(array.shape)})"
        for name, array in tensors.items()
        if name not in expected
    ]
    problems += [
        f"tensor {name!r} has shape {tuple(tensors[name].shape)}, the config needs {tuple(shape)}"
        for name, shape in expected.items()
        if name in tensors and tuple(tensors[name].shape) != tuple(shape)
    ]
    if problems:
        raise ValueError(f"{fn}: " + "; ".join(problems))
