"""Run configuration: frozen dataclasses filled from YAML and ``--set key=value`` overrides.

Every key is checked against the dataclass fields and every value against the field's type
at start-up, so a typo fails before anything compiles, with the dotted name in the message.
The ``data`` section is the config of the task its ``task`` key names (``data.tasks.TASKS``;
MQAR when absent).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import os
import types
import typing
from collections.abc import Hashable, Sequence
from pathlib import Path

import yaml

from gdn_jax.data.mqar import MQARConfig
from gdn_jax.data.tasks import DEFAULT_TASK, TASKS, TaskConfig, task_name
from gdn_jax.layers.params import GateInit
from gdn_jax.models.config import ModelConfig
from gdn_jax.models.lm import check_buildable
from gdn_jax.training.config_paths import resolve_config


@typing.no_type_check  # data: validate() names a field of the wrong type
@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh axis sizes; -1 (on at most one axis) takes the devices the others leave."""

    # Data parallel: examples of the batch split over devices.
    data: int = -1
    # Head (tensor) parallel: heads, MLP width and their parameters split over devices.
    model: int = 1
    # Sequence (context) parallel: the tokens of each example split over devices.
    seq: int = 1


@typing.no_type_check  # data: validate() names a field of the wrong type
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation, evaluation and bookkeeping of one run."""

    # Seed of parameter init and of the train/test data streams (split with split_seeds).
    seed: int = 0
    # Optimizer steps; the learning-rate schedule spans them all.
    steps: int = 2000
    # Examples per step, split across devices (must divide by the device count).
    batch_size: int = 64
    # Peak AdamW learning rate, reached after warmup_steps, then cosine decay.
    learning_rate: float = 3e-3
    # Linear warmup from 0 to learning_rate.
    warmup_steps: int = 100
    # The cosine decay ends at learning_rate * final_lr_ratio.
    final_lr_ratio: float = 0.0
    # AdamW weight decay on matrices only (not gates, norms, biases).
    weight_decay: float = 0.1
    # AdamW moment decay rates.
    adam_b1: float = 0.9
    adam_b2: float = 0.98
    # Clip the global gradient norm to this value.
    grad_clip: float = 1.0
    # Evaluate on the held-out set every this many steps (and at the end).
    eval_every: int = 100
    # Held-out examples, from the test seed.
    eval_examples: int = 2000
    # Stop once held-out accuracy reaches this (None: run all steps).
    target_accuracy: float | None = None
    # Save a checkpoint every this many steps (and at the end).
    checkpoint_every: int = 500
    # Checkpoints kept on disk.
    keep_checkpoints: int = 2
    # Apply the LM head only at labelled positions (MQAR supervises num_kv_pairs of seq_len).
    logits_at_labels: bool = True
    # Where checkpoints, metrics.jsonl, the plot and the resolved config go.
    out_dir: str = "runs/mqar_gdn"
    # Show a progress bar.
    progress: bool = True
    # How the devices are arranged (all on data by default); see MeshConfig.
    mesh: MeshConfig = MeshConfig()

    def __post_init__(self):
        # "~" is the user's home, as in a shell: kept literally, it made a folder named "~"
        # in the working directory, where "rm -rf ~" would remove the home.
        if isinstance(self.out_dir, str) and self.out_dir.startswith("~"):
            object.__setattr__(self, "out_dir", os.path.expanduser(self.out_dir))


@typing.no_type_check  # data: validate() names a field of the wrong type
@dataclasses.dataclass(frozen=True)
class Config:
    """Everything a run needs: the model, the task and the training loop."""

    model: ModelConfig = ModelConfig()
    # The config of one of data.tasks.TASKS, read from a data section by its task key.
    data: TaskConfig = MQARConfig()
    train: TrainConfig = TrainConfig()

    def validate(self) -> Config:
        _check_sections(self)
        for section in ("model", "data", "train"):
            for field in dataclasses.fields(getattr(self, section)):
                value = getattr(getattr(self, section), field.name)
                if isinstance(value, float) and not math.isfinite(value):
                    raise ValueError(f"{section}.{field.name}={value} must be finite")
        if self.model.param_dtype == "float16":
            raise ValueError(
                "model.param_dtype=float16 cannot be trained: AdamW keeps its moments in the "
                "parameters' dtype, where its epsilon (1e-8) and the second moments of small "
                "gradients round to 0, so an update divides by zero (the loss is NaN at "
                "step 2); use bfloat16, float16's width with float32's range"
            )
        check_buildable(self.model)  # the layer constructors' rules, before any run starts
        self.data.validate()
        t = self.train
        if not 0 <= t.seed < 2**32:
            raise ValueError(f"train.seed={t.seed} must be in [0, 2**32)")
        positive = ("steps", "batch_size", "eval_every", "eval_examples", "checkpoint_every")
        for field in (*positive, "keep_checkpoints"):
            if getattr(t, field) < 1:
                raise ValueError(f"train.{field}={getattr(t, field)} must be >= 1")
        for field in ("learning_rate", "grad_clip"):
            if not getattr(t, field) > 0:
                raise ValueError(f"train.{field}={getattr(t, field)} must be positive")
        if not 0 <= t.warmup_steps < t.steps:
            raise ValueError(f"train.warmup_steps={t.warmup_steps} must be in [0, steps)")
        for field in ("adam_b1", "adam_b2", "final_lr_ratio"):
            if not 0 <= getattr(t, field) < 1 + (field == "final_lr_ratio"):
                raise ValueError(f"train.{field}={getattr(t, field)} is out of range")
        if t.weight_decay < 0:
            raise ValueError(f"train.weight_decay={t.weight_decay} must be >= 0")
        if t.target_accuracy is not None and not 0 < t.target_accuracy <= 1:
            raise ValueError(f"train.target_accuracy={t.target_accuracy} must be in (0, 1]")
        if not t.out_dir.strip():  # "" is the working directory, which holds no run
            raise ValueError(
                f"train.out_dir={t.out_dir!r} must name a directory for the run's files, "
                "e.g. runs/mqar_gdn"
            )
        if self.model.vocab_size != self.data.vocab_size:
            # A task whose vocabulary follows from its other fields says which it is.
            given = "vocab_size" in {f.name for f in dataclasses.fields(self.data)}
            raise ValueError(
                f"model.vocab_size={self.model.vocab_size} must equal "
                f"data.vocab_size={self.data.vocab_size}"
                + ("" if given else f" ({self.data.describe()})")
            )
        return self


def _check_sections(config: Config) -> None:
    """What a hand-built ``Config`` holds is of the types ``load_config`` gives it: each
    section's dataclass, and every train and mesh field of its annotated type (a string
    learning rate failed deep in optax). The model and the task check their own fields."""
    if not isinstance(config.model, ModelConfig):
        raise ValueError(f"model={config.model!r:.60} must be a ModelConfig")
    task_name(config.data)  # a ValueError naming the registered task configs
    _check_types(config.train, TrainConfig, "train.")


def _type_ok(value, annotation) -> bool:
    """Whether ``value`` is of ``annotation``'s type, as ``_convert`` would give it: an int
    is no bool, a float is any real number (YAML writes 1 for 1.0)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_type_ok(value, arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    return isinstance(value, annotation)


def _check_types(section, cls, prefix: str) -> None:
    if not isinstance(section, cls):
        raise ValueError(f"{prefix[:-1]}={section!r:.60} must be a {cls.__name__}")
    hints = inspect.get_annotations(cls, eval_str=True)
    for field in dataclasses.fields(cls):
        value, annotation = getattr(section, field.name), hints[field.name]
        if dataclasses.is_dataclass(annotation):
            _check_types(value, annotation, f"{prefix}{field.name}.")
        elif not _type_ok(value, annotation):
            shown = getattr(annotation, "__name__", str(annotation))
            raise ValueError(f"{prefix}{field.name}={value!r} must be of type {shown}")


def _convert(value, annotation, name):
    """``value`` (from YAML) as the type ``annotation``, or a ValueError naming ``name``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:  # a string here; validate() says which values are allowed
        annotation = type(args[0])
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            return _convert(value, arg, name)
    if annotation is TaskConfig:
        return _task_config(value, name)
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be a mapping of {annotation.__name__} fields")
        return from_dict(annotation, value, prefix=f"{name}.")
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple):
            raise ValueError(f"{name}={value!r} must be a list")
        return tuple(_convert(v, args[0], f"{name}[{i}]") for i, v in enumerate(value))
    if annotation is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str):
        try:  # YAML 1.1 reads 1e-2 (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if annotation in (int, str, bool) and type(value) is annotation:
        return value
    raise ValueError(
        f"{name}={value!r} must be of type {getattr(annotation, '__name__', annotation)}"
    )


def _task_config(value, name) -> TaskConfig:
    """The config of the task that ``value``'s ``task`` key names (``DEFAULT_TASK`` when it
    has none), from the rest of ``value``."""
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a mapping of a task's fields")
    fields = dict(value)
    task = fields.pop("task", DEFAULT_TASK)
    if not isinstance(task, str) or task not in TASKS:
        raise ValueError(f"{name}.task={task!r} is not a task; allowed: {tuple(TASKS)}")
    return from_dict(TASKS[task].config, fields, prefix=f"{name}.")


def from_dict(cls, data: dict, *, prefix: str = ""):
    """Build dataclass ``cls`` from a nested dict; unknown keys and bad values raise."""
    # inspect, not typing.get_type_hints, which returns nothing for a @no_type_check class.
    hints = inspect.get_annotations(cls, eval_str=True)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(
            f"unknown config key(s) {[prefix + k for k in unknown]}; "
            f"{cls.__name__} has {sorted(prefix + f for f in fields)}"
        )
    return cls(**{k: _convert(v, hints[k], prefix + k) for k, v in data.items()})


def _set(tree: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        tree = tree.setdefault(key, {})
        if not isinstance(tree, dict):
            raise ValueError(f"--set {dotted}: {key} is not a section")
    tree[leaf] = value


@typing.no_type_check  # a public entry point: it names its bad arguments itself
def load_config(path: str | Path | None = None, overrides: Sequence[str] | None = ()) -> Config:
    """Read ``path`` (YAML, or defaults when None), apply ``key.sub=value`` overrides (values
    parsed as YAML: ``64``, ``3e-3``, ``[gdn, attention]``, ``null``), check everything.

    ``path`` is a file, or the name of a packaged config (``"mqar_kda.yaml"``) as train.py's
    ``--config`` takes it (``resolve_config``); ``overrides`` is a list of strings, each as
    train.py's ``--set`` takes it, and None means none, as ``()`` does."""
    if not (path is None or isinstance(path, str | Path)):
        raise ValueError(f"load_config: path={path!r} must be a file name, a Path or None")
    if overrides is None:
        overrides = ()
    if isinstance(overrides, str | bytes) or not isinstance(overrides, Sequence):
        raise ValueError(
            f"load_config: overrides={overrides!r} must be a list of 'section.field=value' strings"
        )
    for i, item in enumerate(overrides):
        if not isinstance(item, str):
            raise ValueError(
                f"load_config: overrides[{i}]={item!r} must be a 'section.field=value' string"
            )
    data = {}
    if path is not None:
        path = resolve_config(path, given=f"load_config: path={str(path)!r}")
        try:
            text = Path(path).read_text()
        except UnicodeDecodeError as error:  # its message names neither the file nor YAML
            raise ValueError(
                f"{path}: not a YAML text file (byte {error.start} is not {error.encoding})"
            ) from None
        data = parse_yaml(text, str(path))
        if data is None:  # an empty file, or only comments: it was meant to say something
            raise ValueError(
                f"{path}: the file holds no settings (it is empty or only comments); give "
                "model, data and train sections as in configs/mqar_gdn.yaml"
            )
        if not isinstance(data, dict):
            raise ValueError(f"{path}: the top level must be a mapping of model/data/train")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r} must look like section.field=value")
        _set(data, key.strip(), parse_yaml(raw, f"--set {item!r}"))
    train = data.get("train")
    if isinstance(train, dict) and "out_dir" in train and train["out_dir"] is None:
        # YAML reads "--set train.out_dir=" (or "out_dir:") as null: it is the empty name,
        # which validate() refuses with its reason, not a value of the wrong type.
        train["out_dir"] = ""
    return from_dict(Config, data).validate()


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a repeated key in a mapping: PyYAML keeps the last
    value, so ``d_model: 64`` twice would silently mean the second."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # "<<: *base" may be overridden by the keys written next to it
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # the base class refuses it with its own message
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def parse_yaml(text: str, where: str):
    """``yaml.safe_load`` without repeated keys, and a malformed document reported on one
    line with its place (``where``: the file or the ``--set`` item)."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        place = "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ValueError(f"{where}: malformed YAML{place}: {problem}") from None


# The model fields added since the first runs were saved, at the value that means "as before".
UNSET = {"head_gate_init": GateInit(), "channel_gate_init": GateInit(), "mixer_init_std": None}


def to_dict(config: Config) -> dict:
    """The resolved config as plain YAML-able data (tuples as lists).

    The data section begins with its ``task``, except for ``DEFAULT_TASK``, and the model
    fields added since runs were first saved are left out while they are unset (``UNSET``:
    the gate initialisations at the layers' defaults, the mixers' projections at
    ``init_std``): a resolved config is then the same as before tasks and those fields
    existed, so the ``config.yaml`` of an earlier run still resumes and a sweep's earlier
    cells keep their keys (a digest of this dict).
    """

    def plain(x):
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return list(map(plain, x)) if isinstance(x, tuple | list) else x

    resolved = plain(dataclasses.asdict(config))
    for name, unset in UNSET.items():
        if getattr(config.model, name) == unset:
            del resolved["model"][name]
    task = task_name(config.data)
    if task != DEFAULT_TASK:
        resolved["data"] = {"task": task, **resolved["data"]}
    return resolved
