"""The training command: ``python train.py``, ``gdn-train`` or ``python -m gdn_jax.training.cli``.

Argument parsing and everything the user reads: every user error is one line,
``<prog>: error: ...``, with exit status 2 and no traceback, and so is a run that fails (a
NaN loss, a failed save, out of memory, a filesystem error), with exit status 1; an
interrupted run says how to resume it and exits 130 (SIGINT) or 143 (SIGTERM). The commands
enter through ``gdn_train.main``, which handles a Ctrl-C before this module is imported.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import shlex
import sys

from gdn_jax.training.config_paths import DEFAULT_CONFIG, resolve_config
from gdn_jax.training.entry import program_name
from gdn_jax.training.xla_flags import add_cpu_flags

# What the train extra installs, by the modules the commands import (a core install lacks
# tqdm and matplotlib; Flax itself requires the others).
TRAIN_EXTRA = ("optax", "orbax.checkpoint", "yaml", "tqdm", "matplotlib")


def report_error(prog: str, message, status: int = 2) -> int:
    """Print ``message`` as one line, ``<prog>: error: ...``, and return ``status``; a
    ``RunError`` in the command's words (its ``command_text``: ``--resume``, not
    ``resume=True``)."""
    message = getattr(message, "command_text", message)
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return status


def run_command(prog: str, body, argv, *, before: str = "training began") -> int:
    """``body(argv)``'s exit status, ``argv`` being ``sys.argv[1:]`` when None; a Ctrl-C that
    arrives before the command's own loop takes the signal over is one line and 130."""
    try:
        return body(sys.argv[1:] if argv is None else list(argv))
    except KeyboardInterrupt:
        print(f"{prog}: interrupted before {before}", file=sys.stderr)
        return 130


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its errors on one line (``<prog>: error: ...``, exit status 2)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def missing_train_extra() -> str | None:
    """The reason this install cannot run a training command, one line naming the extra and
    the modules it lacks; None when it can."""

    def found(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent missing, or a module set to None
            return False

    missing = [name for name in TRAIN_EXTRA if not found(name)]
    if not missing:
        return None
    return (
        f"training needs the train extra, which this install lacks (no module "
        f'{", ".join(missing)}): pip install "gdn_jax[train]"'
    )


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config`` and ``--set`` (as ``overrides``), the training commands' config."""
    parser.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        help="YAML config: a path, or the name of a packaged one (default %(default)s)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field, e.g. --set model.d_model=128 (repeatable)",
    )


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog=program_name(),
        description="Train a small Gated DeltaNet on a synthetic task: multi-query "
        "associative recall (MQAR) or state tracking (data.task).",
    )
    add_config_arguments(parser)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--resume", action="store_true", help="continue the run in out_dir")
    which.add_argument(
        "--overwrite", action="store_true", help="delete the earlier run in out_dir first"
    )
    which.add_argument(
        "--compile-only",
        action="store_true",
        help="train nothing: compile the train step for the TPU slice or GPUs --topology ahead of "
        "time and print its memory per chip against the chip's HBM (exit 0 if it fits, 1 if "
        "not); needs libtpu (TPUs) or JAX's CUDA plugin (GPUs), not the chips",
    )
    parser.add_argument(
        "--topology",
        metavar="NAME",
        help="what --compile-only compiles for: a TPU slice, <generation>:<chips per axis>, "
        "e.g. v5e:2x4 (generations v4, v5e, v5p, v6e), or GPUs of one host, h100 or h200 "
        "with an optional count, e.g. h200:8",
    )
    return parser, parser.parse_args(argv)


def main(argv=None) -> int:
    return run_command(program_name(), _main, argv)


def _main(argv) -> int:
    parser, args = parse_args(argv)
    add_cpu_flags()  # before the first JAX computation starts the backend

    fail = functools.partial(report_error, parser.prog)
    if (missing := missing_train_extra()) is not None:
        return fail(missing)

    if args.compile_only or args.topology is not None:
        return _compile_only(args, fail)

    # Imported here so that --help and argument errors do not wait for JAX.
    import jax

    from gdn_jax.training.config import load_config
    from gdn_jax.training.errors import (
        Interrupted,
        NonFiniteLossError,
        NothingToResume,
        OutOfMemory,
        RunError,
        SaveError,
    )
    from gdn_jax.training.loop import run
    from gdn_jax.training.mesh import initialize_distributed

    def command(args) -> str:
        start = ["python", "train.py"] if parser.prog == "train.py" else [parser.prog]
        return shlex.join(start + args)

    initialize_distributed()  # before anything touches a device, the config check included
    try:
        config = load_config(resolve_config(args.config), args.overrides)
    except (ValueError, OSError) as error:
        return fail(error)
    devices = host_devices()
    if isinstance(devices, str):
        return fail(devices)

    def header():  # once every refusal has had its turn: then it is all the command prints
        print(f"devices: {len(devices)} x {devices[0].device_kind} ({jax.default_backend()})")
        print(
            f"model: {config.model.mixers}, d_model={config.model.d_model}; data: "
            f"{config.data.describe()}; out: {config.train.out_dir}"
        )

    try:
        summary = run(config, resume=args.resume, overwrite=args.overwrite, on_start=header)
    except NothingToResume as error:
        fresh = [a for a in argv if a != "--resume"] + (["--overwrite"] if error.overwrite else [])
        return fail(f"{error.command_text}; start it afresh with: {command(fresh)}")
    except RunError as error:
        return fail(error)
    except (NonFiniteLossError, SaveError, OutOfMemory, OSError) as error:
        return fail(error, status=1)
    except Interrupted as error:
        again = [a for a in argv if a != "--overwrite"] + ([] if args.resume else ["--resume"])
        print(
            f"{parser.prog}: stopped by {error}; continue with: {command(again)}",
            file=sys.stderr,
        )
        return 128 + error.signum
    accuracy, loss = (
        "none yet" if summary[k] is None else f"{summary[k]:.4f}"
        for k in ("eval_accuracy", "eval_loss")
    )
    if summary.get("already_finished"):
        print(
            f"{config.train.out_dir} has finished (step {summary['final_step']}, held-out "
            f"accuracy {accuracy}); nothing to resume"
        )
        return 0
    print(
        f"step {summary['final_step']}: held-out accuracy {accuracy}, loss {loss}, "
        f"{summary['wall_s']:.0f} s; curves in {config.train.out_dir}/curves.png"
    )
    return 0


def _compile_only(args, fail) -> int:
    """``--compile-only --topology NAME``: every check before the compiler starts, then the
    compile and its table (``compile_only.report``). Writes nothing."""
    from gdn_jax import gpu_compile, tpu_compile
    from gdn_jax.training.config import load_config

    if not args.compile_only:
        return fail("--topology is for --compile-only")
    if args.topology is None:
        return fail("--compile-only needs --topology, e.g. --topology v5e:2x4 or h200:8")
    gpu = args.topology.split(":")[0] in gpu_compile.TARGETS
    try:
        parse = gpu_compile.parse_target if gpu else tpu_compile.parse_topology
        topology = parse(args.topology)
    except ValueError as error:  # a GPU target's message names its own forms
        gpus = f"; or GPUs of one host: {', '.join(gpu_compile.TARGETS)}[:count]"
        return fail(f"{error}{'' if gpu else gpus}")
    try:
        config = load_config(resolve_config(args.config), args.overrides)
    except (ValueError, OSError) as error:
        return fail(error)
    if gpu and not gpu_compile.plugin_installed():
        return fail(f"compiling for a GPU needs JAX's CUDA plugin: {gpu_compile.INSTALL_COMMAND}")
    if not gpu and not tpu_compile.libtpu_installed():
        return fail(tpu_compile.LibtpuMissing())
    if not gpu:
        # This host only compiles: its own devices take no part, and libtpu is told it is
        # the slice's one worker (else it warns that it cannot find out).
        tpu_compile.quiet_libtpu(topology)
    import jax

    from gdn_jax.training import compile_only
    from gdn_jax.training.errors import RunError

    if not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")
    elif isinstance(devices := host_devices(), str):
        return fail(
            f"{devices}; --compile-only compiles on this host and needs no accelerator of its "
            "own: unset JAX_PLATFORMS or set JAX_PLATFORMS=cpu"
        )
    try:
        find = gpu_compile.target_devices if gpu else tpu_compile.topology_devices
        devices = find(topology.name)
        memory = compile_only.step_memory(config, topology, devices)
    except (ValueError, RunError, gpu_compile.GpuCompileMissing) as error:
        return fail(error)
    mesh = _mesh_text(config, devices)
    if gpu:
        where = f"{topology.chips} x {topology.model.upper()} (mesh {mesh})"
    else:
        where = f"TPU {topology.name} ({topology.chips} chips, mesh {mesh})"
    print(f"train step of {args.config} for {where}")
    print("\n".join(compile_only.report(memory, topology, devices)))
    return 0 if memory.fits else 1


def host_devices():
    """``jax.devices()``, or the reason this host's backends cannot start (a platform in
    ``JAX_PLATFORMS`` that the host does not have, say) as one line."""
    import jax

    platforms = os.environ.get("JAX_PLATFORMS")
    try:
        return jax.devices()
    except RuntimeError as error:
        reason = str(error).split(" (set JAX_PLATFORMS=")[0]
        return f"JAX_PLATFORMS={platforms}: {reason}" if platforms else reason
    except AssertionError:
        # JAX skips "cuda" on a host without a visible NVIDIA GPU rather than raising, then
        # asserts that some backend started: the user named only platforms this host lacks.
        return (
            f"JAX_PLATFORMS={platforms}: no backend of these platforms can start on this host "
            "(JAX skips cuda where it sees no NVIDIA GPU)"
        )


def _mesh_text(config, devices) -> str:
    from gdn_jax.training.mesh import AXES, mesh_shape

    sizes = mesh_shape(config.train.mesh, len(devices))
    return " x ".join(f"{axis}={size}" for axis, size in zip(AXES, sizes, strict=True))


if __name__ == "__main__":
    from gdn_jax.training.entry import launch

    sys.exit(launch(main))
