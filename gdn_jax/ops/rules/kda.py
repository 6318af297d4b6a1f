"""Kimi Delta Attention (KDA; Kimi Team, "Kimi Linear", arXiv 2510.26692, Sec. 3): the gated
delta rule with one decay per key channel instead of one per head,

    S_t = S_{t-1} Diag(alpha_t) + beta_t (v_t - S_{t-1} Diag(alpha_t) k_t) k_t^T,
    y_t = S_t (scale q_t),     alpha_t = exp(log_alpha_t) in (0, 1]^K.

With every channel of ``log_alpha_t`` equal it is the gated delta rule; it is Gated
DeltaNet-2 with ``b = w = beta``, and its chunked form is that of ``ops/chunked/channel.py`` with
those gates.
"""

from __future__ import annotations

from jax.sharding import AbstractMesh, Mesh
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int

from gdn_jax.ops import checks
from gdn_jax.ops.api import batched
from gdn_jax.ops.chunked.channel import channel_chunked_rule
from gdn_jax.ops.rule import MOSAIC_LIMITS, GateSpec, Kernel, Rule, public_form
from gdn_jax.ops.sequence_parallel import seq_parallel
from gdn_jax.ops.single_head import chunked_single_head, recurrent_single_head
from gdn_jax.ops.step import checked_step, delta_step

KDA = Rule(
    name="kda",
    gates=(
        GateSpec(
            "log_alpha",
            "K",
            doc="decay gates in log space (``<= 0``; ``-inf`` resets a channel), one per key channel",
        ),
        GateSpec("beta", doc="writing strengths, already activated"),
    ),
    step=delta_step,  # its decay broadcasts a [K] gate along the state's rows
    chunked=channel_chunked_rule,  # with beta as both the erase and the write gate
    shares_qk=False,
    # Opt-in until a GPU has timed it against the chunked form.
    kernels=(Kernel("mosaic_gpu", "gdn_jax.ops.mosaic.channel.op:run", MOSAIC_LIMITS),),
)


@public_form(KDA, "step")
def kda_step(
    state: Float[Array, "V K"],
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_alpha: ArrayLike,
    beta: ArrayLike,
    *,
    scale: float | None = None,
) -> tuple[Float[Array, "V K"], Float[Array, " V"]]:
    """Advance one head's KDA memory by one token and read it: what a decoder calls per token.

    Args:
      state: memory ``[V, K]`` (flash-linear-attention stores the transpose, ``[K, V]``).
    {args}
      scale: query scale; ``None`` means ``K ** -0.5``.

    Returns:
      ``(new_state, y)``: the state in float32 (float64 for float64 input) and ``y [V]`` in
      the dtype of ``v``.
    """
    return checked_step("kda_step", KDA, state, q, k, v, (log_alpha, beta), scale=scale)


@public_form(KDA, "one_head")
def kda_recurrent(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_alpha: ArrayLike,
    beta: ArrayLike,
    *,
    scale: float | None = None,
    initial_state: Float[Array, "V K"] | None = None,
) -> tuple[Float[Array, "T V"], Float[Array, "V K"]]:
    """Kimi Delta Attention for one head and one sequence, one token at a time.

    Args:
    {args}
      scale: query scale; ``None`` means ``K ** -0.5``.
      initial_state: ``[V, K]`` or ``None``.

    Returns:
      ``(y [T, V], final_state [V, K])``: ``y`` in the input dtype, the state in float32
      (float64 for float64 input).
    """
    gates = (log_alpha, beta)
    return recurrent_single_head("kda_recurrent", KDA, q, k, v, gates, initial_state, scale=scale)


@public_form(KDA, "one_head")
def kda_chunked(
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
    """Kimi Delta Attention for one head and one sequence, chunkwise; the contract of
    ``kda_recurrent``.

    Any ``T >= 1`` works (the tail chunk is padded with tokens that neither decay nor write).
    Gradients reach every input through a hand-written VJP that keeps the inputs and one
    ``[V, K]`` state per chunk (``ops/chunked/channel.py``).

    Args:
    {args}
      scale: query scale; ``None`` means ``K ** -0.5``.
      initial_state: ``[V, K]`` or ``None`` (zeros).
      chunk_size: ``C``, one of 16, 32, 64, 128.
      schedule: ``"hoisted"``, ``"associative"``, ``"in_scan"`` or ``"auto"``, as in
        ``gated_delta_rule_chunked``.

    Returns:
      ``(y [T, V], final_state [V, K])``: ``y`` in the input dtype, the state in float32
      (float64 for float64 input).
    """
    return chunked_single_head(
        "kda_chunked", KDA, q, k, v, (log_alpha, beta), initial_state,
        scale=scale, chunk_size=chunk_size, schedule=schedule, recurrent="kda_recurrent",
    )  # fmt: skip


@public_form(KDA, "batched")
def kda(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_alpha: ArrayLike,
    beta: ArrayLike,
    *,
    scale: float | None = None,
    initial_state: Float[Array, "B HV V K"] | None = None,
    use_qk_l2norm: bool = False,
    cu_seqlens: Int[Array, " N+1"] | None = None,
    impl: checks.Impl = "auto",
    chunk_size: int = 64,
    schedule: checks.Schedule = "auto",
) -> tuple[Float[Array, "B T HV V"], Float[Array, "B HV V K"]]:
    """Kimi Delta Attention (KDA) over a batch of sequences and heads: per value head and
    sequence ``kda_chunked`` (or ``kda_recurrent``). Arguments and results are those of
    ``gated_delta_rule`` but for ``log_alpha``.

    Args:
    {args}
      scale: as in ``gated_delta_rule``.
      initial_state: as in ``gated_delta_rule``.
      use_qk_l2norm: as in ``gated_delta_rule``.
      cu_seqlens: as in ``gated_delta_rule``.
      impl: as in ``gated_delta_rule``.
      chunk_size: as in ``gated_delta_rule``.
      schedule: as in ``gated_delta_rule``.

    Returns:
      ``(o [B, T, HV, V], final_state)``: ``o`` in the input dtype; ``final_state`` float32
      (float64 for float64 input), ``[B, HV, V, K]`` or ``[N, HV, V, K]`` with ``cu_seqlens``.
    """
    return batched(
        KDA, q, k, v, (log_alpha, beta),
        scale=scale, initial_state=initial_state, impl=impl, chunk_size=chunk_size,
        schedule=schedule, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
    )  # fmt: skip


@public_form(KDA, "batched")
def kda_seq_parallel(
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
    """``kda`` with ``T`` split over the mesh axis ``axis_name``; arguments and results as in
    ``gated_delta_rule_seq_parallel``."""
    return seq_parallel(
        KDA, q, k, v, (log_alpha, beta,),
        fn="kda_seq_parallel", mesh=mesh, axis_name=axis_name, scale=scale,
        initial_state=initial_state, chunk_size=chunk_size, schedule=schedule,
        cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
    )  # fmt: skip
