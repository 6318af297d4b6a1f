"""A run's orbax checkpoints: saved and waited for, restored with fallbacks.

The newest checkpoint that restores is the one a resumed run continues from. One that fails
to restore (damaged) is moved aside to ``broken_checkpoints/`` with a warning and the one
before is tried; one of another model stops the resume (``run_dir.check_checkpoint_shapes``),
since then ``config.yaml`` does not describe the directory.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import sys
import traceback
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from gdn_jax.training import run_dir
from gdn_jax.training.errors import RunError, SaveError, is_out_of_memory, reason
from gdn_jax.training.metrics_log import MetricsLog
from gdn_jax.training.step import TrainState


def is_primary() -> bool:
    """Whether this process keeps the run directory (process 0 of several)."""
    return jax.process_index() == 0


def sync(name: str) -> None:
    """Wait for every process (nothing to wait for in a one-process run)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


@functools.cache  # once a process: the registry is global
def use_replica_parallel_only_across_processes() -> None:
    """Replica-parallel saving (orbax's default) splits each replicated array among its
    replicas, so that several hosts share the writes; in one process it only slices every
    array per device, compiling a slice program for each, which made a save on 8 CPU devices
    several times slower than on one (docs/benchmarks.md). So one process registers, as orbax's own benchmarks do, a
    handler for jax.Array without it in orbax's global registry (its override warning
    silenced); several keep orbax's default. The arrays on disk are the same either way."""
    if jax.process_count() > 1:
        return
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        handler = ocp.type_handlers.ArrayHandler(use_replica_parallel=False)
        ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
    finally:
        absl.setLevel(level)


class _OrphanedSaveTasks(logging.Filter):
    """Drops asyncio's report of an exception that nobody retrieved from an orbax task or
    future. It belongs to a save that failed, which ``SaveError`` reported; asyncio reports
    it when the task is collected, which may be long after (at exit)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "exception was never retrieved" not in record.getMessage():
            return True
        error = record.exc_info[1] if record.exc_info else None
        frames = traceback.extract_tb(error.__traceback__) if error is not None else []
        return not any(f"{os.sep}orbax{os.sep}" in frame.filename for frame in frames)


@functools.cache  # once a process: the logger is global
def drop_orphaned_save_tasks() -> None:
    logging.getLogger("asyncio").addFilter(_OrphanedSaveTasks())


class _DamagedMetadata(logging.Filter):
    """Turns orbax's report of a checkpoint metadata file it cannot read (logged at every
    read, with the file's whole content, and read again for every step listed) into one
    warning line per file; whether that checkpoint restores is the resume's to say."""

    REPORTS = ("Failed to json parse Metadata file", "Failed to read Metadata file")

    def __init__(self):
        super().__init__()
        self.warned = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.REPORTS) or not record.args:
            return True
        path, error = record.args[0], record.args[-1]
        if str(path) not in self.warned:
            self.warned.add(str(path))
            print(f"warning: orbax cannot read {path} ({error})", file=sys.stderr)
        return False


@functools.cache  # once a process: the logger is global
def name_damaged_metadata() -> None:
    logging.getLogger("absl").addFilter(_DamagedMetadata())


def manager(out_dir: Path, keep: int) -> ocp.CheckpointManager:
    use_replica_parallel_only_across_processes()
    drop_orphaned_save_tasks()
    name_damaged_metadata()
    return ocp.CheckpointManager(
        out_dir / run_dir.CHECKPOINTS,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        item_handlers=ocp.StandardCheckpointHandler(),  # so that item_metadata reads shapes
    )


# The loggers through which orbax's save threads report a failure, each with its traceback.
SAVE_LOGGERS = ("absl", "asyncio")


@contextlib.contextmanager
def held_save_output():
    """Hold what a save prints until it ends: yields a list that receives the text, which
    is then printed as it would have been when the save succeeded, and dropped when it
    failed.

    A save that fails (a full disk) makes orbax's threads report it many times over, with
    about 100 lines of tracebacks: records of ``SAVE_LOGGERS`` and, from threads with no
    caller, tracebacks of its callbacks on ``sys.stderr`` (``Event loop is closed``).
    ``SaveError`` states the cause in one line, and on a full disk no file could take them.
    """
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(logging.Formatter(logging.BASIC_FORMAT))
    loggers = [logging.getLogger(name) for name in SAVE_LOGGERS]
    propagate = [logger.propagate for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.propagate = False
    stderr, sys.stderr = sys.stderr, buffer
    held = []
    try:
        yield held
    finally:
        sys.stderr = stderr
        for logger, before in zip(loggers, propagate, strict=True):
            logger.removeHandler(handler)
            logger.propagate = before
        held.append(buffer.getvalue())


def save(checkpoints: ocp.CheckpointManager, step: int, state: TrainState, out_dir: Path) -> None:
    """Save and wait: a save that fails stops the run here, not some steps later, with one
    line (``held_save_output``)."""
    try:
        with held_save_output() as held:
            if step not in checkpoints.all_steps():
                checkpoints.save(step, args=ocp.args.StandardSave(state))
            checkpoints.wait_until_finished()
        print(*held, end="", file=sys.stderr)
    except Exception as error:
        latest = checkpoints.latest_step()
        kept = f"step {latest} is the latest kept" if latest is not None else "none was saved"
        raise SaveError(
            f"could not save checkpoint step {step} in {out_dir / run_dir.CHECKPOINTS} "
            f"({error}); {kept}"
        ) from error


def shapes(tree) -> dict[str, tuple]:
    """``{'blocks.0.mixer.q_proj.kernel': (16, 16), ...}`` of arrays or their metadata."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(k, simple=True, separator="."): tuple(v.shape) for k, v in leaves}


def restore_or_start(
    resolved: dict,
    out_dir: Path,
    checkpoints: ocp.CheckpointManager,
    log: MetricsLog,
    state: TrainState,
    resume: bool,
) -> tuple[TrainState, int]:
    """``(state, step)`` to train on from: the newest checkpoint that restores (with
    ``resume``), or ``state`` at step 0; either way with the run's ``config.yaml`` written
    from ``resolved`` (``config.to_dict``)."""
    primary = is_primary()
    if not resume:
        if primary:
            run_dir.write_config(out_dir, resolved)
        return state, 0
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    for step in sorted(checkpoints.all_steps(), reverse=True):
        try:
            there = shapes(checkpoints.item_metadata(step)["params"])
            run_dir.check_checkpoint_shapes(out_dir, step, there, shapes(state.params))
            restored = checkpoints.restore(step, args=ocp.args.StandardRestore(abstract))
        except Exception as error:  # any other failure to restore means: not this one
            if isinstance(error, RunError) or is_out_of_memory(error):
                raise
            aside = out_dir / "broken_checkpoints" / str(step)
            if primary:
                aside.parent.mkdir(exist_ok=True)
                (out_dir / run_dir.CHECKPOINTS / str(step)).rename(aside)
            sync("broken checkpoint moved aside")
            checkpoints.reload()
            print(
                f"warning: checkpoint step {step} does not restore ({reason(error)}); moved "
                f"it to {aside} and trying the one before",
                file=sys.stderr,
            )
            continue
        if primary and log.torn_tail():
            print(
                f"warning: dropping the torn last line of {log.path} (a crash mid-write); "
                f"the checkpoint at step {step} is where the run resumes",
                file=sys.stderr,
            )
        log.truncate(step)
        if primary:
            (out_dir / run_dir.SUMMARY).unlink(missing_ok=True)  # the run goes on
            run_dir.write_config(out_dir, resolved)
        return restored, step
    raise RunError(f"--resume: no checkpoint in {out_dir / run_dir.CHECKPOINTS} restores")
