"""The cells of a sweep and what makes a cell one run: its resolved config.

A cell is one training run: a mixer, a number of key-value pairs, a width, a learning rate
and a seed, on its mixer's base config with the sweep's ``--set`` overrides. Its identity, the key of
its record in ``results.jsonl``, is a digest of the run's whole resolved config (model, data
and train sections, every field), so that anything that changes a result changes the key:
another step budget, another base config, another ``--set``. Only where the run writes and
whether it draws a progress bar are left out.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from gdn_jax.training.config import load_config, to_dict

# Fields the sweep sets for every cell from its own options; a --set of one is refused.
SWEEP_FIELDS = {
    "model.mixers": "--mixers and --layers",
    "model.d_model": "--d-models",
    "data.num_kv_pairs": "--kv-pairs",
    "train.learning_rate": "--learning-rates",
    "train.seed": "--seeds",
    "train.steps": "--steps",
    "train.out_dir": "--runs",
    "train.progress": "the sweep (no progress bars)",
}
# Resolved-config fields that do not change what a run computes.
NOT_IDENTITY = ("train.out_dir", "train.progress")
# Fields added after runs were recorded, with the value every earlier run had: at it they
# stay out of the key, so that recorded runs keep their identity and directories.
ADDED_LATER = {"model.low_rank_gates": True}


@dataclasses.dataclass(frozen=True)
class Cell:
    """One run of the grid."""

    mixer: str
    kv_pairs: int
    d_model: int
    learning_rate: float
    seed: int

    @property
    def name(self) -> str:
        return (
            f"{self.mixer}_kv{self.kv_pairs}_d{self.d_model}_lr{self.learning_rate:g}"
            f"_seed{self.seed}"
        )

    @property
    def group(self) -> tuple:
        """The table cell this run belongs to, over learning rates and seeds."""
        return (self.mixer, self.kv_pairs, self.d_model)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What every cell shares: the base config of each mixer, the extra overrides, the
    budget and where the runs go."""

    configs: dict[str, Path]  # mixer -> its base config
    sets: tuple[str, ...]
    steps: int
    layers: int
    runs: Path

    def overrides(self, cell: Cell, run_dir: Path | str) -> list[str]:
        """The ``--set`` items of ``cell``'s run: its own (``run_values``), then the ones its
        group shares."""
        _, seed, rate = self.run_values(cell, run_dir)
        own = [f"train.learning_rate={rate}", f"train.seed={seed}", f"train.out_dir={run_dir}"]
        return [*own, *self.shared_overrides(cell)]

    def run_values(self, cell: Cell, run_dir: Path | str) -> tuple[str, str, str]:
        """What sets ``cell``'s run apart from the others of its group: its directory, seed
        and learning rate, as the batched command's ``--run`` takes them."""
        return str(run_dir), str(cell.seed), repr(cell.learning_rate)

    def shared_overrides(self, cell: Cell) -> list[str]:
        """The ``--set`` items that every run of ``cell.group`` shares: the sweep's own, then
        ``sets``."""
        return [
            f"model.mixers=[{', '.join([cell.mixer] * self.layers)}]",
            f"model.d_model={cell.d_model}",
            f"data.num_kv_pairs={cell.kv_pairs}",
            f"train.steps={self.steps}",
            "train.progress=false",
            *self.sets,
        ]

    def resolved(self, cell: Cell) -> dict:
        """``cell``'s whole config as the training command would run it (``ValueError`` for a
        cell the command would refuse), without the fields of ``NOT_IDENTITY``."""
        config = to_dict(load_config(self.configs[cell.mixer], self.overrides(cell, "run")))
        for dotted in NOT_IDENTITY:
            section, field = dotted.split(".")
            del config[section][field]
        for dotted, earlier in ADDED_LATER.items():
            section, field = dotted.split(".")
            if config[section][field] == earlier:
                del config[section][field]
        return config

    def key(self, cell: Cell) -> str:
        """The identity of ``cell``'s run: a digest of its resolved config."""
        text = json.dumps(self.resolved(cell), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def run_dir(self, cell: Cell, key: str) -> Path:
        """The run directory of ``cell``: one per identity, so that no two runs share one."""
        return self.runs / f"{cell.name}_{key[:8]}"


def grid(mixers, kv_pairs, d_models, learning_rates, seeds) -> list[Cell]:
    """Every cell, key-value pairs outermost (so that a sweep cut short still compares every
    mixer at the smaller counts), then width, mixer, learning rate and seed."""
    return [
        Cell(mixer, pairs, width, rate, seed)
        for pairs in kv_pairs
        for width in d_models
        for mixer in mixers
        for rate in learning_rates
        for seed in seeds
    ]


def refused_sets(sets) -> list[str]:
    """The ``--set`` items that name a field the sweep sets itself, each with the option
    that sets it."""
    refused = []
    for item in sets:
        field = item.partition("=")[0].strip()
        if field in SWEEP_FIELDS:
            refused.append(f"--set {item}: the sweep sets {field} (from {SWEEP_FIELDS[field]})")
    return refused
