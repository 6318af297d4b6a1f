"""Synthetic datasets: multi-query associative recall (MQAR)."""

from gdn_jax.data.mqar import IGNORE_INDEX, MQARConfig, make_batch, make_mqar, mqar_accuracy

__all__ = ["IGNORE_INDEX", "MQARConfig", "make_batch", "make_mqar", "mqar_accuracy"]
