"""Where a trained MQAR run misses: held-out accuracy by the queried pair's place in the context
and by the tokens between the pair and its query.

    python benchmarks/recall_by_pair.py runs/sweep/gdn2_kv64_d64_lr0.003_seed2_* [...] \
        [--buckets 4]

For each run directory, restores its newest checkpoint (nothing is written) and predicts its
own held-out set (``train.eval_examples`` examples from its seed's test stream, the set its
logged accuracy was measured on). Pair ``i`` of ``n`` sits at tokens ``2i, 2i + 1`` and is
queried once, ``d`` tokens after its key. Prints one row per run: accuracy over all queries,
then by pair index in ``--buckets`` equal groups (first written to last), then by ``d`` in
``--buckets`` groups of equal query counts. Misses that grow with ``d`` mean writes fade over
time (decay); misses on the first-written pairs whatever ``d`` mean later writes overwrote
them; misses spread evenly over both mean the pairs interfere as they are read.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from gdn_jax.data.mqar import IGNORE_INDEX
from gdn_jax.models import LanguageModel
from gdn_jax.training import checkpoints as ckpt
from gdn_jax.training import mesh as mesh_lib
from gdn_jax.training import run_dir
from gdn_jax.training.config import load_config
from gdn_jax.training.evaluation import held_out_batches
from gdn_jax.training.state import train_setup


def predictions(out_dir: Path):
    """``(inputs, labels, predicted)`` ``[N, T]`` of the run's held-out set, and its step."""
    config = load_config(str(out_dir / run_dir.CONFIG), [])
    mesh = mesh_lib.check_mesh(config, jax.devices()[:1])
    _, state = train_setup(config, mesh, abstract=True)
    checkpoints = ckpt.manager(out_dir, config.train.keep_checkpoints)
    step = checkpoints.latest_step()
    if step is None:
        raise SystemExit(f"{out_dir} has no checkpoint")
    state = checkpoints.restore(step, args=ocp.args.StandardRestore(state))
    checkpoints.close()
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: LanguageModel(config.model, rngs=nnx.Rngs(0))))

    @jax.jit
    def predict(params, inputs):
        return jnp.argmax(nnx.merge(graphdef, params)(inputs), axis=-1)

    train = config.train
    batches = held_out_batches(
        config.data, seed=train.seed, examples=train.eval_examples, batch_size=train.batch_size
    )
    inputs = np.concatenate([b["inputs"] for b in batches])
    labels = np.concatenate([b["labels"] for b in batches])
    predicted = np.concatenate([np.asarray(predict(state.params, b["inputs"])) for b in batches])
    return inputs, labels, predicted, step


def by_pair(inputs, labels, predicted):
    """Per query: ``(pair index, tokens from key to query, correct)``, flat."""
    rows, query_pos = np.nonzero(labels != IGNORE_INDEX)
    keys = inputs[rows, query_pos]
    n = np.count_nonzero(labels[0] != IGNORE_INDEX)
    pair = np.argmax(inputs[rows, : 2 * n : 2] == keys[:, None], axis=1)
    distance = query_pos - 2 * pair
    return pair, distance, predicted[rows, query_pos] == labels[rows, query_pos], n


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=lambda p: Path(p).absolute())
    parser.add_argument("--buckets", type=int, default=4)
    args = parser.parse_args()
    k = args.buckets
    header = [f"pairs {j}/{k}" for j in range(1, k + 1)] + [f"d q{j}" for j in range(1, k + 1)]
    print("| run | step | all | " + " | ".join(header) + " |")
    print("|---|---:|---:|" + "---:|" * (2 * k))
    for out_dir in args.runs:
        *arrays, step = predictions(out_dir)
        pair, distance, correct, n = by_pair(*arrays)
        cells = [correct[(pair * k) // n == j].mean() for j in range(k)]
        edges = np.quantile(distance, np.linspace(0, 1, k + 1))
        group = np.clip(np.searchsorted(edges, distance, side="right") - 1, 0, k - 1)
        cells += [correct[group == j].mean() for j in range(k)]
        spans = [f"{edges[j]:.0f}-{edges[j + 1]:.0f}" for j in range(k)]
        print(
            f"| {out_dir.name} | {step} | {correct.mean():.3f} | "
            + " | ".join(f"{c:.3f}" for c in cells)
            + " |"
        )
        print(f"<!-- {out_dir.name}: d groups {', '.join(spans)} -->")


if __name__ == "__main__":
    main()
