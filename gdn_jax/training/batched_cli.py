"""The command that trains several runs of one config in one process (``batched.py``).

    python -m gdn_jax.training.batched_cli --config mqar_gdn.yaml --set train.steps=600 \\
        --run runs/lr3e-3_s0 0 3e-3 --run runs/lr3e-3_s1 1 3e-3 --run runs/lr1e-2_s0 0 1e-2

Each ``--run OUT_DIR SEED LEARNING_RATE`` is the config's run with ``train.out_dir``,
``train.seed`` and ``train.learning_rate`` set, in a directory that ``train.py --resume``
continues alone. As with ``train.py``, a user error is one line, ``<prog>: error: ...``, with
exit status 2, before anything is written. A run that fails (a NaN loss, a failed save) is
one line, ``failure_line``, while the others go on, and the command then exits 1. Stopped by
SIGINT or SIGTERM, every run still training saves a checkpoint and the command says how to
resume them and exits 130 or 143.
"""

from __future__ import annotations

import functools
import json
import shlex
import sys

from gdn_jax.training.cli import (
    OneLineParser,
    add_config_arguments,
    host_devices,
    report_error,
    run_command,
)
from gdn_jax.training.config_paths import resolve_config
from gdn_jax.training.xla_flags import add_cpu_flags

PROG = "python -m gdn_jax.training.batched_cli"


def failure_line(out_dir: str, message: str) -> str:
    """The stderr line of a run that failed, ``out_dir`` as its ``--run`` gave it."""
    return f"{PROG}: error: {out_dir}: {' '.join(message.split())}"


def failures(stderr: str, out_dirs) -> dict[str, str]:
    """``{out_dir: its failure_line}`` of the runs that ``stderr`` says failed."""
    found = {}
    for line in stderr.splitlines():
        for out_dir in out_dirs:
            if line.startswith(failure_line(out_dir, "")):
                found[out_dir] = line
    return found


def parse_args(argv):
    parser = OneLineParser(
        prog=PROG,
        description="Train several runs of one config, differing in seed and learning rate, "
        "in one process, each as train.py trains it; each run directory is one that train.py "
        "--resume continues.",
    )
    add_config_arguments(parser)  # for every run
    parser.add_argument(
        "--run",
        dest="runs",
        nargs=3,
        action="append",
        required=True,
        metavar=("OUT_DIR", "SEED", "LEARNING_RATE"),
        help="one run: its train.out_dir, train.seed and train.learning_rate (repeatable)",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--resume", action="store_true", help="continue every run")
    which.add_argument(
        "--overwrite", action="store_true", help="delete the earlier runs in the OUT_DIRs first"
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    return run_command(PROG, _main, argv)


_fail = functools.partial(report_error, PROG)


def _main(argv) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as done:  # --help, or an argument argparse refused (one line)
        return done.code
    add_cpu_flags()  # before the first JAX computation starts the backend
    from gdn_jax.training import batched
    from gdn_jax.training.errors import Interrupted, OutOfMemory, RunError

    try:
        configs = _configs(args)
    except (ValueError, OSError) as error:
        return _fail(error)
    devices = host_devices()
    if isinstance(devices, str):
        return _fail(devices)

    def header():  # once every refusal has had its turn: then it is all the command prints
        kind, data = devices[0].device_kind, configs[0].data.describe()
        print(f"{len(configs)} runs on {kind}; data: {data}")

    try:
        outcomes = batched.run(
            configs, resume=args.resume, overwrite=args.overwrite, on_start=header
        )
    except RunError as error:
        return _fail(error)
    except (OutOfMemory, OSError) as error:
        return _fail(error, status=1)
    except Interrupted as error:
        again = [a for a in argv if a != "--overwrite"] + ([] if args.resume else ["--resume"])
        command = shlex.join([*PROG.split(), *again])
        print(f"{PROG}: stopped by {error}; continue with: {command}", file=sys.stderr)
        return 128 + error.signum
    failed = 0
    for (out_dir, _, _), outcome in zip(args.runs, outcomes, strict=True):
        if isinstance(outcome, Exception):
            print(failure_line(out_dir, str(outcome)), file=sys.stderr)
            failed += 1
        else:
            print(f"{out_dir}: {_ending(outcome)}")
    return 1 if failed else 0


def _configs(args) -> list:
    """Each ``--run``'s config; ``ValueError`` for a bad one, naming the run."""
    from gdn_jax.training.batched import VARYING, check_group
    from gdn_jax.training.config import load_config

    for item in args.overrides:
        field = item.partition("=")[0].strip()
        if field in VARYING:
            raise ValueError(f"--set {item}: each --run gives its own {field}")
    path = resolve_config(args.config)
    configs = []
    for out_dir, seed, rate in args.runs:
        # The directory as a quoted string: YAML would read 2024 or "yes" as another type.
        own = [f"train.out_dir={json.dumps(out_dir)}", f"train.seed={seed}"]
        own.append(f"train.learning_rate={rate}")
        try:
            configs.append(load_config(path, [*args.overrides, *own]))
        except ValueError as error:
            raise ValueError(f"--run {out_dir} {seed} {rate}: {error}") from None
    check_group(configs)
    return configs


def _ending(summary: dict) -> str:
    accuracy, loss = (
        "none yet" if summary[k] is None else f"{summary[k]:.4f}"
        for k in ("eval_accuracy", "eval_loss")
    )
    if summary.get("already_finished"):
        return f"has finished (step {summary['final_step']}, held-out accuracy {accuracy})"
    return (
        f"step {summary['final_step']}: held-out accuracy {accuracy}, loss {loss}, "
        f"{summary['wall_s']:.0f} s"
    )


if __name__ == "__main__":
    sys.exit(main())
