"""Every public batched op over the head layouts (H, HV) = (1, 1), (1, 2), (2, 2), (2, 4),
(3, 6) (the rules that share q and k over a group: (1, 1) and (2, 4)), recurrent and chunked
in both schedules, forward and gradients, in a child process that compiles as a user's does
(head_layout_checks.py): a crash there fails its named case.

The child runs with XLA:CPU's default library fusions, not the ``CPU_FLAGS`` of train.py
and this suite: with those defaults jaxlib 0.10.2 segfaulted, or returned wrong gradients,
on KDA's grouped heads, and the suite's own flags hid it."""

import os
import subprocess
import sys

import pytest

from gdn_jax.training.xla_flags import CPU_FLAGS

CHECKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "head_layout_checks.py")


def user_environment(environ):
    """``environ`` without the suite's XLA:CPU library-fusion choice (``CPU_FLAGS``), which a
    user's process does not set; the flags that only make compiling cheaper stay."""
    flags = [
        flag
        for flag in environ.get("XLA_FLAGS", "").split()
        if flag.lstrip("-").split("=")[0] not in CPU_FLAGS
    ]
    return dict(environ, XLA_FLAGS=" ".join(flags))


def run_cases(env):
    """Every case of head_layout_checks.py, restarting after the case a crash ended: returns
    ``{case: None (passed) or why it failed}``."""
    outcomes, first, count = {}, 0, None
    while True:
        result = subprocess.run(
            [sys.executable, CHECKS, "--from", str(first)],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,  # a guard against a hang: the checks take about a minute
        )
        started = None
        for line in result.stdout.splitlines():
            word, _, rest = line.partition(" ")
            if word == "cases":
                count = int(rest)
            if word in ("start", "ok", "FAIL"):
                index, _, case = rest.partition(" ")
                started = (int(index), case.split(": ")[0])
                if word != "start":
                    outcomes[started[1]] = None if word == "ok" else case
                    started = None
        if result.returncode == 0 and result.stdout.rstrip().endswith("done"):
            assert len(outcomes) == count, f"{count} cases, {len(outcomes)} outcomes"
            return outcomes
        if started is None:  # died before or between cases: nothing to name
            pytest.fail(f"the checks died with status {result.returncode}:\n{result.stderr}")
        index, case = started
        outcomes[case] = f"{case}: the process died with status {result.returncode}"
        first = index + 1


@pytest.mark.costly(60)
def test_every_op_layout_and_form_runs_finite_and_agrees(subprocess_env):
    outcomes = run_cases(user_environment(subprocess_env))
    failed = [why for why in outcomes.values() if why is not None]
    assert not failed, "\n".join(failed)
