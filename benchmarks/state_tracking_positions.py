"""Held-out accuracy by position of state-tracking runs, at their training length or longer.

    python benchmarks/state_tracking_positions.py RUN_DIR [RUN_DIR ...] [--seq-len 64]

Restores each run's newest checkpoint (nothing in the run directory is written), makes the
held-out examples of its task from its test seed, at ``--seq-len`` tokens when given (new
examples, as the length changes every one), and prints the accuracy at every position and
how often the predicted permutation has the label's sign (the parity, ``S_n``'s quotient
``S_2``, which one reflection a token can follow). A run's mean at its own length is its
last logged held-out accuracy; the positions show where a model that does not track the
state loses it, and a longer length whether it extrapolates (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from gdn_jax.data.mqar import split_seeds
from gdn_jax.data.state_tracking import StateTrackingConfig, permutations
from gdn_jax.data.tasks import make_examples
from gdn_jax.models import LanguageModel
from gdn_jax.training import run_dir
from gdn_jax.training.config import Config, load_config
from gdn_jax.training.optim import make_optimizer
from gdn_jax.training.step import TrainState


def restored_model(config: Config, out_dir: Path) -> tuple[LanguageModel, int]:
    """The model of the newest checkpoint in ``out_dir`` and its step."""
    graphdef, params = nnx.split(LanguageModel(config.model, rngs=nnx.Rngs(0)))
    pure = nnx.to_pure_dict(params)
    state = TrainState(
        jnp.zeros((), jnp.int32), pure, make_optimizer(config.train, params).init(pure)
    )
    checkpoints = ocp.CheckpointManager(
        out_dir / run_dir.CHECKPOINTS, item_handlers=ocp.StandardCheckpointHandler()
    )
    step = checkpoints.latest_step()
    if step is None:
        raise SystemExit(f"{out_dir} holds no checkpoint")
    restored = checkpoints.restore(step, args=ocp.args.StandardRestore(state))
    nnx.replace_by_pure_dict(params, restored.params)
    return nnx.merge(graphdef, params), step


def signs(n: int) -> np.ndarray:
    """int ``[n!]``: the sign (+1 or -1) of each permutation of ``S_n``, by token id."""
    perms = permutations(n)
    later = np.triu(np.ones((n, n), dtype=bool), k=1)  # the pairs i < j
    inversions = ((perms[:, :, None] > perms[:, None, :]) & later).sum(axis=(1, 2))
    return 1 - 2 * (inversions % 2)


def by_position(config: Config, model: LanguageModel) -> tuple[np.ndarray, np.ndarray]:
    """float64 ``[T]`` each: the fraction of held-out examples whose prediction at each
    position is the label, and the fraction whose prediction has the label's sign."""
    _, test_seed = split_seeds(config.train.seed)
    inputs, labels = make_examples(
        config.data, num_examples=config.train.eval_examples, seed=test_seed
    )
    logits = nnx.jit(lambda model, x: model(x))(model, jnp.asarray(inputs))
    predictions = np.asarray(jnp.argmax(logits, axis=-1))
    sign = signs(config.data.degree)
    return (predictions == labels).mean(axis=0), (sign[predictions] == sign[labels]).mean(axis=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (train.out_dir)")
    parser.add_argument("--seq-len", type=int, help="tokens per example (default: the run's)")
    args = parser.parse_args()
    for out_dir in args.runs:
        config = load_config(out_dir / run_dir.CONFIG)
        if not isinstance(config.data, StateTrackingConfig):
            raise SystemExit(f"{out_dir} is not a state-tracking run")
        if args.seq_len is not None:
            data = dataclasses.replace(config.data, seq_len=args.seq_len)
            config = dataclasses.replace(config, data=data)
        model, step = restored_model(config, out_dir)
        accuracy, sign = by_position(config, model)
        print(
            f"{out_dir.name} (step {step}), {accuracy.size} tokens: accuracy {accuracy.mean():.4f}"
            f" (last position {accuracy[-1]:.3f}), sign right {sign.mean():.4f} (last "
            f"{sign[-1]:.3f})\n  accuracy by position: {' '.join(f'{a:.2f}' for a in accuracy)}"
            f"\n  sign right by position: {' '.join(f'{a:.2f}' for a in sign)}"
        )


if __name__ == "__main__":
    main()
