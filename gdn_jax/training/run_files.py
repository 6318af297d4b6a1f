"""What a run makes in its directory, and so may delete: the run files and, in
``checkpoints/``, orbax's step directories and its temporary ones.

Anything else there is the user's: a run refuses to start beside it (``check_only_run_files``),
and ``clear`` would leave it in place even if it were called without that check.
"""

from __future__ import annotations

import contextlib
import re
import shutil
from pathlib import Path

from gdn_jax.training.errors import RunError, unreadable

CONFIG, METRICS, PLOT, SUMMARY, CHECKPOINTS, LOCK = (
    "config.yaml", "metrics.jsonl", "curves.png", "summary.json", "checkpoints", ".lock",
)  # fmt: skip
RUN_FILES = (CONFIG, METRICS, PLOT, SUMMARY, CHECKPOINTS)
# What a run puts in ``checkpoints/``: orbax's step directories and, while a save is under
# way (or after a crash in one), its temporary directory for that step.
STEP = re.compile(r"\d+")
ORBAX_TEMPORARY = re.compile(r"\d+\.orbax-checkpoint-tmp(-\d+)?")


def checkpoint_entries(out_dir: Path) -> list[Path]:
    """Everything in ``out_dir/checkpoints``, sorted; empty when there is no such folder."""
    path = out_dir / CHECKPOINTS
    if not path.is_dir():
        return []
    try:
        return sorted(path.iterdir())
    except OSError as error:
        raise unreadable(path, error.strerror) from None


def made_by_a_run(entry: Path) -> bool:
    """Whether ``entry`` of ``checkpoints/`` is what a run puts there: a step directory or
    orbax's temporary one, a real directory (a link is the user's, whatever its name)."""
    named = STEP.fullmatch(entry.name) or ORBAX_TEMPORARY.fullmatch(entry.name)
    return bool(named) and entry.is_dir() and not entry.is_symlink()


def checkpoint_steps(out_dir: Path) -> list[int]:
    """The steps of the checkpoints in ``out_dir``, oldest first."""
    return sorted(
        int(p.name) for p in checkpoint_entries(out_dir) if STEP.fullmatch(p.name) and p.is_dir()
    )


def unfinished_saves(out_dir: Path) -> list[str]:
    """The names of orbax's temporary directories in ``checkpoints/``: saves a crash cut."""
    return [
        p.name
        for p in checkpoint_entries(out_dir)
        if ORBAX_TEMPORARY.fullmatch(p.name) and made_by_a_run(p)
    ]


def not_made_by_a_run(out_dir: Path) -> list[str]:
    """The paths, relative to ``out_dir``, among its run files that no run makes and so no
    run may delete: anything in ``checkpoints/`` but step directories and orbax's temporary
    ones, a ``checkpoints`` that is not a directory, a run file that is a directory."""
    if (out_dir / CHECKPOINTS).exists() and not (out_dir / CHECKPOINTS).is_dir():
        return [CHECKPOINTS]
    found = [f"{CHECKPOINTS}/{p.name}" for p in checkpoint_entries(out_dir) if not made_by_a_run(p)]
    return found + [n for n in RUN_FILES if n != CHECKPOINTS and (out_dir / n).is_dir()]


def check_only_run_files(out_dir: Path) -> None:
    """Refuse (``RunError``) an ``out_dir`` whose run files hold anything no run makes
    (``not_made_by_a_run``): a run deletes what runs make there, and that would go with it."""
    foreign = not_made_by_a_run(out_dir)
    if foreign:
        raise RunError(
            f"{out_dir} holds, where a run keeps its files, what no run makes: "
            f"{', '.join(foreign)}; move it away first ({CHECKPOINTS}/ is for a run's step "
            "directories alone, and a run deletes its own files)"
        )


def earlier_run(out_dir: Path) -> list[str]:
    """The run files in ``out_dir``, with checkpoint steps and cut saves, e.g.
    ``['config.yaml', 'checkpoints (steps 4, 8)']``; empty when it holds no run."""
    found = []
    for name in RUN_FILES:
        if name == CHECKPOINTS:
            steps, cut = checkpoint_steps(out_dir), unfinished_saves(out_dir)
            parts = [f"steps {', '.join(map(str, steps))}"] if steps else []
            parts += [f"unfinished save {', '.join(cut)}"] if cut else []
            if parts:
                found.append(f"{name} ({'; '.join(parts)})")
        elif (out_dir / name).exists():
            found.append(name)
    return found


def clear(out_dir: Path) -> list[str]:
    """Delete an earlier run's files (``--overwrite``) and return the paths deleted, relative
    to ``out_dir``: the run files, and in ``checkpoints/`` only what a run makes there
    (``made_by_a_run``), so that the folder goes only when nothing else is in it."""
    deleted = []
    for name in RUN_FILES:
        path = out_dir / name
        if name == CHECKPOINTS:
            for entry in checkpoint_entries(out_dir):
                if made_by_a_run(entry):
                    shutil.rmtree(entry)
                    deleted.append(f"{CHECKPOINTS}/{entry.name}")
            if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
                path.rmdir()
                deleted.append(CHECKPOINTS)
        elif path.is_symlink() or path.is_file():
            path.unlink()
            deleted.append(name)
    return deleted


def remove_created(out_dir: Path) -> None:
    """Delete ``out_dir``, a directory that a run of this process created and that ended
    before its first step, with what the run wrote there: the user finds what was there
    before, nothing. Anything else found there is kept, and the directory with it."""
    clear(out_dir)
    with contextlib.suppress(OSError):  # not empty: something in it is not the run's
        out_dir.rmdir()
