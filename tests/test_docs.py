"""The API reference builds from the docstrings with every warning an error.

``mkdocs build --strict`` (``mkdocs.yml``) renders the guides in ``docs/`` and the reference
pages in ``docs/api/``, whose mkdocstrings blocks griffe reads from the package's Google-style
docstrings: an argument documented that the signature lacks, a section entry griffe cannot
parse, a broken link or a page missing from the nav fails it.
"""

import re
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


# The modules of gdn_jax that need an extra beyond the core, and that extra.
NEEDS_EXTRA = {
    "gdn_jax.tpu_compile": "tpu-compile",
    "gdn_jax.gpu_compile": "gpu-compile",
    "gdn_jax.training": "train",
}


def test_each_readme_block_runs_with_what_the_readme_has_installed():
    """The tour stopped at its TPU block with LibtpuMissing: the README's first command
    installs the train extra, not tpu-compile. A block that needs another extra says so, with
    its install command, in the paragraph just before it."""
    readme = (ROOT / "README.md").read_text()
    first = re.search(r"```bash\n(.*?)\n", readme).group(1)
    installed = set(re.search(r'-e "\.\[([^\]]*)\]"', first).group(1).split(","))
    parts = re.split(r"```python\n(.*?)```", readme, flags=re.S)
    for before, block in zip(parts[::2], parts[1::2], strict=False):
        paragraph = before.strip().split("\n\n")[-1]
        for module, extra in NEEDS_EXTRA.items():
            if re.search(rf"^(from|import) {re.escape(module)}\b", block, re.M):
                said = re.search(rf'-e\s+"\.\[{re.escape(extra)}\]"', paragraph)
                assert extra in installed or said, (module, block[:200])
