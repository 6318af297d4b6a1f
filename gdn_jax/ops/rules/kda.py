"""Kimi Delta Attention (KDA; Kimi Team, "Kimi Linear", arXiv 2510.26692, Sec. 3): the gated
delta rule with one decay per key channel instead of one per head,

    S_t = S_{t-1} Diag(alpha_t) + beta_t (v_t - S_{t-1} Diag(alpha_t) k_t) k_t^T,
    y_t = S_t (scale q_t),     alpha_t = exp(log_alpha_t) in (0, 1]^K.

With every channel of ``log_alpha_t`` equal it is the gated delta rule; it is Gated
DeltaNet-2 with ``b = w = beta``, and its chunked form is that of ``channel_chunked.py`` with
those gates.
"""

from __future__ import annotations

from typing import no_type_check

from jax.sharding import AbstractMesh, Mesh
from jaxtyping import Array, Float, Int

from gdn_jax.ops import checks
from gdn_jax.ops.api import batched
from gdn_jax.ops.channel_chunked import channel_chunked_rule
from gdn_jax.ops.rule import GateSpec, Rule
from gdn_jax.ops.sequence_parallel import seq_parallel
from gdn_jax.ops.single_head import chunked_single_head, recurrent_single_head
from gdn_jax.ops.step import checked_step, delta_step

KDA = Rule(
    name="kda",
    gates=(GateSpec("log_alpha", "K"), GateSpec("beta")),
    step=delta_step,  # its decay broadcasts a [K] gate along the state's rows
    chunked=channel_chunked_rule,  # with beta as both the erase and the write gate
    shares_qk=False,
)


@no_type_check  # a public entry point: checks.py names its bad arguments
def kda_step(
    state: Float[Array, "V K"],
    q: Float[Array, " K"],
    k: Float[Array, " K"],
    v: Float[Array, " V"],
    log_alpha: Float[Array, " K"],
    beta: Float[Array, ""],
    *,
    scale: float | None = None,
) -> tuple[Float[Array, "V K"], Float[Array, " V"]]:
    """Advance one head's KDA memory by one token and read it: what a decoder calls per token.

    Args:
      state: memory ``[V, K]`` (flash-linear-attention stores the transpose, ``[K, V]``).
      q, k: query and key ``[K]``.
      v: value ``[V]``; q, k and v share one dtype.
      log_alpha: ``[K]`` decay gates in log space, ``<= 0``, one per key channel.
      beta: scalar writing strength, already activated, as an array or a Python number.
      scale: query scale; ``None`` means ``K ** -0.5``.

    Returns:
      ``(new_state, y)``: the state in float32 (float64 for float64 input) and ``y [V]`` in
      the dtype of ``v``.
    """
    return checked_step("kda_step", KDA, state, q, k, v, (log_alpha, beta), scale=scale)


@no_type_check  # a public entry point: checks.py names its bad arguments
def kda_recurrent(
    q: Float[Array, "T K"],
    k: Float[Array, "T K"],
    v: Float[Array, "T V"],
    log_alpha: Float[Array, "T K"],
    beta: Float[Array, " T"],
    *,
    scale: float | None = None,
    initial_state: Float[Array, "V K"] | None = None,
) -> tuple[Float[Array, "T V"], Float[Array, "V K"]]:
    """Kimi Delta Attention for one head and one sequence, one token at a time.

    Args:
      q, k: ``[T, K]``; v: ``[T, V]``; all three in one floating dtype.
      log_alpha: ``[T, K]`` decay gates in log space (``<= 0``), one per key channel.
      beta: ``[T]`` writing strengths, already activated.
      scale: query scale; ``None`` means ``K ** -0.5``.
      initial_state: ``[V, K]`` or ``None``.

    Returns:
      ``(y [T, V], final_state [V, K])``: ``y`` in the input dtype, the state in float32
      (float64 for float64 input).
    """
    gates = (log_alpha, beta)
    return recurrent_single_head("kda_recurrent", KDA, q, k, v, gates, initial_state, scale=scale)


@no_type_check  # a public entry point: checks.py names its bad arguments
def kda_chunked(
    q: Float[Array, "T K"],
    k: Float[Array, "T K"],
    v: Float[Array, "T V"],
    log_alpha: Float[Array, "T K"],
    beta: Float[Array, " T"],
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
    ``[V, K]`` state per chunk (``channel_chunked.py``).

    Args:
      q, k: ``[T, K]``; v: ``[T, V]``; all three in one floating dtype.
      log_alpha: ``[T, K]`` decay gates in log space (``<= 0``; ``-inf`` resets a channel).
      beta: ``[T]`` writing strengths, already activated.
      scale: query scale; ``None`` means ``K ** -0.5``.
      initial_state: ``[V, K]`` or ``None`` (zeros).
      chunk_size: ``C``, one of 16, 32, 64, 128.
      schedule: ``"hoisted"``, ``"in_scan"`` or ``"auto"``, as in ``gated_delta_rule_chunked``.

    Returns:
      ``(y [T, V], final_state [V, K])``: ``y`` in the input dtype, the state in float32
      (float64 for float64 input).
    """
    return chunked_single_head(
        "kda_chunked", KDA, q, k, v, (log_alpha, beta), initial_state,
        scale=scale, chunk_size=chunk_size, schedule=schedule, recurrent="kda_recurrent",
    )  # fmt: skip


@no_type_check  # a public entry point: checks.py names its bad arguments
def kda(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T HV V"],
    log_alpha: Float[Array, "B T HV K"],
    beta: Float[Array, "B T HV"],
    *,
    scale: float | None = None,
    initial_state: Float[Array, "B HV V K"] | None = None,
    use_qk_l2norm: bool = False,
    cu_seqlens: Int[Array, " N+1"] | None = None,
    impl: checks.Impl = "chunked",
    chunk_size: int = 64,
    schedule: checks.Schedule = "auto",
) -> tuple[Float[Array, "B T HV V"], Float[Array, "B HV V K"]]:
    """Kimi Delta Attention (KDA) over a batch of sequences and heads: per value head and
    sequence ``kda_chunked`` (or ``kda_recurrent``). Arguments and results are those of
    ``gated_delta_rule`` but for ``log_alpha``.

    Args:
      q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; one floating dtype for all three.
        ``HV`` is a multiple of ``H``: value head ``i`` reads query/key head ``i // (HV // H)``.
      log_alpha: ``[B, T, HV, K]`` log-space decays (``<= 0``; ``-inf`` resets a channel).
      beta: ``[B, T, HV]`` activated writing strengths.
      scale, initial_state, use_qk_l2norm, cu_seqlens, impl, chunk_size, schedule: as in
        ``gated_delta_rule``.

    Returns:
      ``(o [B, T, HV, V], final_state)``: ``o`` in the input dtype; ``final_state`` float32
      (float64 for float64 input), ``[B, HV, V, K]`` or ``[N, HV, V, K]`` with ``cu_seqlens``.
    """
    return batched(
        KDA, q, k, v, (log_alpha, beta),
        scale=scale, initial_state=initial_state, impl=impl, chunk_size=chunk_size,
        schedule=schedule, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
    )  # fmt: skip


@no_type_check  # a public entry point: checks.py names its bad arguments
def kda_seq_parallel(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T HV V"],
    log_alpha: Float[Array, "B T HV K"],
    beta: Float[Array, "B T HV"],
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
