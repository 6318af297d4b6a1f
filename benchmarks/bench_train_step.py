"""The jitted MQAR training step of a config, now and at another revision, in one run.

    python benchmarks/bench_train_step.py --baseline 6fca74a --chunk-sizes 16 32 64

Builds the model, optimizer and step of the config (``configs/mqar_gdn.yaml`` by default)
once with the current package and once with the package as it was at ``--baseline``
(imported next to it, see ``revision.py``), for each chunk size, and times the steps
alternately on one fixed batch (best of --repeats). Alternating keeps a noisy shared
machine from favouring either side.
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/mqar_gdn.yaml")
    parser.add_argument("--baseline", default="HEAD", help="git revision to compare with")
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[32])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--xla-defaults", action="store_true", help="leave out training.xla_flags.CPU_FLAGS"
    )
    args = parser.parse_args()
    if not args.xla_defaults:
        add_cpu_flags()  # before the first JAX computation starts the backend
    packages = {"now": gdn_jax, args.baseline: import_revision(args.baseline)}
    for package in packages.values():  # the submodules the step needs
        for module in ("models", "data.mqar", "training.config", "training.optim", "training.step"):
            importlib.import_module(f"{package.__name__}.{module}")
    print(f"# {args.config}, {jax.devices()[0].device_kind}, jax {jax.__version__}")
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
