"""Train a small Gated DeltaNet on multi-query associative recall (MQAR).

    python train.py                                   # configs/mqar_gdn.yaml
    python train.py --config configs/mqar_attention.yaml --set train.steps=500
    python train.py --resume                          # continue from the latest checkpoint

Runs on whatever ``jax.devices()`` returns, data-parallel over all of them.
"""

from __future__ import annotations

import argparse
import sys

import jax

from gdn_jax.training.config import load_config
from gdn_jax.training.loop import NonFiniteLossError, run
from gdn_jax.training.xla_flags import add_cpu_flags

DEFAULT_CONFIG = "configs/mqar_gdn.yaml"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="YAML file in configs/")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a field, e.g. --set model.d_model=128 (repeatable)",
    )  # fmt: skip
    parser.add_argument("--resume", action="store_true", help="continue the run in out_dir")
    args = parser.parse_args(argv)
    add_cpu_flags()  # before the first JAX computation starts the backend
    try:
        config = load_config(args.config, args.overrides)
    except (ValueError, OSError) as error:
        parser.error(str(error))

    devices = jax.devices()
    print(f"devices: {len(devices)} x {devices[0].device_kind} ({jax.default_backend()})")
    print(f"model: {config.model.mixers}, d_model={config.model.d_model}; data: "
          f"seq_len={config.data.seq_len}, kv pairs={config.data.num_kv_pairs}, "
          f"vocab={config.data.vocab_size}; out: {config.train.out_dir}")  # fmt: skip
    try:
        summary = run(config, resume=args.resume)
    except NonFiniteLossError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(
        f"step {summary['final_step']}: held-out accuracy {summary['eval_accuracy']:.4f}, "
        f"loss {summary['eval_loss']:.4f}, {summary['wall_s']:.0f} s; "
        f"curves in {config.train.out_dir}/curves.png"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
