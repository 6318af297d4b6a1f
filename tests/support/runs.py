"""The tiny training run that the CLI, training and multi-process tests drive, and the one
finished run of it that every test run makes once and the tests that only read it share."""

import fcntl
import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# A model small enough to train in seconds; the recurrent impl compiles about 3x faster than
# the chunked one, and here the loop, not the op, is under test.
TINY = [
    "model.vocab_size=64", "data.vocab_size=64", "model.d_model=16", "model.mixers=[gdn]",
    "model.chunk_size=16", "model.impl=recurrent", "data.seq_len=32", "data.num_kv_pairs=4",
    "train.batch_size=8", "train.steps=12", "train.warmup_steps=2", "train.eval_every=6",
    "train.eval_examples=16", "train.checkpoint_every=4", "train.progress=false",
]  # fmt: skip

# The command with a callback that sends a signal to itself after a given step, so that a
# SIGKILL, which ends the process it hits, lands at a known step (test_cli.py sends SIGINT and
# SIGTERM to its own process, whose loop turns them into a stop).
INTERRUPTED = textwrap.dedent(
    """
    import os, signal, sys
    from gdn_jax.training import cli, loop

    signum, at_step = int(sys.argv[1]), int(sys.argv[2])
    original = loop.run

    def run(*args, **kwargs):
        def interrupt(step, metrics):
            if step == at_step:
                os.kill(os.getpid(), signum)
        return original(*args, callbacks=[interrupt], **kwargs)

    loop.run = run
    sys.exit(cli.main(sys.argv[3:]))
    """
)


def command_args(out_dir, *extra, sets=()):
    args = []
    for item in (*TINY, f"train.out_dir={out_dir}", *sets):
        args += ["--set", item]
    return [*args, *extra]


def train(env, out_dir, *extra, sets=(), prefix=("train.py",), **env_extra):
    """``python train.py`` (or ``prefix``) on the tiny config into ``out_dir``."""
    return subprocess.run(
        [sys.executable, *prefix, *command_args(out_dir, *extra, sets=sets)],
        cwd=REPO,
        env=dict(env, **env_extra),
        capture_output=True,
        text=True,
        timeout=300,  # a guard against a hang: one run takes about 8 s on 2 cores
    )


def logged(out_dir):
    """Every logged number of every step, wall-clock rates aside."""
    drop = ("tokens_per_s", "elapsed_s")
    lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if k not in drop} for x in lines]


def train_losses(out_dir):
    return [row["loss"] for row in logged(out_dir) if row["kind"] == "train"]


def finished_run(root, env):
    """``python train.py`` on the tiny config, run to its end once per test run in ``root``
    (shared by the xdist workers: the first to come trains, the others wait on the lock).
    Callers only read it; a test that changes a run trains or copies its own.

    It runs as a user's does, with ``JAX_PLATFORMS`` unset (the suite sets it): its stderr,
    kept as ``finished-run.stderr`` next to it, shows what a user reads (test_cli.py)."""
    out_dir = Path(root) / "finished-run"
    with open(Path(root) / "finished-run.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out_dir / "summary.json").exists():
            user_env = {k: v for k, v in env.items() if k != "JAX_PLATFORMS"}
            result = train(user_env, out_dir)
            assert result.returncode == 0, result.stderr
            (Path(root) / "finished-run.stderr").write_text(result.stderr)
    return out_dir
