"""Sweep mixers x key-value pairs x width, with a learning-rate grid per cell.

    python -m gdn_jax.sweep --out docs/sweep --jobs 2

Each run is the training command (``gdn_jax.training.cli``) on a config derived from ``--config``; its best held-out
accuracy is appended to ``<out>/results.jsonl`` as soon as it ends, so an interrupted sweep
resumes where it stopped. At the end ``<out>/table.md`` holds, per cell, the best accuracy
over the learning rates, and ``<out>/accuracy.png`` plots it. Recall results of recurrent
models depend strongly on the learning rate (Zoology), hence the grid.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gdn_jax.models.config import MIXERS
from gdn_jax.training.cli import DEFAULT_CONFIG, resolve_config
from gdn_jax.training.config import load_config
from gdn_jax.training.metrics_log import MetricsLog
from gdn_jax.training.run_dir import METRICS


def cell_overrides(mixer, kv_pairs, d_model, lr, *, layers, steps, run_dir):
    return [
        f"model.mixers=[{', '.join([mixer] * layers)}]",
        f"model.d_model={d_model}",
        f"data.num_kv_pairs={kv_pairs}",
        f"train.learning_rate={lr}",
        f"train.steps={steps}",
        f"train.out_dir={run_dir}",
        "train.progress=false",
    ]


def run_cell(args, cell, results_path: Path, threads_per_job: int):
    mixer, kv_pairs, d_model, lr = cell
    name = f"{mixer}_kv{kv_pairs}_d{d_model}_lr{lr:g}"
    run_dir = Path(args.runs) / name
    overrides = cell_overrides(
        mixer, kv_pairs, d_model, lr, layers=args.layers, steps=args.steps, run_dir=run_dir
    )
    env = dict(os.environ)
    if threads_per_job == 1:  # small ops do not scale across cores; processes do
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
        ).strip()
    # The training command itself, in a process of its own (one core per job); --overwrite
    # because a cell missing from results.jsonl is restarted from its first step.
    command = [sys.executable, "-m", "gdn_jax.training.cli", "--config", args.config, "--overwrite"]
    for item in (*overrides, *args.set):
        command += ["--set", item]
    began = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    record = dict(mixer=mixer, kv_pairs=kv_pairs, d_model=d_model, learning_rate=lr)
    record["wall_s"] = round(time.perf_counter() - began, 1)
    if result.returncode == 0:
        best = MetricsLog(run_dir / METRICS).best_eval()
        record["accuracy"], record["best_step"] = best["accuracy"], best["step"]
    else:  # e.g. a diverged run (NaN loss): it counts as not solving the cell
        record["accuracy"], record["error"] = 0.0, result.stderr.strip().splitlines()[-1:]
    with results_path.open("a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"{name}: {record['accuracy']:.4f} in {record['wall_s']:.0f} s", flush=True)


def summarise(results_path: Path, out: Path, command: str) -> None:
    """Best accuracy over learning rates per (mixer, kv pairs, d_model): table and plot."""
    records = [json.loads(line) for line in results_path.read_text().splitlines()]
    best = {}
    for r in records:
        key = (r["mixer"], r["kv_pairs"], r["d_model"])
        if key not in best or r["accuracy"] > best[key]["accuracy"]:
            best[key] = r
    mixers = [m for m in MIXERS if any(k[0] == m for k in best)]
    widths = sorted({k[2] for k in best})
    pairs = sorted({k[1] for k in best})
    lines = [f"Command: `{command}`", ""]
    for d_model in widths:
        lines += [
            f"d_model = {d_model}: best held-out accuracy over the learning-rate grid "
            "(learning rate in brackets)",
            "",
            "| mixer | " + " | ".join(f"{p} kv pairs" for p in pairs) + " |",
            "|---|" + "---|" * len(pairs),
        ]
        for mixer in mixers:
            cells = []
            for p in pairs:
                r = best.get((mixer, p, d_model))
                cells.append("-" if r is None else f"{r['accuracy']:.3f} ({r['learning_rate']:g})")
            lines.append(f"| {mixer} | " + " | ".join(cells) + " |")
        lines.append("")
    (out / "table.md").write_text("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(widths), figsize=(4.5 * len(widths), 3.5), squeeze=False)
    for ax, d_model in zip(axes[0], widths, strict=True):
        for mixer in mixers:
            xs = [p for p in pairs if (mixer, p, d_model) in best]
            ax.plot(xs, [best[(mixer, p, d_model)]["accuracy"] for p in xs], "o-", label=mixer)
        ax.set(
            title=f"MQAR, d_model={d_model}",
            xlabel="key-value pairs",
            xscale="log",
            ylabel="best held-out accuracy",
            ylim=(0, 1.02),
        )
        ax.set_xticks(pairs, [str(p) for p in pairs])
        ax.minorticks_off()  # the log axis would label 20, 30, ... over the pair counts
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "accuracy.png", dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="base config (path or name)")
    parser.add_argument("--mixers", nargs="+", default=list(MIXERS), choices=MIXERS)
    parser.add_argument("--kv-pairs", nargs="+", type=int, default=[16, 32, 64])
    parser.add_argument("--d-models", nargs="+", type=int, default=[64])
    parser.add_argument("--learning-rates", nargs="+", type=float, default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1300, help="step budget of every run")
    parser.add_argument("--set", action="append", default=[], help="extra override, repeatable")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel, one core each")
    parser.add_argument("--out", default="docs/sweep", help="results, table and plot")
    parser.add_argument("--runs", default="runs/sweep", help="per-run output directories")
    args = parser.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.jsonl"
    done = set()
    if results_path.exists():
        for line in results_path.read_text().splitlines():
            r = json.loads(line)
            done.add((r["mixer"], r["kv_pairs"], r["d_model"], r["learning_rate"]))
    # Key-value pairs outermost, so that a sweep cut short still compares every mixer.
    cells = [
        (mixer, kv_pairs, d_model, lr)
        for kv_pairs, d_model, mixer, lr in itertools.product(
            args.kv_pairs, args.d_models, args.mixers, args.learning_rates
        )
        if (mixer, kv_pairs, d_model, lr) not in done
    ]
    for mixer, kv_pairs, d_model, lr in cells:  # fail on a bad cell before running any
        load_config(
            resolve_config(args.config),
            [
                *cell_overrides(
                    mixer, kv_pairs, d_model, lr, layers=args.layers, steps=args.steps, run_dir="x"
                ),
                *args.set,
            ],
        )
    threads = 1 if args.jobs > 1 else 0
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(lambda cell: run_cell(args, cell, results_path, threads), cells))
    command = "python -m gdn_jax.sweep " + " ".join(argv if argv is not None else sys.argv[1:])
    summarise(results_path, out, command)
    print((out / "table.md").read_text())


if __name__ == "__main__":
    main()
