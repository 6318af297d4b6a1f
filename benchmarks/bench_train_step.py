"""The jitted MQAR training step of a config, now and at another revision, in one run.

    python benchmarks/bench_train_step.py --baseline REV --chunk-sizes 16 32 64
    python benchmarks/bench_train_step.py --baseline REV --loop

Builds the model, optimizer and step of the config (``configs/mqar_gdn.yaml`` by default)
once with the current package and once with the package as it was at ``--baseline``
(imported next to it, see ``revision.py``), for each chunk size, and times the steps
alternately on one fixed batch (best of --repeats). Alternating keeps a noisy shared
machine from favouring either side.

``--loop`` times the training loop instead (``training.loop.run``: a fresh batch per step,
the metrics read, logged and shown), which is where the host's work and the device's can
overlap: each revision trains ``--loop-steps`` and ``--loop-steps + 40`` steps (no
evaluation or checkpoint in between), alternately, and the difference over 40 steps is the
time per step, compilation and set-up left out.
"""

from __future__ import annotations

import argparse
import importlib
import time

import jax
import jax.numpy as jnp
from flax import nnx
from revision import import_revision

import gdn_jax
from gdn_jax.training.xla_flags import add_cpu_flags


def step_program(package, config_path, chunk_size):
    """``(jitted step, state, batch)`` for ``package`` (a gdn_jax module tree)."""
    config = package.training.config.load_config(config_path, [f"model.chunk_size={chunk_size}"])
    model = package.models.LanguageModel(config.model, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    optim, step_module = package.training.optim, package.training.step
    optimizer = optim.make_optimizer(config.train, params)
    pure = nnx.to_pure_dict(params)
    examples = package.data.mqar.make_mqar(
        config.data, num_examples=config.train.batch_size, seed=0
    )
    # make_batch moved from training.step to data.mqar; a baseline may predate the move.
    make_batch = getattr(package.data.mqar, "make_batch", None) or step_module.make_batch
    batch = make_batch(*examples)
    step = step_module.make_train_step(
        graphdef,
        optimizer,
        optim.learning_rate_schedule(config.train),
        logits_at_labels=config.train.logits_at_labels,
    )
    state = step_module.TrainState(jnp.zeros((), jnp.int32), pure, optimizer.init(pure))
    return jax.jit(step), state, batch


def loop_seconds(package, config_path, steps, out_dir):
    """Wall time of ``package``'s step loop for ``steps`` steps into ``out_dir`` (the
    summary's ``wall_s``: the steps, without building the model or the held-out set)."""
    sets = [
        f"train.steps={steps}", f"train.eval_every={steps}", f"train.checkpoint_every={steps}",
        "train.warmup_steps=1", "train.eval_examples=32", "train.progress=false",
        f"train.out_dir={out_dir}",
    ]  # fmt: skip
    config = package.training.config.load_config(config_path, sets)
    return package.training.loop.run(config, overwrite=True)["wall_s"]


def time_loops(packages, config_path, steps, extra, repeats):
    """Seconds per step of each package's loop: the best ``steps + extra``-step loop less
    the best ``steps``-step one, over ``extra``. The programs come from a persistent
    compilation cache filled by a first run, so each loop's first step costs the same."""
    import contextlib
    import io
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        jax.config.update("jax_compilation_cache_dir", f"{root}/cache")
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        best = {(name, n): float("inf") for name in packages for n in (steps, steps + extra)}
        with contextlib.redirect_stderr(io.StringIO()):  # --overwrite's notes
            for name, package in packages.items():
                loop_seconds(package, config_path, steps, f"{root}/{name}")  # fill the cache
            for _ in range(repeats):
                for name, package in packages.items():
                    for n in (steps, steps + extra):
                        seconds = loop_seconds(package, config_path, n, f"{root}/{name}")
                        best[name, n] = min(best[name, n], seconds)
    return {name: (best[name, steps + extra] - best[name, steps]) / extra for name in packages}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/mqar_gdn.yaml")
    parser.add_argument("--baseline", default="HEAD", help="git revision to compare with")
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[32])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--xla-defaults", action="store_true", help="leave out training.xla_flags.CPU_FLAGS"
    )
    parser.add_argument("--loop", action="store_true", help="time the training loop")
    parser.add_argument("--loop-steps", type=int, default=10)
    args = parser.parse_args()
    if not args.xla_defaults:
        add_cpu_flags()  # before the first JAX computation starts the backend
    packages = {"now": gdn_jax, args.baseline: import_revision(args.baseline)}
    for package in packages.values():  # the submodules the step needs
        for module in ("models", "data.mqar", "training.config", "training.optim", "training.step"):
            importlib.import_module(f"{package.__name__}.{module}")
    print(f"# {args.config}, {jax.devices()[0].device_kind}, jax {jax.__version__}")
    if args.loop:
        for package in packages.values():
            importlib.import_module(f"{package.__name__}.training.loop")
        best = time_loops(packages, args.config, args.loop_steps, 40, args.repeats)
        print(f"| {' | '.join(f'{name} loop ms/step' for name in packages)} | speed-up |")
        print(f"|{'---|' * len(packages)}---|")
        times = " | ".join(f"{1e3 * best[name]:.0f}" for name in packages)
        print(f"| {times} | {best[args.baseline] / best['now']:.2f}x |")
        return
    print(f"| C | {' | '.join(f'{name} step ms' for name in packages)} | speed-up |")
    print(f"|---|{'---|' * len(packages)}---|")
    for chunk in args.chunk_sizes:
        programs = {}
        for name, package in packages.items():
            step, state, batch = step_program(package, args.config, chunk)
            state, metrics = step(state, batch)  # compile and warm up
            jax.block_until_ready(metrics)
            programs[name] = [step, state, batch]
        best = dict.fromkeys(packages, float("inf"))
        for _ in range(args.repeats):
            for name, program in programs.items():
                step, state, batch = program
                start = time.perf_counter()
                program[1], metrics = step(state, batch)
                jax.block_until_ready(metrics)
                best[name] = min(best[name], time.perf_counter() - start)
        times = " | ".join(f"{1e3 * best[name]:.0f}" for name in packages)
        print(f"| {chunk} | {times} | {best[args.baseline] / best['now']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
