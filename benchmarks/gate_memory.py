"""How much of a write each decay gate keeps at initialisation, for a config and its seeds.

    python benchmarks/gate_memory.py configs/mqar_gdn.yaml --seeds 8 --tokens 100 \
        [--set model.head_gate_init.dt_max=1e-3 ...]

Builds the config's model for each seed (nothing is trained) and reads every decay gate's
``A = exp(A_log)`` and ``dt = softplus(dt_bias)``: at ``a_proj(x) = 0`` a step keeps
``exp(-A dt)`` of the state, so a write is kept ``exp(-A dt n)`` after ``n`` tokens, with time
constant ``1 / (A dt)`` tokens. Prints, per seed and layer, the fraction of the gates (heads,
or value-head x key-channel pairs for the channel-gated mixers) that keep more than 0.1 and
more than 0.5 of a write after ``--tokens`` tokens, and the largest time constant. MQAR's
queries come up to ~``seq_len`` tokens after their pair (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse

import numpy as np
from flax import nnx

from gdn_jax.models import LanguageModel
from gdn_jax.training.config import load_config


def gate_rates(mixer) -> np.ndarray | None:
    """``A dt`` of each of ``mixer``'s decay gates (per head, or per value head and key
    channel), or None when it has none."""
    if getattr(mixer, "A_log", None) is None:
        return None
    a = np.exp(np.asarray(mixer.A_log[...], np.float64))
    dt = np.log1p(np.exp(np.asarray(mixer.dt_bias[...], np.float64)))
    if dt.size == a.size:
        return a * dt
    return (a[:, None] * dt.reshape(a.size, -1)).ravel()  # one A a head, one dt a channel


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config")
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--set", dest="sets", action="append", default=[])
    args = parser.parse_args()
    config = load_config(args.config, args.sets)
    print(f"# {args.config} {' '.join(args.sets)}; kept after {args.tokens} tokens\n")
    print("| seed | layer | mixer | gates | kept > 0.1 | kept > 0.5 | longest time constant |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for seed in range(args.seeds):
        model = LanguageModel(config.model, rngs=nnx.Rngs(seed))
        for layer, (block, name) in enumerate(zip(model.blocks, config.model.mixers, strict=True)):
            rates = gate_rates(block.mixer)
            if rates is None:
                continue
            kept = np.exp(-rates * args.tokens)
            print(
                f"| {seed} | {layer} | {name} | {rates.size} | {np.mean(kept > 0.1):.2f} | "
                f"{np.mean(kept > 0.5):.2f} | {1 / rates.min():.0f} |"
            )


if __name__ == "__main__":
    main()
