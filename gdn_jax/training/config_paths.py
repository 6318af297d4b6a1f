"""Where a config name leads: a file, or one of the configs packaged in ``gdn_jax/configs/``.

Light on purpose (no JAX), so that the commands resolve ``--config`` before they import it.
"""

from __future__ import annotations

from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
DEFAULT_CONFIG = "mqar_gdn.yaml"


def resolve_config(name: str | Path, *, given: str | None = None) -> Path:
    """``name`` as given (``~`` being the home) when that file exists; a bare file name (``mqar_gdn.yaml``) that is
    not in the working directory names a packaged config, so it works from any directory.
    A path with a directory in it must exist: falling back would train some other file.
    ``given`` names what the user gave in the ``ValueError`` (default ``--config NAME``)."""
    name = str(name)
    given = f"--config {name}" if given is None else given
    path = Path(name).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        raise ValueError(f"{given}: is a directory; give a YAML file in it")
    if path.name != name:
        raise ValueError(f"{given}: no such file")
    packaged = CONFIG_DIR / name
    if packaged.is_file():
        return packaged
    known = ", ".join(sorted(p.name for p in CONFIG_DIR.glob("*.yaml")))
    raise ValueError(f"{given}: no such file, and no packaged config of that name ({known})")
