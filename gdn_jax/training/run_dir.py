"""A run directory belongs to one run: what is in it, who writes it, what may resume it.

A run directory holds ``config.yaml`` (the resolved config), ``metrics.jsonl``,
``curves.png``, ``checkpoints/`` and, once the run has ended by itself, ``summary.json``.
``config.yaml`` is the run's identity: ``--resume`` refuses a config that would continue a
different run, and refuses to guess when ``config.yaml`` is missing or unreadable. A fresh
run refuses a directory that holds an earlier run unless told to overwrite it, except one
whose run died before its first checkpoint (nothing there can be resumed): that one is
replaced only when its ``config.yaml`` begins with ``MARKER``, the line every run writes
first, since a file of that name without it is the user's own. A run deletes only what runs
make (its files, and in ``checkpoints/`` step directories and orbax's temporary ones), names
each path it deletes, and refuses a ``checkpoints/`` that holds anything else. A run that
created its directory and ends before its first step removes it again. A lock refuses a
second writer while a run is live (the kernel drops the lock when its process dies, however
it dies, so a stale lock file is simply taken over). A run file that cannot be read is a
``RunError`` naming the file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import sys
import tempfile
from pathlib import Path

import yaml

from gdn_jax.training.config import parse_yaml
from gdn_jax.training.errors import NothingToResume, RunError, unreadable
from gdn_jax.training.files import read_text
from gdn_jax.training.metrics_log import MetricsLog
from gdn_jax.training.run_files import (  # noqa: F401 (the run directory's names, read here)
    CHECKPOINTS,
    CONFIG,
    LOCK,
    METRICS,
    PLOT,
    RUN_FILES,
    SUMMARY,
    check_only_run_files,
    checkpoint_steps,
    clear,
    earlier_run,
    remove_created,
)

# The first line of every config.yaml a run writes (a YAML comment): what tells a run's own
# file from a user's file of the same name.
MARKER = "# gdn_jax run: the resolved config of the run in this directory"

# Fields that may differ between a run and its resumption: they decide how long it goes on
# and how it reports, not what any step computes. (train.steps also sets the span of the
# learning-rate schedule, so a changed value reshapes the schedule from the resume on.)
RESUMABLE_FIELDS = (
    "train.steps", "train.eval_every", "train.checkpoint_every", "train.keep_checkpoints",
    "train.target_accuracy", "train.progress", "train.out_dir",
    # Checkpoints are saved sharded and restore onto any mesh.
    "train.mesh.data", "train.mesh.model", "train.mesh.seq",
    # Both schedules compute one function; runs saved before the field existed lack it.
    "model.schedule",
)  # fmt: skip


def check_writable(out_dir: Path, name: str = "train.out_dir") -> None:
    """``out_dir`` is a directory we can write, or can be created below one we can write;
    ``name`` is the option that gave it, for the message."""
    if out_dir.is_symlink() and not out_dir.exists():
        raise RunError(
            f"{name}={out_dir} is a link to {os.readlink(out_dir)}, which does not exist"
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise RunError(f"{name}={out_dir} exists and is not a directory")
    parent = out_dir
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise RunError(f"{name}={out_dir} cannot be created: {parent} is not a directory")
    try:  # permission bits do not stop root, a read-only filesystem does: try it
        descriptor, probe = tempfile.mkstemp(dir=parent, prefix=".write-probe-")
        os.close(descriptor)
        os.unlink(probe)
    except OSError as error:
        raise RunError(f"{name}={out_dir} is not writable: {error.strerror}") from None


def written_by_a_run(path: Path) -> bool:
    """Whether the file ``path`` begins with ``MARKER``: a run wrote it."""
    try:
        with path.open() as handle:
            return handle.readline().rstrip("\n") == MARKER
    except (OSError, UnicodeDecodeError):
        return False


def nothing_measured(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds at most ``config.yaml`` and an empty ``metrics.jsonl``:
    what a run leaves when it dies before its first checkpoint and first logged step."""
    metrics = out_dir / METRICS
    logged = metrics.exists() and metrics.stat().st_size > 0
    return set(earlier_run(out_dir)) <= {CONFIG, METRICS} and not logged


def died_before_first_save(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds what a run left when it died before its first checkpoint
    and first logged step (``nothing_measured``), with its own ``config.yaml``
    (``MARKER``): nothing there can be resumed, nothing was measured, and nothing is the
    user's."""
    return nothing_measured(out_dir) and written_by_a_run(out_dir / CONFIG)


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


def read_config(out_dir: Path) -> dict:
    """The saved ``config.yaml``, which ``--resume`` must compare with: missing, empty or
    malformed, it cannot tell what run the checkpoints belong to."""
    path = out_dir / CONFIG

    def refuse(reason: str) -> RunError:
        return unreadable(
            path,
            f"{reason}, so --resume cannot tell what run the checkpoints belong to (put it "
            "back, or start afresh with --overwrite)",
        )

    if not path.exists():
        raise refuse("it is missing")
    try:
        saved = parse_yaml(read_text(path), str(path))
    except ValueError as error:
        raise refuse(str(error).removeprefix(f"{path}: ")) from None
    if saved is None:
        raise refuse("it is empty")
    if not isinstance(saved, dict):
        raise refuse("it is not a mapping of model/data/train")
    return saved


def write_config(out_dir: Path, resolved: dict) -> None:
    """``config.yaml``: ``MARKER``, then ``resolved`` (``config.to_dict``) as YAML."""
    (out_dir / CONFIG).write_text(f"{MARKER}\n{yaml.safe_dump(resolved, sort_keys=False)}")


def read_summary(out_dir: Path) -> dict | None:
    path = out_dir / SUMMARY
    if not path.exists():
        return None
    try:
        summary = json.loads(read_text(path))
    except json.JSONDecodeError as error:
        raise unreadable(path, f"not JSON ({error})") from None
    if not isinstance(summary, dict) or not isinstance(summary.get("final_step"), int):
        raise unreadable(path, "it has no final_step")
    return summary


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

    def __init__(self, out_dir: Path, *, created: bool = False):
        """``created``: the run made ``out_dir`` (so a run that ends before its first step
        removes it)."""
        self.path = out_dir / LOCK
        self.took_over = False
        self.created = created
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

    def release(self, *, ended_early: bool = False) -> None:
        """Drop the lock. ``ended_early``: the run ended by an exception (a failure, Ctrl-C);
        a directory it created in which nothing was measured goes too (``remove_created``),
        so that start-up leaves no empty run directory behind."""
        self.path.unlink(missing_ok=True)
        self._file.close()  # closing drops the flock
        out_dir = self.path.parent
        if ended_early and self.created and nothing_measured(out_dir):
            with contextlib.suppress(OSError):  # the error that ended the run is the news
                remove_created(out_dir)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


@contextlib.contextmanager
def held(locks: list[RunLock]):
    """Release ``locks`` (``claim``'s, ``claim_all``'s) when the block ends, as
    ``RunLock.release(ended_early=...)`` when it ends by an exception."""
    try:
        yield
    except BaseException:
        for lock in locks:
            lock.release(ended_early=True)
        raise
    for lock in locks:
        lock.release()


def claim(out_dir: str | Path, resolved: dict, *, resume: bool, overwrite: bool) -> RunLock:
    """Check ``out_dir`` (``train.out_dir``) against ``resume``/``overwrite`` and lock it;
    returns the held lock. ``resolved`` is the run's config as ``config.to_dict`` gives it,
    what a resumed run's ``config.yaml`` must match.

    Raises ``RunError`` before anything is written when the run must not start. With
    ``overwrite`` the earlier run's files are deleted (and named on stderr).
    """
    return claim_all([(out_dir, resolved)], resume=resume, overwrite=overwrite)[0]


def claim_all(
    runs: list[tuple[str | Path, dict]], *, resume: bool, overwrite: bool
) -> list[RunLock]:
    """``claim`` for several runs, each ``(out_dir, resolved)`` (distinct directories): every
    directory is checked before any is changed, so a refusal of one leaves them all as they
    were."""
    if resume and overwrite:
        raise RunError("--resume and --overwrite contradict each other; choose one")
    out_dirs = [Path(out_dir).absolute() for out_dir, _ in runs]
    for out_dir in out_dirs:
        check_writable(out_dir)
    locks, created = [], []
    try:
        for (_, resolved), out_dir in zip(runs, out_dirs, strict=True):
            new = not out_dir.exists()
            if new:
                out_dir.mkdir(parents=True)
                created.append(out_dir)
            locks.append(RunLock(out_dir, created=new).acquire())
            _check_claim(resolved, out_dir, resume=resume, overwrite=overwrite)
    except BaseException:
        for lock in locks:
            lock.release()
        for out_dir in reversed(created):  # leave no empty directory behind a refused run
            out_dir.rmdir()
        raise
    for lock in locks:
        if not resume:
            _clear_earlier(lock.path.parent)
        if lock.took_over:
            print(
                f"took over the stale lock of a run that died in {lock.path.parent}",
                file=sys.stderr,
            )
    return locks


def _check_claim(resolved: dict, out_dir: Path, *, resume: bool, overwrite: bool) -> None:
    check_only_run_files(out_dir)
    earlier = earlier_run(out_dir)
    stranded = bool(earlier) and died_before_first_save(out_dir)
    if resume:
        check_resumable(resolved, out_dir, earlier, stranded)
    elif earlier and not stranded and not overwrite:
        resumable = checkpoint_steps(out_dir)
        config = out_dir / CONFIG
        if nothing_measured(out_dir) and config.exists():  # not a run's config.yaml
            raise RunError(
                f"{config} does not begin with the line a run writes first ({MARKER!r}), so "
                "it may be a file of your own; move it away, or delete it with --overwrite"
            )
        raise RunError(
            f"{out_dir} holds an earlier run ({', '.join(earlier)}); "
            + ("continue it with --resume or " if resumable else "it has no checkpoint; ")
            + "delete it with --overwrite"
        )


def _clear_earlier(out_dir: Path) -> None:
    """Delete the earlier run that a fresh run checked by ``_check_claim`` replaces."""
    earlier = earlier_run(out_dir)
    if earlier and died_before_first_save(out_dir):
        print(
            f"replacing the run in {out_dir} that died before its first checkpoint "
            f"(deleted {', '.join(clear(out_dir))})",
            file=sys.stderr,
        )
    elif earlier:
        print(f"overwrite: deleted {', '.join(clear(out_dir))} in {out_dir}", file=sys.stderr)


def check_resumable(resolved: dict, out_dir: Path, earlier: list[str], stranded: bool) -> None:
    """``--resume`` needs a checkpoint, a readable ``config.yaml`` that matches ``resolved``
    but for ``RESUMABLE_FIELDS``, and a readable ``metrics.jsonl``; nothing is written."""
    if not checkpoint_steps(out_dir):
        if stranded:
            why = "its run died before its first checkpoint"
        elif earlier:
            why = f"it holds {', '.join(earlier)} but no checkpoint"
        else:
            why = "it holds no run"
        raise NothingToResume(
            f"--resume: nothing to resume in {out_dir} ({why})",
            overwrite=bool(earlier) and not stranded,
        )
    differences = resume_differences(read_config(out_dir), resolved)
    if differences:
        raise RunError(
            f"--resume would continue {out_dir} with a different setup "
            f"({'; '.join(differences)}); only {', '.join(RESUMABLE_FIELDS)} may change"
        )
    MetricsLog(out_dir / METRICS).read()


def finished_summary(out_dir: Path, steps: int, target: float | None) -> dict | None:
    """With ``--resume``: the summary of a run with nothing left to do when it trains to
    ``steps`` or the held-out accuracy ``target`` (``train.steps``,
    ``train.target_accuracy``), or None when it goes on. A run cannot go on to a
    ``train.steps`` below its newest checkpoint.
    """
    summary = read_summary(out_dir)
    if is_finished(summary, steps, target):
        return dict(summary, already_finished=True)
    newest = max(checkpoint_steps(out_dir), default=0)
    if steps < newest:
        raise RunError(
            f"--resume: train.steps={steps} is below step {newest} of the newest "
            f"checkpoint in {out_dir}; give train.steps >= {newest}"
        )
    return None


def check_checkpoint_shapes(out_dir: Path, step: int, there: dict, here: dict) -> None:
    """Raise ``RunError`` when checkpoint ``step`` holds parameters of other names or shapes
    (``there``, ``{dotted name: shape}``) than the config builds (``here``): a different
    model, not a damaged checkpoint."""
    for name in sorted(set(there) | set(here)):
        if there.get(name) != here.get(name):
            raise RunError(
                f"--resume: checkpoint step {step} in {out_dir / CHECKPOINTS} is of another "
                f"model than the config: params {name} is {there.get(name, '(absent)')} there "
                f"and {here.get(name, '(absent)')} here; {CONFIG} does not describe these "
                "checkpoints"
            )
