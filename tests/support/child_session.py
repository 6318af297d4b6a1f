"""The tests that need a process of their own, run by one pytest session in a child process.

A test marked ``@pytest.mark.child(devices=N)`` needs N CPU devices, which XLA fixes when JAX
starts (``--xla_force_host_platform_device_count``); one marked ``child(user_xla=True)``
runs as a user's process compiles, without the suite's XLA:CPU library-fusion flags, so that a
compiler or runtime crash fails the named test instead of killing a worker. In the suite's
own processes such a test does not run its body: the first one that runs starts one child
pytest session for every marked test of its kind (``CHILD_ENV`` tells the child's conftest
what to set up), and each marked test then reports its own outcome from that session. When
the child dies, the test it was running fails with its exit status, and a new child runs
the ones after it.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# What a child session is: "devices=N" or "user_xla", read by conftest.py before JAX starts.
CHILD_ENV = "GDN_TEST_CHILD"
# Where the child writes one JSON line per test it starts and per report.
OUTCOMES_ENV = "GDN_TEST_OUTCOMES"
TIMEOUT_S = 1200  # a guard against a hang: the longest child session takes about 2 minutes


def kind(marker) -> str:
    """The child session a ``child`` marker asks for."""
    if marker.kwargs.get("user_xla"):
        return "user_xla"
    return f"devices={marker.kwargs['devices']}"


def record(event: dict) -> None:
    """In a child session: append ``event`` to the outcomes file."""
    with open(os.environ[OUTCOMES_ENV], "a") as f:
        f.write(json.dumps(event) + "\n")


def run(child: str, nodeids: list[str], env: dict, rootdir: Path) -> dict:
    """Run ``nodeids`` in child sessions of kind ``child`` until each has an outcome:
    ``{nodeid: ("passed" | "failed" | "skipped", text)}``."""
    outcomes, remaining = {}, list(nodeids)
    if child == "user_xla":
        env = user_environment(env)
    else:  # N devices: the host's CPU devices, also where the suite runs on a GPU
        env = dict(env, JAX_PLATFORMS="cpu")
    while remaining:
        with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
            path = f.name
        # -m "": the parent chose these tests; the addopts' marker filter (pyproject.toml)
        # would deselect the slow ones here.
        command = [sys.executable, "-m", "pytest", "-n", "0", "-q", "-p", "no:cacheprovider"]
        command += ["-m", ""]
        result = subprocess.run(
            [*command, *remaining],
            cwd=rootdir,
            env=dict(env, **{CHILD_ENV: child, OUTCOMES_ENV: path}),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        running = _read(Path(path), outcomes)
        os.unlink(path)
        done = [n for n in remaining if n in outcomes]
        if running is not None:  # the child died inside a test
            why = f"the child process died with status {result.returncode} in this test"
            outcomes[running] = ("failed", f"{why}:\n{result.stderr[-3000:]}")
        elif not done:  # it ran none of them
            output = f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            for nodeid in remaining:
                outcomes[nodeid] = ("failed", f"the child session ran no test:\n{output}")
        remaining = [n for n in remaining if n not in outcomes]
    return outcomes


def user_environment(environ: dict) -> dict:
    """``environ`` without the suite's XLA:CPU library-fusion choice (``CPU_FLAGS``), which a
    user's process does not set; the flags that only make compiling cheaper stay."""
    # Imported here: conftest.py imports this module before gdn_jax's annotations are hooked.
    from gdn_jax.training.xla_flags import CPU_FLAGS

    flags = [
        flag
        for flag in environ.get("XLA_FLAGS", "").split()
        if flag.lstrip("-").split("=")[0] not in CPU_FLAGS
    ]
    return dict(environ, XLA_FLAGS=" ".join(flags))


def _read(path: Path, outcomes: dict) -> str | None:
    """Fold the child's events into ``outcomes``; the test it started and never finished."""
    running = None
    for line in path.read_text().splitlines():
        event = json.loads(line)
        nodeid = event["nodeid"]
        if event["when"] == "start":
            running = nodeid
            continue
        outcome, text = outcomes.get(nodeid, ("passed", ""))
        if event["outcome"] != "passed" and outcome != "failed":
            outcome, text = event["outcome"], event["text"]
        outcomes[nodeid] = (outcome, text)
        if event["when"] == "teardown":
            running = None
    return running
