"""Synthetic datasets: multi-query associative recall (MQAR) and state tracking, one task
each, registered by name in ``tasks.TASKS``."""

from gdn_jax.data.mqar import IGNORE_INDEX, MQARConfig, make_batch, make_mqar, mqar_accuracy
from gdn_jax.data.state_tracking import StateTrackingConfig, make_state_tracking, token_accuracy
from gdn_jax.data.tasks import TASKS, TaskConfig, make_examples

__all__ = [
    "IGNORE_INDEX",
    "TASKS",
    "MQARConfig",
    "StateTrackingConfig",
    "TaskConfig",
    "make_batch",
    "make_examples",
    "make_mqar",
    "make_state_tracking",
    "mqar_accuracy",
    "token_accuracy",
]
