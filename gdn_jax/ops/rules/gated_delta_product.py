"""Gated DeltaProduct (Siems et al., "DeltaProduct: Improving State-Tracking in Linear RNNs
via Householder Products", 2025): ``n`` delta-rule steps per token, the decay once per token,
the read after the last step,

    S^(0) = alpha_t S_{t-1},
    S^(j) = S^(j-1) + beta_{t,j} (v_{t,j} - S^(j-1) k_{t,j}) k_{t,j}^T,   j = 1..n,
    S_t = S^(n),   y_t = S_t (scale q_t).

With ``n >= 2`` and ``beta`` in ``(0, 2)`` the transition is a product of generalised
Householder matrices. ``n = 1`` is the gated delta rule. Its token step is
``step.householder_step``; ``n = num_householder`` is the rule's option (``Rule.steps``), and
k, v and beta hold one entry a step, token ``t``'s ``j``-th at ``t n + j`` (flash-linear-
attention's layout).

Its chunked form is the gated delta rule's over the ``T n`` interleaved steps: the token's
decay on its first step and none on the others, its query on its last step and zeros on the
others, its output read there. So the staged chunked form of ``ops/chunked/scalar.py`` with its
hand-derived backward, every schedule, packed sequences and grouped value heads serve it as
they are; the zero queries cost the outputs of ``n - 1`` steps a token. ``cu_seqlens``
counts tokens, as the outputs do; ``chunk_size`` counts steps. The gated delta rule's Mosaic
GPU kernels (``impl="mosaic_gpu"``) serve it the same way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int

from gdn_jax.ops import checks
from gdn_jax.ops.api import batched
from gdn_jax.ops.chunked.scalar import chunked_rule
from gdn_jax.ops.rule import MOSAIC_LIMITS, GateSpec, Kernel, Rule, public_form
from gdn_jax.ops.sequence_parallel import seq_parallel
from gdn_jax.ops.single_head import chunked_single_head, recurrent_single_head
from gdn_jax.ops.step import checked_step, householder_step


def interleaved(x, n: int, *, at: int):
    """``x`` with ``n - 1`` zeros around each entry along its first axis (``T`` -> ``T n``),
    the entry at place ``at`` of its ``n``: a token's query on its last step, its decay on
    its first."""
    parts = [x if j == at else jnp.zeros_like(x) for j in range(n)]
    return jnp.stack(parts, axis=1).reshape(x.shape[0] * n, *x.shape[1:])


def product_chunked(
    q: Float[Array, "T K"],
    k: Float[Array, "Tn K"],
    v: Float[Array, "Tn V"],
    gates: tuple,
    initial_states: Float[Array, "N V K"],
    *,
    chunk_size: int,
    cu_seqlens: Int[Array, " N+1"] | None = None,
    schedule: checks.Schedule = "auto",
) -> tuple[Float[Array, "T V"], Float[Array, "N V K"]]:
    """One head's chunked form (``Rule.chunked``): the gated delta rule's over the steps,
    ``n`` the length of ``k`` over that of ``q``, then each token's output from its last
    step (a reshape, which keeps a split of T over devices local)."""
    seq_len = q.shape[0]
    n = k.shape[0] // seq_len
    log_alpha, beta = gates
    steps_gates = (interleaved(log_alpha, n, at=0), beta)
    y, finals = chunked_rule(
        interleaved(q, n, at=n - 1), k, v, steps_gates, initial_states, chunk_size=chunk_size,
        cu_seqlens=None if cu_seqlens is None else cu_seqlens * n, schedule=schedule,
    )  # fmt: skip
    return y.reshape(seq_len, n, -1)[:, n - 1], finals


def mosaic_over_steps(
    q, k, v, gates, initial_states, cu_seqlens, *, chunk_size: int, op, interpret
):
    """The gated delta rule's Mosaic GPU kernels (``ops/mosaic/scalar/op.py``) over the
    interleaved steps, on ``api.prepare_batched``'s inputs (q ``[B, T, H, K]``, k ``[B, T n,
    H, K]``, v ``[B, T n, HV, V]``, ``gates = (log_alpha [B, T, HV], beta [B, T n, HV])``),
    as ``product_chunked`` runs the chunked form."""
    from gdn_jax.ops.mosaic.scalar import op as scalar_kernels

    batch, seq_len = q.shape[:2]
    n = k.shape[1] // seq_len if seq_len else 1
    log_alpha, beta = gates

    def over_steps(x, at):  # [B, T, ...] -> [B, T n, ...]
        return jax.vmap(lambda row: interleaved(row, n, at=at))(x)

    y, finals = scalar_kernels.run(
        over_steps(q, n - 1), k, v, (over_steps(log_alpha, 0), beta), initial_states,
        None if cu_seqlens is None else cu_seqlens * n, chunk_size=chunk_size, op=op,
        interpret=interpret,
    )  # fmt: skip
    return y.reshape(batch, seq_len, n, *y.shape[2:])[:, :, n - 1], finals


GATED_DELTA_PRODUCT = Rule(
    name="gated_delta_product",
    gates=(
        GateSpec("log_alpha", default=0.0, doc="decays in log space (``<= 0``), one a token"),
        GateSpec(
            "beta",
            per_step=True,
            doc="writing strengths, activated (in (0, 2) with negative eigenvalues), one a step",
        ),
    ),
    step=householder_step,
    chunked=product_chunked,
    shares_qk=True,
    steps="num_householder",
    # Opt-in, as the gated delta rule's: no GPU has timed the kernels yet.
    kernels=(Kernel("mosaic_gpu", mosaic_over_steps, MOSAIC_LIMITS),),
)
RULE = GATED_DELTA_PRODUCT


@public_form(RULE, "step")
def gated_delta_product_step(
    state: Float[Array, "V K"],
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_alpha: ArrayLike | None,
    beta: ArrayLike,
    *,
    num_householder: int,
    scale: float | None = None,
) -> tuple[Float[Array, "V K"], Float[Array, " V"]]:
    """Advance one head's Gated DeltaProduct memory by one token (its ``n`` steps) and read
    it: what a decoder calls per token.

    Args:
      state: memory ``[V, K]`` (flash-linear-attention stores the transpose, ``[K, V]``).
    {args}
      scale: query scale; ``None`` means ``K ** -0.5``.

    Returns:
      ``(new_state, y)``: the state in float32 (float64 for float64 input) and ``y [V]`` in
      the dtype of ``v``.
    """
    return checked_step(
        "gated_delta_product_step", RULE, state, q, k, v, (log_alpha, beta), scale=scale,
        num_householder=num_householder,
    )  # fmt: skip


@public_form(RULE, "one_head")
def gated_delta_product_recurrent(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_alpha: ArrayLike | None,
    beta: ArrayLike,
    *,
    num_householder: int,
    scale: float | None = None,
    initial_state: Float[Array, "V K"] | None = None,
) -> tuple[Float[Array, "T V"], Float[Array, "V K"]]:
    """Gated DeltaProduct for one head and one sequence, one token (``n`` steps) at a time.

    Args:
    {args}
      scale: as in ``gated_delta_rule_recurrent``.
      initial_state: as in ``gated_delta_rule_recurrent``.

    Returns:
      ``(y [T, V], final_state [V, K])`` as ``gated_delta_rule_recurrent``'s.
    """
    return recurrent_single_head(
        "gated_delta_product_recurrent", RULE, q, k, v, (log_alpha, beta), initial_state,
        scale=scale, num_householder=num_householder,
    )  # fmt: skip


@public_form(RULE, "one_head")
def gated_delta_product_chunked(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_alpha: ArrayLike | None,
    beta: ArrayLike,
    *,
    num_householder: int,
    scale: float | None = None,
    initial_state: Float[Array, "V K"] | None = None,
    chunk_size: int = 64,
    schedule: checks.Schedule = "auto",
) -> tuple[Float[Array, "T V"], Float[Array, "V K"]]:
    """Gated DeltaProduct for one head and one sequence, chunkwise over the steps: the
    contract of ``gated_delta_product_recurrent``.

    Args:
    {args}
      scale: as in ``gated_delta_rule_chunked``.
      initial_state: as in ``gated_delta_rule_chunked``.
      schedule: as in ``gated_delta_rule_chunked``.
      chunk_size: ``C`` in steps, one of 16, 32, 64, 128.
    """
    return chunked_single_head(
        "gated_delta_product_chunked", RULE, q, k, v, (log_alpha, beta), initial_state,
        scale=scale, chunk_size=chunk_size, schedule=schedule,
        recurrent="gated_delta_product_recurrent", num_householder=num_householder,
    )  # fmt: skip


@public_form(RULE, "batched")
def gated_delta_product(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_alpha: ArrayLike | None,
    beta: ArrayLike,
    *,
    num_householder: int,
    scale: float | None = None,
    initial_state: Float[Array, "B HV V K"] | None = None,
    use_qk_l2norm: bool = False,
    cu_seqlens: Int[Array, " N+1"] | None = None,
    impl: checks.Impl = "auto",
    chunk_size: int = 64,
    schedule: checks.Schedule = "auto",
) -> tuple[Float[Array, "B T HV V"], Float[Array, "B HV V K"]]:
    """Gated DeltaProduct over a batch of sequences and heads, in flash-linear-attention's
    layout: per value head and sequence ``gated_delta_product_chunked`` (or ``_recurrent``).

    Args:
    {args}
      cu_seqlens: optional ``[N+1]`` offsets of packed sequences, in tokens (``B == 1``).
      scale: as in ``gated_delta_rule``.
      initial_state: as in ``gated_delta_rule``.
      use_qk_l2norm: as in ``gated_delta_rule``.
      impl: as in ``gated_delta_rule``.
      chunk_size: in steps, as in ``gated_delta_rule``.
      schedule: as in ``gated_delta_rule``.

    Returns:
      ``(o [B, T, HV, V], final_state)`` as ``gated_delta_rule``'s.
    """
    return batched(
        RULE, q, k, v, (log_alpha, beta), scale=scale, initial_state=initial_state, impl=impl,
        chunk_size=chunk_size, schedule=schedule, cu_seqlens=cu_seqlens,
        use_qk_l2norm=use_qk_l2norm, num_householder=num_householder,
    )  # fmt: skip


@public_form(RULE, "batched")
def gated_delta_product_seq_parallel(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_alpha: ArrayLike | None,
    beta: ArrayLike,
    *,
    num_householder: int,
    mesh: Mesh | AbstractMesh,
    axis_name: str = "seq",
    scale: float | None = None,
    initial_state: Float[Array, "_ HV V K"] | None = None,
    chunk_size: int = 64,
    schedule: checks.Schedule = "auto",
    cu_seqlens: Int[Array, " _"] | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[Float[Array, "B T HV V"], Float[Array, "_ HV V K"]]:
    """``gated_delta_product`` with ``T`` split over the mesh axis ``axis_name``: each
    token's steps stay on its shard.

    Args:
    {args}
      mesh: as in ``gated_delta_rule_seq_parallel``.
      axis_name: as in ``gated_delta_rule_seq_parallel``.
      scale: as in ``gated_delta_rule_seq_parallel``.
      initial_state: as in ``gated_delta_rule_seq_parallel``.
      chunk_size: in steps, as in ``gated_delta_rule_seq_parallel``.
      schedule: as in ``gated_delta_rule_seq_parallel``.
      cu_seqlens: in tokens, as in ``gated_delta_rule_seq_parallel``.
      use_qk_l2norm: as in ``gated_delta_rule_seq_parallel``.

    Returns:
      ``(o [B, T, HV, V], final_state)`` as ``gated_delta_rule_seq_parallel``'s.
    """
    return seq_parallel(
        RULE, q, k, v, (log_alpha, beta), fn="gated_delta_product_seq_parallel", mesh=mesh,
        axis_name=axis_name, scale=scale, initial_state=initial_state, chunk_size=chunk_size,
        schedule=schedule, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
        num_householder=num_householder,
    )  # fmt: skip
