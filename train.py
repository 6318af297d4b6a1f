"""Train a small Gated DeltaNet on multi-query associative recall (MQAR).

    python train.py                                   # configs/mqar_gdn.yaml
    python train.py --config configs/mqar_attention.yaml --set train.steps=500
    python train.py --resume                          # continue from the latest checkpoint
    python train.py --overwrite                       # start again, deleting the earlier run

Runs on whatever ``jax.devices()`` returns, data-parallel over all of them. The command lives
in ``gdn_jax/training/cli.py`` (also installed as ``gdn-train``), entered through
``gdn_train.py``, which takes Ctrl-C over before JAX is imported.
"""

import sys

from gdn_train import main

if __name__ == "__main__":
    sys.exit(main())
