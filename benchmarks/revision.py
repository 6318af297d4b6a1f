"""Import ``gdn_jax`` as it was at another git revision, next to the current one.

Benchmarks compare before and after in one process (these machines are too noisy for
figures from separate runs): ``import_revision("6fca74a")`` extracts that revision's
package with ``git archive`` into a temporary folder under the name ``gdn_jax_6fca74a``,
rewrites its absolute imports to that name, and imports it.
"""

from __future__ import annotations

import importlib
import io
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def import_revision(revision: str):
    """The ``gdn_jax`` package of ``revision`` (anything ``git rev-parse`` accepts)."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", revision],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    name = f"gdn_jax_{commit}"
    if name in sys.modules:
        return sys.modules[name]
    archive = subprocess.run(
        ["git", "archive", "--format=tar", commit, "gdn_jax"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout
    root = Path(tempfile.mkdtemp(prefix="gdn_jax_revision_"))
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    package = (root / "gdn_jax").rename(root / name)
    pattern = re.compile(r"\bgdn_jax\b(?=[.\s])")
    for path in package.rglob("*.py"):
        path.write_text(pattern.sub(name, path.read_text()))
    sys.path.insert(0, str(root))
    return importlib.import_module(name)
