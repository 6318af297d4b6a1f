"""The API reference builds from the docstrings with every warning an error.

``mkdocs build --strict`` (``mkdocs.yml``) renders the guides in ``docs/`` and the reference
pages in ``docs/api/``, whose mkdocstrings blocks griffe reads from the package's Google-style
docstrings: an argument documented that the signature lacks, a section entry griffe cannot
parse, a broken link or a page missing from the nav fails it.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_api_reference_builds_without_warnings(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict"]
        + ["--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    assert (tmp_path / "site" / "api" / "ops" / "index.html").is_file()
