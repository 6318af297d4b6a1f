"""The task registry and the data section that names a task: every task makes batches the
training step can take, and an MQAR config reads and writes as it did before tasks existed."""

import dataclasses

import numpy as np
import pytest

from gdn_jax.data.mqar import IGNORE_INDEX, MQARConfig, make_batch
from gdn_jax.data.state_tracking import StateTrackingConfig
from gdn_jax.data.tasks import DEFAULT_TASK, TASKS, make_examples, task_name
from gdn_jax.training.config import Config, load_config, to_dict
from gdn_jax.training.run_dir import resume_differences

MQAR_FIELDS = ["vocab_size", "seq_len", "num_kv_pairs", "power_a", "random_non_queries"]
S3 = ["data.task=state_tracking", "data.group=S3", "data.seq_len=16", "model.vocab_size=6"]


@pytest.mark.parametrize("name", TASKS)
def test_every_task_makes_batches_the_step_takes(name):
    task = TASKS[name]
    config = task.config()
    config.validate()
    assert task_name(config) == name
    inputs, labels = make_examples(config, num_examples=3, seed=0)
    assert inputs.shape == labels.shape == (3, config.seq_len)
    assert inputs.dtype == labels.dtype == np.int32
    assert 0 <= inputs.min() and inputs.max() < config.vocab_size
    labelled = labels[labels != IGNORE_INDEX]
    assert labelled.size and 0 <= labelled.min() and labelled.max() < config.vocab_size
    batch = make_batch(inputs, labels)
    np.testing.assert_array_equal(
        np.take_along_axis(labels, batch["positions"], 1), batch["targets"]
    )
    assert task.accuracy(labels, labels) == 1.0
    assert isinstance(config.describe(), str)


def test_an_unregistered_config_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Sorting:  # a TaskConfig, but in no entry of TASKS
        seq_len: int = 8
        vocab_size: int = 8

        def validate(self):
            pass

        def describe(self):
            return "sorting"

    with pytest.raises(ValueError, match=r"data=Sorting is not the config of a task"):
        task_name(Sorting())


def test_an_mqar_data_section_reads_and_writes_as_before_tasks():
    config = load_config("configs/mqar_gdn.yaml")
    assert DEFAULT_TASK == "mqar" and isinstance(config.data, MQARConfig)
    assert list(to_dict(config)["data"]) == MQAR_FIELDS  # no task key: config.yaml unchanged
    assert load_config("configs/mqar_gdn.yaml", ["data.task=mqar"]) == config
    assert to_dict(Config())["data"] == dataclasses.asdict(MQARConfig())


def test_a_state_tracking_section_leads_with_its_task():
    config = load_config(None, S3)
    assert config.data == StateTrackingConfig(group="S3", seq_len=16)
    assert to_dict(config)["data"] == {"task": "state_tracking", "group": "S3", "seq_len": 16}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.task=sorting"], r"data.task='sorting' is not a task; allowed: \('mqar', "),
        (["data.task=3"], r"data.task=3 is not a task"),
        (["data=[1, 2]"], r"data must be a mapping of a task's fields"),
        (["data.task=state_tracking"], r"unknown config key\(s\) \['data.num_kv_pairs'"),
        ([*S3, "data.group=S7"], r"group='S7' is not a group"),
        ([*S3, "data.seq_len=ten"], r"data.seq_len='ten' must be of type int"),
        (
            [*S3, "model.vocab_size=8"],
            r"model.vocab_size=8 must equal data.vocab_size=6 \(state tracking in S3",
        ),
    ],
)
def test_a_bad_data_section_names_the_field(overrides, message):
    base = "configs/mqar_gdn.yaml" if overrides == ["data.task=state_tracking"] else None
    with pytest.raises(ValueError, match=message):
        load_config(base, overrides)


def test_resume_names_a_changed_task_or_group():
    s3 = to_dict(load_config(None, S3))
    s2 = to_dict(load_config(None, [*S3, "data.group=S2", "model.vocab_size=2"]))
    assert resume_differences(s3, s2) == ["data.group: S3 -> S2", "model.vocab_size: 6 -> 2"]
    assert "data.task: state_tracking -> (absent)" in resume_differences(s3, to_dict(Config()))
