"""The metrics log of a run: one JSON record per line, each with a ``kind`` and a ``step``.

The training loop appends to it, a resumed run cuts it back to its checkpoint, and the plot
and the sweep read it; all of them go through ``MetricsLog``.
"""

from __future__ import annotations

import json
from pathlib import Path


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
        if not self.path.exists():
            return []
        records = [json.loads(line) for line in self.path.read_text().splitlines() if line]
        return [r for r in records if kind is None or r["kind"] == kind]

    def truncate(self, last_step: int) -> None:
        """Drop the records after ``last_step``: a run resumed from there writes them again."""
        if self.writes and self.path.exists():
            kept = [json.dumps(r) + "\n" for r in self.read() if r["step"] <= last_step]
            self.path.write_text("".join(kept))

    def best_eval(self) -> dict:
        """The ``eval`` record with the highest accuracy (the first of equals)."""
        return max(self.read("eval"), key=lambda r: r["accuracy"])
