"""What a run trains: the model and optimizer state on the mesh, and the jitted steps.

The training loop builds it for real and ``--compile-only`` as shapes only (``abstract``),
through the same function, so that what is compiled for a TPU slice is what would train. A
run traces its steps on those shapes (``trace_steps``) before it touches its directory, so
that what building the model or tracing a step would raise comes before anything is written.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gdn_jax.data.mqar import make_batch
from gdn_jax.data.tasks import make_examples
from gdn_jax.models import LanguageModel, ModelConfig
from gdn_jax.training import mesh as mesh_lib
from gdn_jax.training.config import Config, TrainConfig
from gdn_jax.training.errors import RunError
from gdn_jax.training.optim import learning_rate_schedule, make_optimizer
from gdn_jax.training.step import TrainState, make_eval_step, make_train_step

Batch = dict  # {"inputs", "labels", "positions", "targets"}: data.mqar.make_batch's arrays
TrainStep = Callable[[TrainState, Batch], tuple[TrainState, dict]]  # donates the state
EvalStep = Callable[[dict, Batch], tuple[jax.Array, jax.Array]]  # -> (loss, accuracy [B])


@dataclasses.dataclass
class Steps:
    """The jitted steps of a run on its mesh and the shardings of what they take."""

    train_step: TrainStep
    eval_step: EvalStep
    state_shardings: TrainState
    batch_shardings: dict


def jit_steps(config: Config, mesh: Mesh) -> Steps:
    """The train and eval steps of ``config`` jitted for ``mesh``: the batch placed by
    ``batch_shardings``, parameters and optimizer state by the layers' partitioning metadata
    (whole on every device when the mesh has only a data axis). Call the steps with ``mesh``
    set (``jax.set_mesh``).

    The steps of configs that differ only in seed and output directory are the same jitted
    functions, so that the runs of one process (a sweep, the tests, a notebook) trace and
    compile each program once: neither enters a step, which takes the state and the batch as
    arguments."""
    train = dataclasses.replace(config.train, seed=0, out_dir="")
    return _jit_steps(config.model, train, mesh)


def _abstract_model(model: ModelConfig):
    """``(graphdef, params)`` of ``model``'s LanguageModel as shapes, nothing allocated: what
    a step is traced with (the seed only picks the values it is later called with)."""
    return nnx.split(nnx.eval_shape(lambda: LanguageModel(model, rngs=nnx.Rngs(0))))


@functools.lru_cache(maxsize=8)
def _jit_steps(model: ModelConfig, train: TrainConfig, mesh: Mesh) -> Steps:
    graphdef, params = _abstract_model(model)
    optimizer = make_optimizer(train, params)
    replicated = NamedSharding(mesh, P())
    param_shardings = mesh_lib.param_shardings(mesh, params)
    opt_state = jax.eval_shape(optimizer.init, nnx.to_pure_dict(params))
    state_shardings = TrainState(
        replicated,
        param_shardings,
        mesh_lib.opt_state_shardings(mesh, optimizer, opt_state, param_shardings),
    )
    batch_shardings = mesh_lib.batch_shardings(mesh)
    schedule = learning_rate_schedule(train)
    train_step = jax.jit(
        make_train_step(graphdef, optimizer, schedule, logits_at_labels=train.logits_at_labels),
        in_shardings=(state_shardings, batch_shardings),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )
    eval_step = jax.jit(
        make_eval_step(graphdef, logits_at_labels=train.logits_at_labels),
        in_shardings=(state_shardings.params, batch_shardings),
        out_shardings=replicated,  # every process reads the whole per-example accuracy
    )
    return Steps(train_step, eval_step, state_shardings, batch_shardings)


def train_setup(config: Config, mesh: Mesh, *, abstract: bool = False) -> tuple[Steps, TrainState]:
    """The jitted steps and the initial state of ``config`` on ``mesh``: placed arrays, or
    with ``abstract`` their shapes and shardings (``jax.ShapeDtypeStruct``s), nothing
    allocated."""
    seed = config.train.seed

    def build():
        return LanguageModel(config.model, rngs=nnx.Rngs(seed))

    _, params = nnx.split(nnx.eval_shape(build) if abstract else build())
    optimizer = make_optimizer(config.train, params)
    steps = jit_steps(config, mesh)
    pure = nnx.to_pure_dict(params)
    if abstract:
        abstract_state = TrainState(
            jax.ShapeDtypeStruct((), jnp.int32), pure, jax.eval_shape(optimizer.init, pure)
        )
        return steps, jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            abstract_state,
            steps.state_shardings,
        )
    state = TrainState(jnp.zeros((), jnp.int32), pure, optimizer.init(pure))
    return steps, jax.device_put(state, steps.state_shardings)


def abstract_batch(config: Config, shardings: dict) -> dict:
    """One step's batch as ``jax.ShapeDtypeStruct``s placed by ``shardings``: the shapes of
    a generated example, ``train.batch_size`` of them."""
    example = make_batch(*make_examples(config.data, num_examples=1, seed=0))
    size = config.train.batch_size
    return {
        k: jax.ShapeDtypeStruct((size, *x.shape[1:]), x.dtype, sharding=shardings[k])
        for k, x in example.items()
    }


def trace_steps(config: Config, mesh: Mesh) -> None:
    """Build ``config``'s model and optimizer state as shapes and trace its train and eval
    steps on ``mesh``; nothing is allocated or compiled, and the jitted steps keep the traces
    for the run. What building the model or tracing a step raises (a layer's or an op's
    ``ValueError`` or ``TypeError`` naming its argument) is raised here as a ``RunError``."""
    try:
        steps, state = train_setup(config, mesh, abstract=True)
        batch = abstract_batch(config, steps.batch_shardings)
        with jax.set_mesh(mesh):
            steps.train_step.trace(state, batch)
            steps.eval_step.trace(state.params, batch)
    except (ValueError, TypeError) as error:
        raise RunError(str(error)) from error


def on_mesh(mesh: Mesh, fn: Callable) -> Callable:
    """``fn`` called with ``mesh`` in context, so that the layers see its ``seq`` axis while
    ``jax.jit`` traces them."""

    def call(*args):
        with jax.set_mesh(mesh):
            return fn(*args)

    return call
