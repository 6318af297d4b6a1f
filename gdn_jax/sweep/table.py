"""``table.md`` and ``accuracy.png``: what a sweep's records say, per mixer, pairs and width.

For each table cell (mixer, key-value pairs, width) the learning rate with the best mean
held-out accuracy over its seeds is shown, with the mean, the range over seeds and their
number, how those runs ended (early stop, plateau or still rising) and, for those that
stopped early, after how many steps: where several mixers reach the target accuracy, the
accuracy at the stop is only where it crossed the target, and the steps tell them apart. A
run that failed is counted as failed, never as an accuracy, and a table cell whose runs all
failed reads "failed". Only the records of the sweep's own runs are shown, under
the command that made them.

A sweep replaces only the ``OUTPUTS`` it wrote itself, as ``WRITTEN`` in ``--out`` records:
a file of the same name that it did not write is refused unless ``--overwrite``.
"""

from __future__ import annotations

import os
import statistics
from collections import defaultdict
from pathlib import Path

from gdn_jax.models.mixers import MIXERS, RENAMED
from gdn_jax.sweep.cells import Cell
from gdn_jax.sweep.results import FAILED, FINISHED, SweepError
from gdn_jax.training.files import write_whole


def best_per_cell(runs: list[tuple[Cell, dict | None]], grid_seeds=None) -> dict:
    """``{(mixer, pairs, width): summary}`` from each run's cell and record (None: not run).

    Each cell's learning rate is the one with the best mean accuracy over the seeds of
    ``grid_seeds`` (all seeds when None; the smaller rate on a tie; a rate without a finished
    run of those seeds comes last). A summary holds that ``learning_rate`` and its
    ``accuracies`` (one per finished run at it, of any seed), their ``records`` and the
    ``failed`` and ``missing`` counts at it."""
    by_rate = defaultdict(lambda: defaultdict(list))
    for cell, record in runs:
        by_rate[cell.group][cell.learning_rate].append((cell.seed, record))
    table = {}
    for group, rates in by_rate.items():
        rate = max(rates, key=lambda rate: (_grid_mean(rates[rate], grid_seeds), -rate))
        records = [record for _, record in rates[rate]]
        table[group] = dict(
            learning_rate=rate,
            accuracies=[r["accuracy"] for r in records if r and r["status"] == FINISHED],
            records=[r for r in records if r and r["status"] == FINISHED],
            failed=sum(1 for r in records if r and r["status"] == FAILED),
            missing=sum(1 for r in records if r is None),
        )
    return table


def _grid_mean(runs: list[tuple[int, dict | None]], grid_seeds) -> float:
    """The mean accuracy of the finished ``(seed, record)`` runs of ``grid_seeds`` (all when
    None); -1 without one."""
    chosen = [r for seed, r in runs if grid_seeds is None or seed in grid_seeds]
    accuracies = [r["accuracy"] for r in chosen if r and r["status"] == FINISHED]
    return statistics.fmean(accuracies) if accuracies else -1.0


# A run that ended at its budget "rose" when its held-out accuracy gained at least RISE over
# the last quarter of its steps, else it had reached a plateau.
RISE = 0.02


def ending(record: dict) -> str | None:
    """How a finished run ended: "target" (stopped early at its target accuracy),
    "plateau" or "rising" (ran to its budget); None for a record that does not say."""
    if record.get("reason") == "target":
        return "target"
    evals, final = record.get("evals"), record.get("final_step")
    if record.get("reason") != "steps" or not evals or final is None:
        return None
    earlier = [accuracy for step, accuracy in evals if step <= 0.75 * final]
    gain = evals[-1][1] - (earlier[-1] if earlier else 0.0)
    return "rising" if gain >= RISE else "plateau"


def endings_text(summary: dict | None) -> str:
    """The count of each way the runs at a cell's chosen rate ended: "3 target"."""
    if summary is None:
        return "-"
    counts = {}
    for record in summary["records"]:
        way = ending(record) or "not recorded"
        counts[way] = counts.get(way, 0) + 1
    return ", ".join(f"{n} {way}" for way, n in sorted(counts.items())) or "-"


def steps_text(summary: dict | None) -> str:
    """The steps to the target of the runs at a cell's chosen rate that stopped there:
    "450 (300-600), 2 of 3 runs"; "none of 3 runs" when none did."""
    if summary is None or not summary["records"]:
        return "-"
    steps = [r["final_step"] for r in summary["records"] if ending(r) == "target"]
    runs = len(summary["records"])
    if not steps:
        return f"none of {runs} runs"
    text = f"{statistics.fmean(steps):.0f}"
    if len(steps) > 1:
        text += f" ({min(steps)}-{max(steps)})"
    return f"{text}, {len(steps)} of {runs} runs"


def cell_text(summary: dict | None) -> str:
    if summary is None:
        return "-"
    accuracies, failed, missing = summary["accuracies"], summary["failed"], summary["missing"]
    if not accuracies:
        return "failed" if failed else "not run yet"
    text = f"{statistics.fmean(accuracies):.3f}"
    if len(accuracies) > 1:
        text += f" ({min(accuracies):.3f}-{max(accuracies):.3f}, {len(accuracies)} seeds)"
    notes = [f"{n} {what}" for n, what in ((failed, "failed"), (missing, "not run yet")) if n]
    text += f" [lr {summary['learning_rate']:g}]"
    return text + (f" ({', '.join(notes)})" if notes else "")


TABLE, PLOT = "table.md", "accuracy.png"
OUTPUTS = (TABLE, PLOT)
# The record, in --out, of the OUTPUTS a sweep wrote there: one name a line after this one.
WRITTEN = ".gdn_jax-sweep"
WRITTEN_HEAD = "# written by python -m gdn_jax.sweep, which replaces them on its next run"


def written(out: Path) -> set[str]:
    """The ``OUTPUTS`` that a sweep wrote in ``out`` (``WRITTEN``)."""
    try:
        lines = (out / WRITTEN).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return set()
    return set(lines[1:]) & set(OUTPUTS) if lines[:1] == [WRITTEN_HEAD] else set()


def check_outputs(out: Path, overwrite: bool) -> None:
    """Raise ``SweepError`` when ``out`` holds one of the ``OUTPUTS`` that no sweep wrote
    there (``written``), unless ``overwrite``: the sweep would replace a file of the user's."""
    theirs = [n for n in OUTPUTS if os.path.lexists(out / n) and n not in written(out)]
    if theirs and not overwrite:
        raise SweepError(
            f"--out {out} holds {', '.join(theirs)}, which no sweep wrote there (no record in "
            f"{out / WRITTEN}); move it away, or replace it with --overwrite"
        )


def mark_written(out: Path, name: str) -> None:
    """Record in ``out/WRITTEN`` that the sweep writes ``name`` there, before it does: a
    crash between the two leaves a record of a file that is the sweep's or absent."""
    names = written(out) | {name}
    text = "\n".join([WRITTEN_HEAD, *sorted(names)]) + "\n"
    write_whole(out / WRITTEN, lambda partial: partial.write_text(text))


def write_table(
    path: Path, runs: list[tuple[Cell, dict | None]], command: str, grid_seeds=None
) -> dict:
    """Write the table of ``runs`` under ``command`` to ``path`` (whole or not at all), each
    cell at the rate ``best_per_cell(runs, grid_seeds)`` chooses; returns its summaries."""
    table = best_per_cell(runs, grid_seeds)
    # Records made under a mixer's old name (RENAMED) keep their rows, under that name.
    mixers = [m for m in (*MIXERS, *RENAMED) if any(g[0] == m for g in table)]
    pairs = sorted({g[1] for g in table})
    widths = sorted({g[2] for g in table})
    lines = [f"Command: `{command}`", ""]
    seeds_text = (
        "seeds" if grid_seeds is None else f"seed(s) {', '.join(map(str, sorted(grid_seeds)))}"
    )
    for width in widths:
        lines += [
            f"d_model = {width}: held-out accuracy at the learning rate with the best mean over "
            f"{seeds_text}: mean (min-max over seeds) [learning rate]",
            "",
            *_rows(table, mixers, pairs, width, cell_text),
            "",
            f"d_model = {width}: how those runs ended: at the target accuracy (early stop), "
            f"or at the step budget on a plateau or still rising (at least {RISE} gained over "
            "their last quarter)",
            "",
            *_rows(table, mixers, pairs, width, endings_text),
            "",
            f"d_model = {width}: steps to the target accuracy of those that stopped there: "
            "mean (min-max), and how many of the runs did",
            "",
            *_rows(table, mixers, pairs, width, steps_text),
            "",
        ]
    text = "\n".join(lines)
    mark_written(path.parent, path.name)
    write_whole(path, lambda partial: partial.write_text(text))
    return table


def _rows(table: dict, mixers, pairs, width: int, text_of) -> list[str]:
    """A Markdown table of ``text_of(summary)`` at ``width``: a row per mixer, a column per
    number of pairs."""
    lines = ["| mixer | " + " | ".join(f"{p} kv pairs" for p in pairs) + " |"]
    lines.append("|---|" + "---|" * len(pairs))
    for mixer in mixers:
        cells = [text_of(table.get((mixer, p, width))) for p in pairs]
        lines.append(f"| {mixer} | " + " | ".join(cells) + " |")
    return lines


def write_plot(path: Path, table: dict) -> None:
    """Mean held-out accuracy against key-value pairs, the range over seeds as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widths = sorted({g[2] for g in table})
    pairs = sorted({g[1] for g in table})
    mixers = [m for m in (*MIXERS, *RENAMED) if any(g[0] == m for g in table)]
    fig, axes = plt.subplots(1, len(widths), figsize=(4.5 * len(widths), 3.5), squeeze=False)
    for ax, width in zip(axes[0], widths, strict=True):
        for mixer in mixers:
            points = [
                (p, table[(mixer, p, width)]["accuracies"])
                for p in pairs
                if table.get((mixer, p, width), {}).get("accuracies")
            ]
            if not points:
                continue
            xs = [p for p, _ in points]
            means = [statistics.fmean(a) for _, a in points]
            low = [m - min(a) for m, (_, a) in zip(means, points, strict=True)]
            high = [max(a) - m for m, (_, a) in zip(means, points, strict=True)]
            ax.errorbar(xs, means, yerr=[low, high], fmt="o-", capsize=3, label=mixer)
        ax.set(
            title=f"MQAR, d_model={width}",
            xlabel="key-value pairs",
            xscale="log",
            ylabel="held-out accuracy (mean, range)",
            ylim=(0, 1.02),
        )
        ax.set_xticks(pairs, [str(p) for p in pairs])
        ax.minorticks_off()  # the log axis would label 20, 30, ... over the pair counts
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:  # --table-only before any run finished: an empty plot that says so
            ax.text(0.5, 0.5, "no finished runs yet", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    mark_written(path.parent, path.name)
    try:
        write_whole(path, lambda partial: fig.savefig(partial, dpi=120, format="png"))
    finally:
        plt.close(fig)
