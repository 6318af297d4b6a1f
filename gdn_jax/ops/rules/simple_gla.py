"""Simple gated linear attention (flash-linear-attention's ``simple_gla``), the gated delta
rule without its delta correction:

    S_t = alpha_t S_{t-1} + beta_t v_t k_t^T,    y_t = S_t (scale q_t)

With ``log_alpha`` it is gated linear attention with a scalar gate per head (Mamba-2's form;
GLA's per-channel gate is ``gla.py``'s); with ``log_alpha = 0`` and ``beta = 1`` plain causal
linear attention. Its chunked form is ``ops/chunked/scalar.py``'s with the ``wy.LINEAR`` write rule.
Until 0.1 this rule was ``gated_linear_attention``; that name's old call, with ``beta``, still
reaches it (``gla.py``).
"""

from __future__ import annotations

import functools

from jax.sharding import AbstractMesh, Mesh
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int

from gdn_jax.ops import checks
from gdn_jax.ops.api import batched
from gdn_jax.ops.chunked.scalar import chunked_rule
from gdn_jax.ops.chunked.wy import LINEAR
from gdn_jax.ops.rule import GateSpec, Rule, public_form
from gdn_jax.ops.sequence_parallel import seq_parallel
from gdn_jax.ops.single_head import chunked_single_head, recurrent_single_head
from gdn_jax.ops.step import checked_step, linear_step

SIMPLE_GLA = Rule(
    name="simple_gla",
    gates=(
        GateSpec("log_alpha", doc="decay gates in log space (``<= 0``; ``-inf`` is a full reset)"),
        GateSpec("beta", doc="writing strengths, already activated"),
    ),
    step=linear_step,
    chunked=functools.partial(chunked_rule, write=LINEAR),
    shares_qk=True,
)


@public_form(SIMPLE_GLA, "step")
def simple_gla_step(
    state: Float[Array, "V K"],
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_alpha: ArrayLike,
    beta: ArrayLike,
    *,
    scale: float | None = None,
) -> tuple[Float[Array, "V K"], Float[Array, " V"]]:
    """Advance one head's simple GLA memory by one token and read it: what a
    decoder calls per token. Arguments and results are those of ``gated_delta_step``."""
    gates = (log_alpha, beta)
    fn = "simple_gla_step"
    return checked_step(fn, SIMPLE_GLA, state, q, k, v, gates, scale=scale)


@public_form(SIMPLE_GLA, "one_head")
def simple_gla_recurrent(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_alpha: ArrayLike,
    beta: ArrayLike,
    *,
    scale: float | None = None,
    initial_state: Float[Array, "V K"] | None = None,
) -> tuple[Float[Array, "T V"], Float[Array, "V K"]]:
    """Simple gated linear attention for one head and one sequence, one token at a time: the
    reference form. Arguments and results are those of ``gated_delta_rule_recurrent``."""
    fn = "simple_gla_recurrent"
    gates = (log_alpha, beta)
    return recurrent_single_head(fn, SIMPLE_GLA, q, k, v, gates, initial_state, scale=scale)


@public_form(SIMPLE_GLA, "one_head")
def simple_gla_chunked(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_alpha: ArrayLike,
    beta: ArrayLike,
    *,
    scale: float | None = None,
    initial_state: Float[Array, "V K"] | None = None,
    chunk_size: int = 64,
    schedule: checks.Schedule = "auto",
) -> tuple[Float[Array, "T V"], Float[Array, "V K"]]:
    """Simple gated linear attention for one head and one sequence, chunkwise (``ops/chunked/scalar.py`` with
    no delta correction); the contract of ``simple_gla_recurrent``, with
    ``chunk_size`` and ``schedule`` as in ``gated_delta_rule_chunked``."""
    return chunked_single_head(
        "simple_gla_chunked", SIMPLE_GLA, q, k, v, (log_alpha, beta),
        initial_state, scale=scale, chunk_size=chunk_size, schedule=schedule,
        recurrent="simple_gla_recurrent",
    )  # fmt: skip


@public_form(SIMPLE_GLA, "batched")
def simple_gla(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_alpha: ArrayLike,
    beta: ArrayLike,
    *,
    scale: float | None = None,
    initial_state: Float[Array, "B HV V K"] | None = None,
    impl: checks.Impl = "auto",
    chunk_size: int = 64,
    schedule: checks.Schedule = "auto",
    cu_seqlens: Int[Array, " N+1"] | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[Float[Array, "B T HV V"], Float[Array, "B HV V K"]]:
    """Simple gated linear attention over a batch of sequences and heads. Arguments, layouts and
    results are those of ``gated_delta_rule``."""
    return batched(
        SIMPLE_GLA, q, k, v, (log_alpha, beta),
        scale=scale, initial_state=initial_state, impl=impl, chunk_size=chunk_size,
        schedule=schedule, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
    )  # fmt: skip


@public_form(SIMPLE_GLA, "batched")
def simple_gla_seq_parallel(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_alpha: ArrayLike,
    beta: ArrayLike,
    *,
    mesh: Mesh | AbstractMesh,
    axis_name: str = "seq",
    scale: float | None = None,
    initial_state: Float[Array, "_ HV V K"] | None = None,
    chunk_size: int = 64,
    schedule: checks.Schedule = "auto",
    cu_seqlens: Int[Array, " _"] | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[Float[Array, "B T HV V"], Float[Array, "_ HV V K"]]:
    """``simple_gla`` with ``T`` split over the mesh axis ``axis_name``;
    arguments and results as in ``gated_delta_rule_seq_parallel``."""
    return seq_parallel(
        SIMPLE_GLA, q, k, v, (log_alpha, beta,),
        fn="simple_gla_seq_parallel", mesh=mesh, axis_name=axis_name, scale=scale,
        initial_state=initial_state, chunk_size=chunk_size, schedule=schedule,
        cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
    )  # fmt: skip
