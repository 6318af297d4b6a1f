"""The metrics log of a run: one JSON record per line, each with a ``kind`` and a ``step``.

The training loop appends to it, a resumed run cuts it back to its checkpoint, and the plot
and the sweep read it; all of them go through ``MetricsLog``. A last line without its newline
that does not parse was cut short by a crash mid-write: it is no record, and a resumed run
drops it (the checkpoint, not the log, says where the run stands). Any other line that is not
a record is damage, a ``RunError`` naming the file and the line.
"""

from __future__ import annotations

import json
from pathlib import Path

from gdn_jax.training.errors import unreadable
from gdn_jax.training.files import read_text


class MetricsLog:
    """``metrics.jsonl`` in a run directory: ``train`` records per step, ``eval`` records
    per evaluation."""

    def __init__(self, path: str | Path, *, writes: bool = True):
        """``writes=False``: a reader only (the other processes of a multi-process run,
        where process 0 keeps the log)."""
        self.path = Path(path)
        self.writes = writes

    def append(self, kind: str, step: int, **values) -> None:
        if not self.writes:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(dict(kind=kind, step=step, **values)) + "\n")

    def read(self, kind: str | None = None) -> list[dict]:
        """Every record (of ``kind``, when given), oldest first; none when there is no log."""
        records, _ = self._parse()
        return [r for r in records if kind is None or r["kind"] == kind]

    def torn_tail(self) -> bool:
        """Whether the last line was cut short by a crash mid-write (``read`` skips it)."""
        return self._parse()[1]

    def truncate(self, last_step: int) -> None:
        """Drop the records after ``last_step`` and a torn last line: a run resumed from there
        writes them again."""
        if self.writes and self.path.exists():
            kept = [json.dumps(r) + "\n" for r in self.read() if r["step"] <= last_step]
            self.path.write_text("".join(kept))

    def _parse(self) -> tuple[list[dict], bool]:
        """The records, and whether a torn last line was left out."""
        if not self.path.exists():
            return [], False
        text = read_text(self.path)
        lines = text.splitlines()
        records = []
        for number, line in enumerate(lines, 1):
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                if number == len(lines) and not text.endswith("\n"):
                    return records, True
                raise unreadable(self.path, f"line {number} is not JSON ({error.msg})") from None
            if not (
                isinstance(record, dict) and "kind" in record and type(record.get("step")) is int
            ):
                raise unreadable(self.path, f"line {number} is not a record with a kind and a step")
            records.append(record)
        return records, False

    def best_eval(self) -> dict:
        """The ``eval`` record with the highest accuracy (the first of equals)."""
        return max(self.read("eval"), key=lambda r: r["accuracy"])
