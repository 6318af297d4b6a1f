"""A stand-in for the training commands in the sweep tests: it takes the arguments of the
training command (one run) or of the batched command (a ``--run OUT_DIR SEED LR`` for each of
several), writes what a run writes (``metrics.jsonl`` with a held-out evaluation, a
checkpoint, ``summary.json``) in a fraction of the time, and behaves as the commands do where
the sweep depends on it:

- a run of ``model.mixers=[linear, ...]`` fails like a diverged run (one line, status 1), and
  so does a run with a learning rate above 0.5, alone among the batched command's runs (its
  ``failure_line``, the others finished, status 1);
- with ``SWEEP_TRAINER_SLOW`` set, a call takes that many seconds, and SIGINT or SIGTERM stop
  it with a checkpoint of each run (status 130 or 143), as the commands' step loops do;
- ``--resume`` needs a checkpoint of every run; ``--overwrite`` deletes the earlier runs'
  files.

Each call appends ``<run name> <--resume or --overwrite>`` for each of its runs to
``SWEEP_TRAINER_LOG``, and the names of its runs on one line to ``SWEEP_TRAINER_LOG`` +
``.processes``. The accuracy is a function of the learning rate and the seed, so tests know
what to expect: a run reaching 0.99 stops at its target, seed 1's runs gain 0.05 over their
second half and the others none.
"""

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path


def failure_line(out_dir: str, message: str) -> str:
    """The batched command's line for a failed run (``batched_cli.failure_line``, which
    test_sweep.py holds this to: importing gdn_jax here would start JAX in every call)."""
    return f"python -m gdn_jax.training.batched_cli: error: {out_dir}: {message}"


def accuracy(learning_rate: float, seed: int) -> float:
    return round(min(1.0, 0.5 + 10 * learning_rate) - 0.01 * seed, 6)


def main(argv):
    sets = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--set")
    batched = "--run" in argv
    if batched:
        runs = [argv[i + 1 : i + 4] for i, a in enumerate(argv) if a == "--run"]
    else:
        runs = [[sets["train.out_dir"], sets["train.seed"], sets["train.learning_rate"]]]
    outs = [Path(out) for out, _, _ in runs]
    resume = "--resume" in argv
    log = os.environ["SWEEP_TRAINER_LOG"]
    with open(log, "a") as f:
        f.writelines(f"{out.name} {'--resume' if resume else '--overwrite'}\n" for out in outs)
    with open(log + ".processes", "a") as f:
        f.write(" ".join(out.name for out in outs) + "\n")
    if resume and not all((out / "checkpoints").exists() for out in outs):
        print("train.py: error: --resume: nothing to resume", file=sys.stderr)
        return 2
    for out in outs:
        if not resume and out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
    steps = int(sets["train.steps"])
    if sets["model.mixers"].startswith("[linear"):
        message = "loss is nan at step 2; no checkpoint was saved yet"
        for out, _, _ in runs:
            line = failure_line(out, message) if batched else f"train.py: error: {message}"
            print(line, file=sys.stderr)
        return 1
    stopped = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda signum, frame: stopped.append(signum))
    began = time.monotonic()
    while time.monotonic() - began < float(os.environ.get("SWEEP_TRAINER_SLOW", "0")):
        if stopped:
            for out in outs:
                (out / "checkpoints" / "1").mkdir(parents=True, exist_ok=True)
            name = signal.Signals(stopped[0]).name
            print(f"train.py: stopped by {name} at step 1; continue with ...", file=sys.stderr)
            return 128 + stopped[0]
        time.sleep(0.02)
    failed = 0
    for (out, seed, rate), path in zip(runs, outs, strict=True):
        if batched and float(rate) > 0.5:
            print(
                failure_line(out, "loss is nan at step 3; no checkpoint was saved yet"),
                file=sys.stderr,
            )
            failed += 1
            continue
        (path / "checkpoints" / str(steps)).mkdir(parents=True, exist_ok=True)
        with open(path / "metrics.jsonl", "a") as f:
            value = accuracy(float(rate), int(seed))
            halfway = value - (0.05 if int(seed) == 1 else 0.0)
            for step, reached in ((steps // 2, halfway), (steps, value)):
                f.write(json.dumps(dict(kind="eval", step=step, loss=1.0, accuracy=reached)))
                f.write("\n")
        reason = "target" if value >= 0.99 else "steps"
        (path / "summary.json").write_text(json.dumps(dict(final_step=steps, reason=reason)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
