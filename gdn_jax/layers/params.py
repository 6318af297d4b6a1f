"""Parameter types and initialisers shared by the layers."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import no_type_check

import jax
import jax.numpy as jnp
from flax import nnx

from gdn_jax.layers.dense import projection_dot_general
from gdn_jax.ops.checks import is_real_number

# Head (tensor) parallelism: the mesh axis "model" splits every layer by heads. Each parameter
# carries how it splits in Flax's partitioning metadata (``nnx.get_partition_spec``):
# projections into heads by their output columns, projections out of heads by their input
# rows, per-head vectors along their head axis; the rest is whole on every device. A grouped
# value head lives with its key head because value heads are numbered key head by key head.
MODEL_AXIS = "model"
# Sequence (context) parallelism: a mesh axis "seq" of more than one device splits T, and the
# recurrent mixers pass the state and the convolution's halo across it.
SEQ_AXIS = "seq"
COLUMNS = (None, MODEL_AXIS)
ROWS = (MODEL_AXIS, None)
PER_HEAD = (MODEL_AXIS,)


def partitioned(init, sharding):
    """``init`` whose parameters carry ``sharding`` as metadata only: nothing is placed until
    the caller puts the state on a mesh (no mesh is needed to build a layer)."""
    return nnx.with_partitioning(init, sharding, eager_sharding=False)


def param(value, sharding, kind=nnx.Param):
    """A parameter of ``kind`` with ``sharding`` metadata (see ``partitioned``)."""
    return kind(value, out_sharding=sharding, eager_sharding=False)


class NoWeightDecay(nnx.Param):
    """A parameter that the optimizer must not decay: gate parameters such as ``A_log`` and
    ``dt_bias``, whose values set time constants rather than feature weights. Filter with
    ``nnx.OfType(NoWeightDecay)`` or ``isinstance``."""


@no_type_check  # data, from YAML too: over() names a bad field
@dataclasses.dataclass(frozen=True)
class GateInit:
    """The initial law of a decay gate ``log_alpha = -exp(A_log) * softplus(a + dt_bias)``:
    ``A ~ U(a_min, a_max)`` with ``A_log = log A``, and ``softplus(dt_bias) = dt`` with ``dt``
    log-uniform in ``[dt_min, dt_max]``, clamped below at ``dt_floor``. ``exp(-A dt)`` is what
    a step keeps of the state at init, so these ranges set the layer's memory span before it
    learns one. A field left ``None`` is the layer's default: flash-linear-attention's
    (``HEAD_DECAY`` for one decay per head, ``CHANNEL_DECAY`` for one per key channel)."""

    a_min: float | None = None
    a_max: float | None = None
    dt_min: float | None = None
    dt_max: float | None = None
    dt_floor: float | None = None

    def over(self, default: GateInit, fn: str) -> GateInit:
        """This law's fields over ``default``'s, checked: a ``ValueError`` that names
        ``fn``'s ``gate_init`` field and its value."""
        given = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        law = dataclasses.replace(default, **given)
        for field, value in dataclasses.asdict(law).items():
            if not (is_real_number(value) and math.isfinite(value)):
                raise ValueError(f"{fn}: gate_init.{field}={value!r} must be a finite number")
        rules = (
            (0 <= law.a_min <= law.a_max, "needs 0 <= a_min <= a_max"),
            (0 < law.dt_min <= law.dt_max, "needs 0 < dt_min <= dt_max"),
            (law.dt_floor > 0, "needs dt_floor > 0"),
        )
        for holds, rule in rules:
            if not holds:
                raise ValueError(f"{fn}: gate_init={law} {rule}")
        return law


def gate_law(fn: str, gate_init, default: GateInit) -> GateInit:
    """The decay gate's initial law of layer ``fn``: ``gate_init`` (a ``GateInit``, a
    mapping of its fields as ``ModelConfig`` takes it, or None) over ``default``, checked
    (``GateInit.over``)."""
    if isinstance(gate_init, Mapping):
        fields = {f.name for f in dataclasses.fields(GateInit)}
        unknown = sorted(set(gate_init) - fields, key=str)
        if unknown:
            raise ValueError(
                f"{fn}: gate_init has unknown fields {unknown}; GateInit has {sorted(fields)}"
            )
        gate_init = GateInit(**gate_init)
    if not (gate_init is None or isinstance(gate_init, GateInit)):
        raise TypeError(
            f"{fn}: gate_init={gate_init!r:.60} must be a GateInit, a mapping of its fields or "
            f"None, got {type(gate_init).__name__}"
        )
    return (gate_init or GateInit()).over(default, fn)


def check_build_args(fn: str, *, rngs, kernel_init=None) -> None:
    """A layer's or model's random streams are an ``nnx.Rngs`` (``nnx.Rngs(0)``; an int or a
    bare key reached Flax as an AttributeError), and its ``kernel_init`` None or an
    initialiser ``init(key, shape, dtype)`` (a name such as ``"normal"`` is not one)."""
    if not isinstance(rngs, nnx.Rngs):
        raise TypeError(
            f"{fn}: rngs={rngs!r:.60} must be an nnx.Rngs, e.g. nnx.Rngs(0), got "
            f"{type(rngs).__name__}"
        )
    if kernel_init is not None and not callable(kernel_init):
        raise TypeError(
            f"{fn}: kernel_init={kernel_init!r:.60} must be an initialiser such as "
            f"nnx.initializers.normal(0.02), or None, got {type(kernel_init).__name__}"
        )


# flash-linear-attention's laws: Gated DeltaNet's (Mamba-2's) for one decay per head, KDA's
# (and GDN-2's) for one per key channel, whose A starts at 1.
HEAD_DECAY = GateInit(a_min=0.0, a_max=16.0, dt_min=1e-3, dt_max=0.1, dt_floor=1e-4)
CHANNEL_DECAY = dataclasses.replace(HEAD_DECAY, a_min=1.0)


def a_log_init(key, shape, law: GateInit, dtype=jnp.float32):
    """``A_log = log(A)``, ``A ~ U(law.a_min, law.a_max)``: decay rates spread over an order
    of magnitude with the default laws."""
    a = jax.random.uniform(key, shape, jnp.float32, minval=law.a_min, maxval=law.a_max)
    # U(0, 16) can return exactly 0; the floor keeps log finite without visibly moving the law.
    return jnp.log(jnp.maximum(a, 1e-4)).astype(dtype)


def dt_bias_init(key, shape, law: GateInit, dtype=jnp.float32):
    """``dt_bias = softplus^{-1}(dt)`` with ``dt`` log-uniform in ``[law.dt_min, law.dt_max]``,
    clamped below at ``law.dt_floor``, so that ``softplus(dt_bias)`` starts at ``dt``."""
    u = jax.random.uniform(key, shape, jnp.float32)
    low, high = math.log(law.dt_min), math.log(law.dt_max)
    dt = jnp.maximum(jnp.exp(u * (high - low) + low), law.dt_floor)
    return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


def conv_init(key, shape, dtype=jnp.float32):
    """PyTorch's ``Conv1d`` default for a depthwise filter ``[W, D]``: ``U(-1/sqrt(W), 1/sqrt(W))``."""
    bound = shape[0] ** -0.5
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)


def bias_free_linear(*, dtype, param_dtype, kernel_init=None, rngs):
    """``nnx.Linear`` without bias and with these settings: ``linear(in, out, sharding)``,
    ``sharding`` one of ``COLUMNS`` (into heads), ``ROWS`` (out of heads) or ``None``. The
    default ``kernel_init`` is Flax's, LeCun normal."""
    if kernel_init is None:
        kernel_init = nnx.initializers.lecun_normal()

    def linear(in_features, out_features, sharding=None):
        init = kernel_init if sharding is None else partitioned(kernel_init, sharding)
        return nnx.Linear(
            in_features,
            out_features,
            use_bias=False,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=init,
            dot_general=projection_dot_general,
            rngs=rngs,
        )

    return linear


def gate_linear(in_features, out_features, *, use_bias, dtype, param_dtype, kernel_init, rngs):
    """An output gate's projection into the value heads (split by heads), with a zero bias
    when ``use_bias``; the default ``kernel_init`` is Flax's, LeCun normal."""
    kernel_init = kernel_init or nnx.initializers.lecun_normal()
    return nnx.Linear(
        in_features,
        out_features,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=partitioned(kernel_init, COLUMNS),
        bias_init=partitioned(nnx.initializers.zeros, PER_HEAD),
        dot_general=projection_dot_general,
        rngs=rngs,
    )
