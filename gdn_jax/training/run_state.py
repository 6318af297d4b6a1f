"""One run as both drivers hold it: its built parts (``RunState``, ``build``) and what it
records (``RunBook``: its train and eval records, checked for a NaN loss, and its summary;
``plot``: its curves). ``loop.run`` trains one run through them, ``batched.run`` several in
lockstep, each through the same parts, so that a run of either writes the same files.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import orbax.checkpoint as ocp
from jax.sharding import Mesh

from gdn_jax.training import checkpoints as ckpt
from gdn_jax.training import run_dir
from gdn_jax.training.config import Config
from gdn_jax.training.errors import NonFiniteLossError
from gdn_jax.training.metrics_log import MetricsLog
from gdn_jax.training.plots import plot_or_warn
from gdn_jax.training.state import EvalStep, TrainStep, on_mesh, train_setup
from gdn_jax.training.step import TrainState


@dataclasses.dataclass
class RunState:
    """What the step loop needs: the jitted steps, the state and where to write."""

    config: Config
    out_dir: Path
    log: MetricsLog
    checkpoints: ocp.CheckpointManager
    state: TrainState
    train_step: TrainStep
    eval_step: EvalStep
    batch_shardings: dict


def build(config: Config, mesh: Mesh, out_dir: Path) -> RunState:
    """The state on ``mesh``, the steps called with it in context, and the checkpoints."""
    steps, state = train_setup(config, mesh)
    return RunState(
        config,
        out_dir,
        MetricsLog(out_dir / run_dir.METRICS, writes=ckpt.is_primary()),
        ckpt.manager(out_dir, config.train.keep_checkpoints),
        state,
        on_mesh(mesh, steps.train_step),
        on_mesh(mesh, steps.eval_step),
        steps.batch_shardings,
    )


def plot(run: RunState) -> None:
    """The run's curves from what it logged, however it ended (``plot_or_warn``)."""
    if ckpt.is_primary() and run.log.path.exists():
        plot_or_warn(run.log, run.out_dir / run_dir.PLOT)


class RunBook:
    """What one run records from ``start`` on: its train and eval records, checked for a NaN
    loss, and its summary."""

    def __init__(self, run: RunState, start: int):
        self.run = run
        self.summary = dict(start_step=start, eval_accuracy=None, eval_loss=None, reason="steps")
        self.began = time.perf_counter()
        self.tokens_per_step = run.config.train.batch_size * run.config.data.seq_len

    def train(self, step: int, metrics: dict, seconds: float) -> dict:
        """Log step ``step``'s host metrics (floats), which took ``seconds`` from dispatch to
        the host; returns them with ``tokens_per_s``. A NaN or Inf loss raises
        ``NonFiniteLossError`` and logs nothing."""
        if not math.isfinite(metrics["loss"]):
            latest = self.run.checkpoints.latest_step()
            kept = (
                "no checkpoint was saved yet"
                if latest is None
                else (
                    f"the last good checkpoint is step {latest} in "
                    f"{self.run.out_dir / run_dir.CHECKPOINTS}"
                )
            )
            raise NonFiniteLossError(f"loss is {metrics['loss']} at step {step}; {kept}")
        metrics = dict(metrics, tokens_per_s=self.tokens_per_step / seconds)
        self.run.log.append("train", step, **metrics)
        return metrics

    def evaluation(self, step: int, loss: float, accuracy: float, *, last: bool) -> bool:
        """Log the held-out loss and accuracy at ``step``; returns whether they end the run
        before its ``last`` step (the target accuracy reached)."""
        self.summary.update(eval_accuracy=accuracy, eval_loss=loss)
        elapsed = time.perf_counter() - self.began
        self.run.log.append("eval", step, loss=loss, accuracy=accuracy, elapsed_s=elapsed)
        target = self.run.config.train.target_accuracy
        if target is not None and accuracy >= target and not last:
            self.summary["reason"] = "target"
            return True
        return False

    def end(self, step: int) -> dict:
        """The summary of the run, ended at ``step``."""
        self.summary.update(final_step=step, wall_s=time.perf_counter() - self.began)
        return self.summary
