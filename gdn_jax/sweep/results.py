"""``results.jsonl``: one record per finished run of a sweep, appended as each run ends.

A record is keyed by the run's identity (``cells.Plan.key``) and says whether the run
``finished`` (with its best held-out accuracy) or ``failed`` (with the error that ended it);
an interrupted run writes none and is trained on by the next sweep. A last line cut short by
a crash mid-write is dropped (with one warning) before anything is appended after it; any
other line that is not a record is damage, a ``SweepError`` naming the line.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

FINISHED, FAILED = "finished", "failed"


class SweepError(ValueError):
    """A sweep that must not start or go on, with a one-line reason."""


class Results:
    """The records of ``path``, read once, and appends to it from any thread."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self.records: dict[str, dict] = {}
        self.foreign = 0  # records without a key, written by an older sweep
        self.torn = False
        if path.exists():
            self._read()

    def _read(self) -> None:
        text = self.path.read_text()
        lines = text.splitlines()
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                if number == len(lines) and not text.endswith("\n"):
                    self.torn = True
                    break
                raise SweepError(
                    f"{self.path} cannot be read: line {number} is not JSON ({error.msg})"
                ) from None
            if not isinstance(record, dict):
                raise SweepError(f"{self.path} cannot be read: line {number} is not a record")
            if "key" not in record:
                self.foreign += 1
                continue
            self._check(number, record)
            self.records[record["key"]] = record

    def _check(self, number: int, record: dict) -> None:
        """The fields the table reads: a status, and a finished run's accuracy."""
        status, accuracy = record.get("status"), record.get("accuracy")
        if status not in (FINISHED, FAILED):
            problem = f"status={status!r}, not {FINISHED!r} or {FAILED!r}"
        elif status == FINISHED and not (
            isinstance(accuracy, int | float)
            and not isinstance(accuracy, bool)
            and 0 <= accuracy <= 1
        ):
            problem = f"accuracy={accuracy!r}, not a number in [0, 1]"
        else:
            return
        raise SweepError(f"{self.path} cannot be read: line {number} has {problem}")

    def drop_torn_tail(self) -> str | None:
        """Rewrite the file without its torn last line, if it has one; returns the warning to
        print."""
        if not self.torn:
            return None
        text = self.path.read_text()
        self.path.write_text(text[: text.rfind("\n") + 1])
        self.torn = False
        return (
            f"warning: dropped the torn last line of {self.path} (a run was cut short while "
            "writing it); that run is trained again"
        )

    def append(self, record: dict) -> None:
        with self._lock:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            self.records[record["key"]] = record
