"""Files written whole or not at all: a full disk or a crash leaves no empty or partial file."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from gdn_jax.training.errors import unreadable


def write_whole(path: Path, write: Callable[[Path], None]) -> None:
    """``write(partial)`` writes the file's contents to ``partial``, a hidden name next to
    ``path``, which then replaces ``path`` in one rename; on any error ``path`` is as it was."""
    partial = path.with_name(f".{path.name}.partial")
    try:
        write(partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def read_text(path: Path) -> str:
    """``path``'s text, or the ``RunError`` that names the file and why it cannot be read."""
    try:
        return path.read_text()
    except OSError as error:
        raise unreadable(path, error.strerror) from None
