"""Reading tensors from ``*.safetensors`` checkpoints with NumPy (no PyTorch needed)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import no_type_check

import numpy as np

INDEX = "model.safetensors.index.json"


def _files(fn: str, path: Path, prefix: str) -> tuple[list[Path], set[str]]:
    """The files to open and, for a sharded checkpoint, the names its index promises."""
    if path.is_file():
        return [path], set()
    if not path.is_dir():
        raise ValueError(f"{fn}: path {str(path)!r} is neither a file nor a directory")
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{fn}: {index} is not a safetensors index ({error})") from None
        entries = weight_map.items() if isinstance(weight_map, dict) else [(None, None)]
        if not all(isinstance(name, str) and isinstance(file, str) for name, file in entries):
            raise ValueError(
                f"{fn}: {index} field weight_map must map tensor names to shard file names, "
                f"got {str(weight_map)[:80]}"
            )
        names = {name for name in weight_map if name.startswith(prefix)}
        return sorted({path / weight_map[name] for name in names}), names
    single = path / "model.safetensors"
    if single.is_file():
        return [single], set()
    raise ValueError(f"{fn}: directory {str(path)!r} has neither {INDEX} nor model.safetensors")


@no_type_check  # a public entry point: checks.py names its bad arguments
def read_safetensors(path: str | os.PathLike, prefix: str = "") -> dict[str, np.ndarray]:
    """The tensors of a checkpoint whose names start with ``prefix``, with it stripped.

    Args:
      path: a ``*.safetensors`` file, or a directory holding ``model.safetensors.index.json``
        and the shards it names (or a single ``model.safetensors``), as ``save_pretrained``
        writes them; ``~`` is the home.
      prefix: keep only names starting with it, e.g. ``"model.layers.0.linear_attn."`` (end
        it with a dot: ``model.layers.1`` would also match ``model.layers.10``).

    Returns:
      ``{name: np.ndarray}`` in the stored dtypes (bfloat16 as ``ml_dtypes.bfloat16``); cast
      when loading a layer.
    """
    fn = "read_safetensors"
    try:  # the interop extra: the layers' loaders take arrays and need no file reader
        from safetensors import SafetensorError, safe_open
    except ImportError:
        raise ImportError(
            f'{fn} needs the safetensors package: pip install "gdn_jax[interop]"'
        ) from None
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{fn}: path={path!r:.60} must be a file or directory name or a Path")
    if not isinstance(prefix, str):
        raise TypeError(f"{fn}: prefix={prefix!r:.60} must be a string")
    path = Path(path).expanduser()
    files, promised = _files(fn, path, prefix)
    out: dict[str, np.ndarray] = {}
    for file in files:
        if not file.is_file():
            raise ValueError(f"{fn}: the index names {file.name}, which is not in {path}")
        try:
            with safe_open(file, framework="np") as handle:
                for name in handle.keys():
                    if name.startswith(prefix) and (not promised or name in promised):
                        out[name[len(prefix) :]] = handle.get_slice(name)[...]
        except SafetensorError as error:  # its message names neither the file nor the tensor
            raise ValueError(f"{fn}: {file} is not a readable safetensors file ({error})") from None
    lost = sorted(name for name in promised if name[len(prefix) :] not in out)
    if lost:
        raise ValueError(f"{fn}: the index of {path} names tensors its shards lack: {lost[:5]}")
    if not out:
        raise ValueError(f"{fn}: no tensor in {str(path)!r} starts with prefix {prefix!r}")
    return out
