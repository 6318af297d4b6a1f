"""A run directory belongs to one run: what is in it, who writes it, what may resume it.

A run directory holds ``config.yaml`` (the resolved config), ``metrics.jsonl``,
``curves.png``, ``checkpoints/`` and, once the run has ended by itself, ``summary.json``.
A fresh run refuses a directory that holds an earlier run unless told to overwrite it; a
lock refuses a second writer while a run is live (the kernel drops the lock when its process
dies, however it dies, so a stale lock file is simply taken over); and ``--resume`` refuses a
config that would continue a different run.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path

import yaml

CONFIG, METRICS, PLOT, SUMMARY, CHECKPOINTS, LOCK = (
    "config.yaml", "metrics.jsonl", "curves.png", "summary.json", "checkpoints", ".lock",
)  # fmt: skip
RUN_FILES = (CONFIG, METRICS, PLOT, SUMMARY, CHECKPOINTS)

# Fields that may differ between a run and its resumption: they decide how long it goes on
# and how it reports, not what any step computes. (train.steps also sets the span of the
# learning-rate schedule, so a changed value reshapes the schedule from the resume on.)
RESUMABLE_FIELDS = (
    "train.steps", "train.eval_every", "train.checkpoint_every", "train.keep_checkpoints",
    "train.target_accuracy", "train.progress", "train.out_dir",
    # Checkpoints are saved sharded and restore onto any mesh.
    "train.mesh.data", "train.mesh.model", "train.mesh.seq",
)  # fmt: skip


class RunError(ValueError):
    """A run that must not start, with a one-line reason for the user."""


def check_writable(out_dir: Path) -> None:
    """``out_dir`` is a directory we can write, or can be created below one we can write."""
    if out_dir.exists() and not out_dir.is_dir():
        raise RunError(f"train.out_dir={out_dir} exists and is not a directory")
    parent = out_dir
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise RunError(f"train.out_dir={out_dir} cannot be created: {parent} is not a directory")
    try:  # permission bits do not stop root, a read-only filesystem does: try it
        descriptor, probe = tempfile.mkstemp(dir=parent, prefix=".write-probe-")
        os.close(descriptor)
        os.unlink(probe)
    except OSError as error:
        raise RunError(f"train.out_dir={out_dir} is not writable: {error.strerror}") from None


def earlier_run(out_dir: Path) -> list[str]:
    """The run files in ``out_dir``, with checkpoint steps, e.g. ``['config.yaml',
    'checkpoints (steps 4, 8)']``; empty when it holds no run."""
    found = []
    for name in RUN_FILES:
        path = out_dir / name
        if name == CHECKPOINTS and path.is_dir():
            steps = sorted(int(p.name) for p in path.iterdir() if p.name.isdigit())
            if steps:
                found.append(f"{name} (steps {', '.join(map(str, steps))})")
        elif path.exists():
            found.append(name)
    return found


def clear(out_dir: Path) -> list[str]:
    """Delete an earlier run's files (``--overwrite``); returns what was there."""
    found = earlier_run(out_dir)
    for name in RUN_FILES:
        path = out_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    return found


def flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def resume_differences(saved: dict, config: dict) -> list[str]:
    """``['data.num_kv_pairs: 4 -> 8', ...]`` for the fields that may not change on resume."""
    before, after = flatten(saved), flatten(config)
    return [
        f"{name}: {before.get(name, '(absent)')} -> {after.get(name, '(absent)')}"
        for name in sorted(set(before) | set(after))
        if name not in RESUMABLE_FIELDS and before.get(name) != after.get(name)
    ]


def saved_config(out_dir: Path) -> dict | None:
    path = out_dir / CONFIG
    return yaml.safe_load(path.read_text()) if path.exists() else None


def write_config(out_dir: Path, config: dict) -> None:
    (out_dir / CONFIG).write_text(yaml.safe_dump(config, sort_keys=False))


def read_summary(out_dir: Path) -> dict | None:
    path = out_dir / SUMMARY
    return json.loads(path.read_text()) if path.exists() else None


def write_summary(out_dir: Path, summary: dict) -> None:
    (out_dir / SUMMARY).write_text(json.dumps(summary) + "\n")


def is_finished(summary: dict | None, steps: int, target: float | None) -> bool:
    """Whether a run that ended with ``summary`` has nothing left under these settings."""
    if summary is None:
        return False
    if summary["final_step"] >= steps:
        return True
    reached = summary.get("eval_accuracy")
    return target is not None and reached is not None and reached >= target


class RunLock:
    """An exclusive ``flock`` on ``out_dir/.lock`` for as long as the run lives.

    ``took_over`` tells whether a lock file was already there (left by a run that died):
    its lock had gone with its process, so it is simply taken over.
    """

    def __init__(self, out_dir: Path):
        self.path = out_dir / LOCK
        self.took_over = False
        self._file = None

    def acquire(self) -> RunLock:
        """Take the lock, or raise ``RunError`` naming the live run that holds it."""
        self.took_over = self.path.exists()
        handle = self.path.open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            raise RunError(
                f"{self.path.parent} is in use by a live run (pid {holder}); wait for it to "
                "end or stop it first"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        self._file = handle
        return self

    def release(self) -> None:
        self.path.unlink(missing_ok=True)
        self._file.close()  # closing drops the flock

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
