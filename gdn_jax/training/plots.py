"""The curves of a run, ``curves.png``: training loss, training and held-out accuracy."""

from __future__ import annotations

import sys
from pathlib import Path

from gdn_jax.training.files import write_whole
from gdn_jax.training.metrics_log import MetricsLog


def plot_metrics(log: MetricsLog, out_path: Path) -> None:
    """Training loss, training and held-out accuracy against step, as a PNG; written whole
    or not at all (a full disk leaves no empty or partial file)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = log.read("train"), log.read("eval")
    # Fixed margins: tight_layout took almost half of a plot's time, and every run plots.
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.5))
    fig.subplots_adjust(left=0.1, right=0.98, bottom=0.15, top=0.96, wspace=0.3)
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], lw=0.8)
    ax_loss.set(xlabel="step", ylabel="train loss", yscale="log")
    ax_acc.plot([r["step"] for r in train], [r["accuracy"] for r in train], lw=0.8, label="train")
    ax_acc.plot([r["step"] for r in evals], [r["accuracy"] for r in evals], "o-", label="held-out")
    ax_acc.set(xlabel="step", ylabel="accuracy", ylim=(0, 1.02))
    ax_acc.legend(loc="lower right")
    try:
        write_whole(out_path, lambda partial: fig.savefig(partial, dpi=120, format="png"))
    finally:
        plt.close(fig)


def plot_or_warn(log: MetricsLog, out_path: Path) -> None:
    """The plot at the end of a run, however it ends: a failure is a warning, so that it
    cannot hide the error that ended the run."""
    try:
        plot_metrics(log, out_path)
    except Exception as error:
        print(f"warning: could not plot {out_path} ({error})", file=sys.stderr)
