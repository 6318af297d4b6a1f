"""What applying the LM head only at labelled positions saves in an MQAR training step.

    python benchmarks/bench_logits_at_labels.py [--config configs/mqar_gdn.yaml]

Times the jitted train step of the config both ways in one process (alternating, best of
--repeats) and prints the compiled programs' temp memory.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

from gdn_jax.data.mqar import make_batch, make_mqar
from gdn_jax.models import LanguageModel
from gdn_jax.training.config import load_config
from gdn_jax.training.optim import learning_rate_schedule, make_optimizer
from gdn_jax.training.step import TrainState, make_train_step


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/mqar_gdn.yaml")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    config = load_config(args.config)
    graphdef, params = nnx.split(LanguageModel(config.model, rngs=nnx.Rngs(0)))
    optimizer = make_optimizer(config.train, params)
    pure = nnx.to_pure_dict(params)
    batch = make_batch(*make_mqar(config.data, num_examples=config.train.batch_size, seed=0))
    steps, states = {}, {}
    for at_labels in (True, False):
        step = make_train_step(
            graphdef, optimizer, learning_rate_schedule(config.train), logits_at_labels=at_labels
        )
        state = TrainState(jnp.zeros((), jnp.int32), pure, optimizer.init(pure))
        steps[at_labels] = jax.jit(step)
        memory = steps[at_labels].lower(state, batch).compile().memory_analysis()
        print(f"logits_at_labels={at_labels}: temp {memory.temp_size_in_bytes / 2**20:.0f} MB")
        states[at_labels], _ = steps[at_labels](state, batch)
    best = {True: float("inf"), False: float("inf")}
    for _ in range(args.repeats):
        for at_labels in (True, False):
            start = time.perf_counter()
            states[at_labels], metrics = steps[at_labels](states[at_labels], batch)
            jax.block_until_ready(metrics)
            best[at_labels] = min(best[at_labels], time.perf_counter() - start)
    print(
        f"step: {1e3 * best[True]:.0f} ms at labelled positions, {1e3 * best[False]:.0f} ms "
        f"at all {config.data.seq_len} positions ({best[False] / best[True]:.2f}x)"
    )


if __name__ == "__main__":
    main()
