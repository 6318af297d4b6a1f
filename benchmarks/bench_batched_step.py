"""The training step of several runs as one program against one run's, per run.

    python benchmarks/bench_batched_step.py --lanes 1 4 8 --batch-sizes 8 32

Times the jitted step of ``training/batched.py`` (``state.stacked_steps``: the run's own
step under ``jax.vmap``) at each number of lanes, and a single run's step of the config at
each ``--batch-sizes``, on one fixed batch: all compiled first, then timed in turn, best of
--repeats rounds of 5 steps each. Where a step is mostly per-operation overhead, the time per run falls with more
lanes or a larger batch; where it is work, it stays.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import numpy as np

from gdn_jax.data.mqar import split_seeds
from gdn_jax.training import loop
from gdn_jax.training import mesh as mesh_lib
from gdn_jax.training.cli import resolve_config
from gdn_jax.training.config import load_config
from gdn_jax.training.platforms import use_host_platforms
from gdn_jax.training.state import on_mesh, stacked_steps, train_setup
from gdn_jax.training.xla_flags import add_cpu_flags


def best_seconds(programs: dict, repeats: int) -> dict:
    """``{name: best seconds of one call}`` of ``{name: (step, state, args)}``, each step
    ``step(state, *args) -> (state, metrics)``: compiled first, then timed in turn, five
    calls a round, so that a shared machine's load falls on all alike."""
    states = {}
    for name, (step, state, args) in programs.items():
        states[name], metrics = step(state, *args)
        jax.block_until_ready(metrics)
    best = dict.fromkeys(programs, float("inf"))
    for _ in range(repeats):
        for name, (step, _, args) in programs.items():
            began = time.perf_counter()
            for _ in range(5):
                states[name], metrics = step(states[name], *args)
            jax.block_until_ready(metrics)
            best[name] = min(best[name], (time.perf_counter() - began) / 5)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="mqar_gdn.yaml")
    parser.add_argument("--lanes", nargs="+", type=int, default=[1, 4, 8])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[8, 32])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    add_cpu_flags()
    use_host_platforms()
    config = load_config(resolve_config(args.config))
    mesh = mesh_lib.check_mesh(config, jax.devices()[:1])
    programs, runs = {}, {}
    for batch_size in args.batch_sizes:
        train = dataclasses.replace(config.train, batch_size=batch_size)
        sized = dataclasses.replace(config, train=train)
        steps, state = train_setup(sized, mesh)
        batch = loop.train_batch(sized, split_seeds(0)[0], 0)
        batch = mesh_lib.place(batch, steps.batch_shardings)
        name = f"one run, batch {batch_size}"
        programs[name], runs[name] = (on_mesh(mesh, steps.train_step), state, (batch,)), 1
    _, state = train_setup(config, mesh)
    host = jax.device_get(state)
    batch = loop.train_batch(config, split_seeds(0)[0], 0)
    step = stacked_steps(config).train_step
    for lanes in args.lanes:
        stacked = jax.device_put(jax.tree.map(lambda x, n=lanes: np.stack([x] * n), host))
        batches = {name: np.stack([x] * lanes) for name, x in batch.items()}
        peaks = np.full(lanes, config.train.learning_rate, np.float32)
        name = f"{lanes} lanes, batch {config.train.batch_size}"
        programs[name] = (step, stacked, (batches, peaks, np.ones(lanes, bool)))
        runs[name] = lanes
    for name, took in best_seconds(programs, args.repeats).items():
        print(f"{name}: {took * 1e3:.0f} ms a step, {took * 1e3 / runs[name]:.0f} ms a run")


if __name__ == "__main__":
    main()
