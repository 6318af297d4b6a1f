"""A stand-in for the training command in the sweep tests: it takes the command's arguments,
writes what a run writes (``metrics.jsonl`` with a held-out evaluation, a checkpoint,
``summary.json``) in a fraction of the time, and behaves as the command does where the sweep
depends on it:

- a run of ``model.mixers=[linear, ...]`` fails like a diverged run (one line, status 1);
- with ``SWEEP_TRAINER_SLOW`` set, a run takes that many seconds, and SIGINT or SIGTERM stop
  it with a checkpoint (status 130 or 143), as the command's step loop does;
- ``--resume`` needs a checkpoint; ``--overwrite`` deletes the earlier run's files.

Each call appends ``<run name> <--resume or --overwrite>`` to ``SWEEP_TRAINER_LOG``. The
accuracy is a function of the learning rate and the seed, so tests know what to expect.
"""

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path


def accuracy(learning_rate: float, seed: int) -> float:
    return round(min(1.0, 0.5 + 10 * learning_rate) - 0.01 * seed, 6)


def main(argv):
    sets = dict(item.split("=", 1) for item in argv[argv.index("--set") + 1 :: 2] if "=" in item)
    out = Path(sets["train.out_dir"])
    resume = "--resume" in argv
    with open(os.environ["SWEEP_TRAINER_LOG"], "a") as log:
        log.write(f"{out.name} {'--resume' if resume else '--overwrite'}\n")
    if resume and not (out / "checkpoints").exists():
        print("train.py: error: --resume: nothing to resume", file=sys.stderr)
        return 2
    if not resume and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    steps = int(sets["train.steps"])
    if sets["model.mixers"].startswith("[linear"):
        print(
            "train.py: error: loss is nan at step 2; no checkpoint was saved yet", file=sys.stderr
        )
        return 1
    stopped = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda signum, frame: stopped.append(signum))
    began = time.monotonic()
    while time.monotonic() - began < float(os.environ.get("SWEEP_TRAINER_SLOW", "0")):
        if stopped:
            (out / "checkpoints" / "1").mkdir(parents=True, exist_ok=True)
            name = signal.Signals(stopped[0]).name
            print(f"train.py: stopped by {name} at step 1; continue with ...", file=sys.stderr)
            return 128 + stopped[0]
        time.sleep(0.02)
    value = accuracy(float(sets["train.learning_rate"]), int(sets["train.seed"]))
    (out / "checkpoints" / str(steps)).mkdir(parents=True, exist_ok=True)
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps(dict(kind="eval", step=steps, loss=1.0, accuracy=value)) + "\n")
    (out / "summary.json").write_text(json.dumps(dict(final_step=steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
