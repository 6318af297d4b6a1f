"""The gated delta rule (Gated DeltaNet; Yang, Kautz & Hatamizadeh, ICLR 2025, Eq. 10):

    S_t = alpha_t S_{t-1} + beta_t (v_t - alpha_t S_{t-1} k_t) k_t^T,    y_t = S_t (scale q_t)

per head, with ``alpha_t = exp(log_alpha_t)`` one number per head and token and the state
``S [V, K]``: decay, then correct along the key, then read with the query. Its chunked form,
with one decay per token, is ``ops/chunked/scalar.py``'s.
"""

from __future__ import annotations

from jax.sharding import AbstractMesh, Mesh
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int

from gdn_jax.ops import checks
from gdn_jax.ops.api import batched
from gdn_jax.ops.chunked.scalar import chunked_rule
from gdn_jax.ops.rule import MOSAIC_LIMITS, GateSpec, Kernel, Rule, public_form
from gdn_jax.ops.sequence_parallel import seq_parallel
from gdn_jax.ops.single_head import chunked_single_head, recurrent_single_head
from gdn_jax.ops.step import checked_step, delta_step

GATED_DELTA = Rule(
    name="gated_delta_rule",
    gates=(
        GateSpec("log_alpha", doc="decay gates in log space (``<= 0``; ``-inf`` is a full reset)"),
        GateSpec(
            "beta", doc="writing strengths, already activated (up to 2 with negative eigenvalues)"
        ),
    ),
    step=delta_step,
    chunked=chunked_rule,
    shares_qk=True,
    # Opt-in until a GPU has timed it against the chunked form (docs/benchmarks.md).
    kernels=(Kernel("mosaic_gpu", "gdn_jax.ops.mosaic.scalar.op:run", MOSAIC_LIMITS),),
)


@public_form(GATED_DELTA, "step")
def gated_delta_step(
    state: Float[Array, "V K"],
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_alpha: ArrayLike,
    beta: ArrayLike,
    *,
    scale: float | None = None,
) -> tuple[Float[Array, "V K"], Float[Array, " V"]]:
    """Advance one head's memory by one token and read it: what a decoder calls per token.

    Args:
      state: memory ``[V, K]``, one row per value feature (flash-linear-attention stores the
        transpose, ``[K, V]``).
    {args}
      scale: query scale; ``None`` means ``K ** -0.5``.

    Returns:
      ``(new_state, y)``: the state in float32 (float64 for float64 input) and ``y [V]`` in
      the dtype of ``v``.
    """
    gates = (log_alpha, beta)
    return checked_step("gated_delta_step", GATED_DELTA, state, q, k, v, gates, scale=scale)


@public_form(GATED_DELTA, "one_head")
def gated_delta_rule_recurrent(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_alpha: ArrayLike,
    beta: ArrayLike,
    *,
    scale: float | None = None,
    initial_state: Float[Array, "V K"] | None = None,
) -> tuple[Float[Array, "T V"], Float[Array, "V K"]]:
    """One head, one sequence, one token at a time: the readable reference form.

    Args:
    {args}
      scale: query scale; ``None`` means ``K ** -0.5``.
      initial_state: ``[V, K]`` or ``None`` (zeros).

    Returns:
      ``(y [T, V], final_state [V, K])``: ``y`` in the input dtype, the state in float32
      (float64 for float64 input).
    """
    fn = "gated_delta_rule_recurrent"
    gates = (log_alpha, beta)
    return recurrent_single_head(fn, GATED_DELTA, q, k, v, gates, initial_state, scale=scale)


@public_form(GATED_DELTA, "one_head")
def gated_delta_rule_chunked(
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
    """One head, one sequence, chunkwise; the same contract as ``gated_delta_rule_recurrent``.

    Any ``T >= 1`` works (the tail chunk is padded with tokens that neither decay nor write).
    Gradients reach q, k, v, log_alpha, beta and initial_state through a hand-written VJP
    that stores the inputs and one ``[V, K]`` state per chunk, never one per token.

    Args:
    {args}
      scale: query scale; ``None`` means ``K ** -0.5``.
      initial_state: ``[V, K]`` or ``None`` (zeros).
      chunk_size: ``C``, one of 16, 32, 64, 128.
      schedule: where each chunk's own work runs. ``"hoisted"`` batches it over all chunks
        outside the sequential scan, which then holds only state-sized products (the shape
        accelerators need); ``"associative"`` batches it too and replaces the scan by an
        associative scan over the chunks' state maps (``ops/chunked/state_scan.py``: no loop, a few
        dozen kernels on a GPU where a loop launches a few a chunk, for ``[K, K]`` products);
        ``"in_scan"`` runs it chunk by chunk inside the scan, which keeps a chunk's
        intermediates in cache on CPU; ``"auto"`` is ``"in_scan"`` when compiled for CPU,
        ``"associative"`` for an NVIDIA GPU and ``"hoisted"`` for any other platform,
        including a TPU compiled for ahead of time from a CPU host. All compute the same
        function and gradients.

    Returns:
      ``(y [T, V], final_state [V, K])``: ``y`` in the input dtype, the state in float32
      (float64 for float64 input). A NaN in k, v or a gate at token t makes ``y`` NaN from
      the start of t's chunk on, not from t as in the recurrent form (``ops/chunked/scalar.py``).
    """
    return chunked_single_head(
        "gated_delta_rule_chunked", GATED_DELTA, q, k, v, (log_alpha, beta), initial_state,
        scale=scale, chunk_size=chunk_size, schedule=schedule,
        recurrent="gated_delta_rule_recurrent",
    )  # fmt: skip


@public_form(GATED_DELTA, "batched")
def gated_delta_rule(
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
    """The gated delta rule over a batch of sequences and heads.

    Per value head and sequence this is ``gated_delta_rule_chunked`` (or ``_recurrent``).

    Args:
    {args}
      scale: query scale; ``None`` means ``K ** -0.5``.
      initial_state: ``[B, HV, V, K]``, or ``[N, HV, V, K]`` with ``cu_seqlens``; ``None`` is
        zeros. flash-linear-attention's states are ``[.., K, V]``: pass ``swapaxes(-1, -2)``.
      impl: ``"chunked"`` (train with this), ``"recurrent"`` (the token-by-token
        reference), a kernel of the rule (``Rule.kernels``), or ``"auto"``: for the platform
        compiled for, a kernel that a GPU has timed faster than the chunked form, else
        ``"chunked"`` (today ``"chunked"`` everywhere).
      chunk_size: 16, 32, 64 or 128 (chunked only).
      schedule: ``"auto"``, ``"hoisted"``, ``"associative"`` or ``"in_scan"`` (chunked
        only), as in ``gated_delta_rule_chunked``.
      cu_seqlens: ``[N+1]`` int offsets of ``N`` sequences packed along ``T`` (needs ``B == 1``).
        Each sequence starts from its own initial state and returns its own final state, as
        if run alone. It may be traced; its values are checked only when concrete.
      use_qk_l2norm: L2-normalise q and k over ``K`` (eps 1e-6) inside the op; a Python bool
        (static under ``jax.jit``).

    Returns:
      ``(o [B, T, HV, V], final_state)``: ``o`` in the input dtype; ``final_state`` float32
      (float64 for float64 input), ``[B, HV, V, K]`` or ``[N, HV, V, K]`` with ``cu_seqlens``.
    """
    return batched(
        GATED_DELTA, q, k, v, (log_alpha, beta),
        scale=scale, initial_state=initial_state, impl=impl, chunk_size=chunk_size,
        schedule=schedule, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
    )  # fmt: skip


@public_form(GATED_DELTA, "batched")
def gated_delta_rule_seq_parallel(
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
    """``gated_delta_rule`` (chunked) with ``T`` split over the mesh axis ``axis_name``
    (``sequence_parallel.seq_parallel``): each device holds ``T / n`` consecutive tokens, and
    the devices exchange one ``[V + K, K]`` state per head and sequence, never activations.

    Args:
    {args}
      scale: as in ``gated_delta_rule``.
      initial_state: as in ``gated_delta_rule``.
      chunk_size: as in ``gated_delta_rule``; ``T`` must be divisible by the size ``n`` of
        the axis, ``T / n`` need not be a multiple of ``chunk_size``.
      schedule: as in ``gated_delta_rule``.
      use_qk_l2norm: as in ``gated_delta_rule``.
      mesh: a ``jax.sharding.Mesh`` with an axis ``axis_name``.
      axis_name: the mesh axis that splits ``T``.
      cu_seqlens: ``[N+1]`` global offsets of packed sequences (``B == 1``); a sequence may
        cross any number of shard boundaries. It may be traced.

    Returns:
      ``(o [B, T, HV, V], final_state)``: ``o`` in the input dtype, sharded like ``q``;
      ``final_state`` float32 (float64 for float64 input), ``[B, HV, V, K]`` or ``[N, HV, V,
      K]``, the same on every device of the axis.
    """
    return seq_parallel(
        GATED_DELTA, q, k, v, (log_alpha, beta,),
        fn="gated_delta_rule_seq_parallel", mesh=mesh, axis_name=axis_name, scale=scale,
        initial_state=initial_state, chunk_size=chunk_size, schedule=schedule,
        cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
    )  # fmt: skip
