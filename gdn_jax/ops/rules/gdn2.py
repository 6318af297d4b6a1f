"""Gated DeltaNet-2 (GDN-2; "Gated DeltaNet-2: Decoupling Erase and Write in Linear
Attention", NVlabs, arXiv 2605.22791): KDA's scalar ``beta`` split into a channel-wise erase
gate ``b`` on the key axis and a channel-wise write gate ``w`` on the value axis,

    S_t = S_{t-1} Diag(alpha_t) - (S_{t-1} Diag(alpha_t) (b_t * k_t)) k_t^T + (w_t * v_t) k_t^T,
    y_t = S_t (scale q_t),     alpha_t = exp(log_alpha_t) in (0, 1]^K,

with ``b_t`` in ``[0, 1]^K`` (``[0, 2]^K`` with negative eigenvalues) and ``w_t`` in
``[0, 1]^V``. ``b = w = beta`` (broadcast) is KDA exactly, and all channels of ``log_alpha``
equal as well is the gated delta rule. flash-linear-attention's ``naive_recurrent_gdn2``
(fla-core 0.6.0) is the same recurrence on the transposed state ``[K, V]``. Its chunked form
is ``ops/chunked/channel.py``'s.
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
from gdn_jax.ops.step import checked_step, erase_write_step

GDN2 = Rule(
    name="gdn2",
    gates=(
        GateSpec(
            "log_alpha",
            "K",
            doc="decay gates in log space (``<= 0``; ``-inf`` resets a channel), one per key channel",
        ),
        GateSpec("b", "K", doc="erase gates, already activated, one per key channel"),
        GateSpec("w", "V", doc="write gates, already activated, one per value channel"),
    ),
    step=erase_write_step,
    chunked=channel_chunked_rule,
    shares_qk=False,
    # Opt-in until a GPU has timed it against the chunked form.
    kernels=(Kernel("mosaic_gpu", "gdn_jax.ops.mosaic.channel.op:run", MOSAIC_LIMITS),),
)


@public_form(GDN2, "step")
def gdn2_step(
    state: Float[Array, "V K"],
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_alpha: ArrayLike,
    b: ArrayLike,
    w: ArrayLike,
    *,
    scale: float | None = None,
) -> tuple[Float[Array, "V K"], Float[Array, " V"]]:
    """Advance one head's GDN-2 memory by one token and read it: what a decoder calls.

    Args:
      state: memory ``[V, K]`` (flash-linear-attention stores the transpose, ``[K, V]``).
    {args}
      scale: query scale; ``None`` means ``K ** -0.5``.

    Returns:
      ``(new_state, y)``: the state in float32 (float64 for float64 input) and ``y [V]`` in
      the dtype of ``v``.
    """
    return checked_step("gdn2_step", GDN2, state, q, k, v, (log_alpha, b, w), scale=scale)


@public_form(GDN2, "one_head")
def gdn2_recurrent(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_alpha: ArrayLike,
    b: ArrayLike,
    w: ArrayLike,
    *,
    scale: float | None = None,
    initial_state: Float[Array, "V K"] | None = None,
) -> tuple[Float[Array, "T V"], Float[Array, "V K"]]:
    """Gated DeltaNet-2 for one head and one sequence, one token at a time.

    Args:
    {args}
      scale: query scale; ``None`` means ``K ** -0.5``.
      initial_state: ``[V, K]`` or ``None``.

    Returns:
      ``(y [T, V], final_state [V, K])``: ``y`` in the input dtype, the state in float32
      (float64 for float64 input).
    """
    gates = (log_alpha, b, w)
    return recurrent_single_head("gdn2_recurrent", GDN2, q, k, v, gates, initial_state, scale=scale)


@public_form(GDN2, "one_head")
def gdn2_chunked(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_alpha: ArrayLike,
    b: ArrayLike,
    w: ArrayLike,
    *,
    scale: float | None = None,
    initial_state: Float[Array, "V K"] | None = None,
    chunk_size: int = 64,
    schedule: checks.Schedule = "auto",
) -> tuple[Float[Array, "T V"], Float[Array, "V K"]]:
    """Gated DeltaNet-2 for one head and one sequence, chunkwise; the contract of
    ``gdn2_recurrent``, with ``chunk_size`` and ``schedule`` as in ``kda_chunked``.

    Any ``T >= 1`` works. Gradients reach every input through a hand-written VJP that keeps
    the inputs and one ``[V, K]`` state per chunk (``ops/chunked/channel.py``).
    """
    return chunked_single_head(
        "gdn2_chunked", GDN2, q, k, v, (log_alpha, b, w), initial_state,
        scale=scale, chunk_size=chunk_size, schedule=schedule, recurrent="gdn2_recurrent",
    )  # fmt: skip


@public_form(GDN2, "batched")
def gdn2(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_alpha: ArrayLike,
    b: ArrayLike,
    w: ArrayLike,
    *,
    scale: float | None = None,
    initial_state: Float[Array, "B HV V K"] | None = None,
    use_qk_l2norm: bool = False,
    cu_seqlens: Int[Array, " N+1"] | None = None,
    impl: checks.Impl = "auto",
    chunk_size: int = 64,
    schedule: checks.Schedule = "auto",
) -> tuple[Float[Array, "B T HV V"], Float[Array, "B HV V K"]]:
    """Gated DeltaNet-2 over a batch of sequences and heads: per value head and sequence
    ``gdn2_chunked`` (or ``gdn2_recurrent``).

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
        GDN2, q, k, v, (log_alpha, b, w),
        scale=scale, initial_state=initial_state, impl=impl, chunk_size=chunk_size,
        schedule=schedule, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
    )  # fmt: skip


@public_form(GDN2, "batched")
def gdn2_seq_parallel(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_alpha: ArrayLike,
    b: ArrayLike,
    w: ArrayLike,
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
    """``gdn2`` with ``T`` split over the mesh axis ``axis_name``; arguments and results as in
    ``gated_delta_rule_seq_parallel``."""
    return seq_parallel(
        GDN2, q, k, v, (log_alpha, b, w,),
        fn="gdn2_seq_parallel", mesh=mesh, axis_name=axis_name, scale=scale,
        initial_state=initial_state, chunk_size=chunk_size, schedule=schedule,
        cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
    )  # fmt: skip
