"""The recall sweep: MQAR over mixers x key-value pairs x widths x learning rates x seeds.

    python -m gdn_jax.sweep --out docs/sweep --jobs 2

Each run is the training command on the base config with the cell's overrides. The runs of
one table cell (mixer, pairs, width), which differ only in seed and learning rate, train
together, up to ``--batch-runs`` of them as one program in one process (``runner.py``,
``training/batched.py``). Each run's best held-out accuracy is appended to
``<out>/results.jsonl`` (``--out``, ``runs/sweep`` by default) as soon as its process ends, keyed by the run's whole resolved config
(``cells.py``), so that an interrupted sweep resumes where it stopped and a sweep with other
settings trains its own runs. At the end ``<out>/table.md`` and ``<out>/accuracy.png`` show,
per mixer, pairs and width, the learning rate with the best mean over seeds (``table.py``).
Recall of recurrent models depends strongly on the learning rate (Zoology), hence the grid.
"""

from gdn_jax.sweep.cli import main

__all__ = ["main"]
