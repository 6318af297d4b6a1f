"""Gated DeltaProduct (Siems et al., "DeltaProduct: Improving State-Tracking in Linear RNNs
via Householder Products", 2025): ``n`` delta-rule steps per token, the decay once per token,
the read after the last step,

    S^(0) = alpha_t S_{t-1},
    S^(j) = S^(j-1) + beta_{t,j} (v_{t,j} - S^(j-1) k_{t,j}) k_{t,j}^T,   j = 1..n,
    S_t = S^(n),   y_t = S_t (scale q_t).

With ``n >= 2`` and ``beta`` in ``(0, 2)`` the transition is a product of generalised
Householder matrices. ``n = 1`` is the gated delta rule.

It is the gated delta rule over the ``T n`` interleaved steps (token ``t``'s step ``j`` at
``t n + j``, flash-linear-attention's layout): the token's decay on its first step and none
on the others, its query on its last step and zeros on the others, its output read there.
So every form of ``gated_delta.py`` (the staged chunked form with its hand-derived backward,
both schedules, packed sequences, grouped value heads) serves it as it is; the zero queries
cost the outputs of ``n - 1`` steps a token. ``cu_seqlens`` counts tokens, as the outputs do.
"""

from __future__ import annotations

from typing import no_type_check

import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh
from jaxtyping import Array, Float, Int

from gdn_jax.ops import checks
from gdn_jax.ops.rules.gated_delta import (
    gated_delta_rule,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    gated_delta_rule_seq_parallel,
)


def interleaved(x, n: int, *, axis: int, at: int):
    """``x`` with ``n - 1`` zeros around each entry along ``axis`` (length ``T`` -> ``T n``),
    the entry at place ``at`` of its ``n``: a token's query on its last step, its decay on its
    first."""
    x = jnp.expand_dims(x, axis + 1)
    zeros = jnp.zeros_like(x)
    parts = [x if j == at else zeros for j in range(n)]
    stacked = jnp.concatenate(parts, axis=axis + 1)
    return stacked.reshape(*x.shape[:axis], x.shape[axis] * n, *x.shape[axis + 2 :])


def last_steps(y, n: int, *, axis: int):
    """Each token's output, that of its last step, from the steps' ``y`` (``T n`` long along
    ``axis``): a reshape that keeps a split of T over devices local."""
    tokens = y.reshape(*y.shape[:axis], y.shape[axis] // n, n, *y.shape[axis + 1 :])
    return jnp.take(tokens, n - 1, axis=axis + 1)


def batched_steps(fn, q, k, v, log_alpha, beta, n, cu_seqlens):
    """The batched layout checked and laid out over the steps: ``(q, log_alpha, cu_seqlens)``
    of the gated delta rule's op, the offsets in steps."""
    checks.check_householder_steps(fn, q, k, v, log_alpha, beta, n, lead=1)
    if cu_seqlens is not None:
        checks.check_cu_seqlens(fn, cu_seqlens, q.shape[1])
        cu_seqlens = jnp.asarray(cu_seqlens) * n
    return (*as_steps(q, log_alpha, beta, n, axis=1), cu_seqlens)


def as_steps(q, log_alpha, beta, n: int, *, axis: int):
    """The per-token ``q`` and ``log_alpha`` (zeros for ``None``) laid out over the steps."""
    if log_alpha is None:
        log_alpha = jnp.zeros(q.shape[: axis + 1] + beta.shape[axis + 1 :], beta.dtype)
    return interleaved(q, n, axis=axis, at=n - 1), interleaved(log_alpha, n, axis=axis, at=0)


@no_type_check  # a public entry point: checks.py names its bad arguments
def gated_delta_product_recurrent(
    q: Float[Array, "T K"],
    k: Float[Array, "Tn K"],
    v: Float[Array, "Tn V"],
    log_alpha: Float[Array, " T"] | None,
    beta: Float[Array, " Tn"],
    *,
    num_householder: int,
    scale: float | None = None,
    initial_state: Float[Array, "V K"] | None = None,
) -> tuple[Float[Array, "T V"], Float[Array, "V K"]]:
    """Gated DeltaProduct for one head and one sequence, one step at a time.

    Args:
      q: ``[T, K]``, one query a token; k: ``[T n, K]`` and v: ``[T n, V]``, ``n =
        num_householder`` a token, token ``t``'s ``j``-th at ``t n + j``.
      log_alpha: ``[T]`` decays in log space, one a token, or ``None`` (no decay).
      beta: ``[T n]`` writing strengths, one a step (in ``(0, 2)`` with negative eigenvalues).
      num_householder: ``n >= 1``, the steps a token.
      scale, initial_state: as in ``gated_delta_rule_recurrent``.

    Returns:
      ``(y [T, V], final_state [V, K])`` as ``gated_delta_rule_recurrent``'s.
    """
    fn = "gated_delta_product_recurrent"
    checks.check_householder_steps(fn, q, k, v, log_alpha, beta, num_householder, lead=0)
    q_steps, la_steps = as_steps(q, log_alpha, beta, num_householder, axis=0)
    y, final = gated_delta_rule_recurrent(
        q_steps, k, v, la_steps, beta, scale=scale, initial_state=initial_state
    )
    return last_steps(y, num_householder, axis=0), final


@no_type_check  # a public entry point: checks.py names its bad arguments
def gated_delta_product_chunked(
    q: Float[Array, "T K"],
    k: Float[Array, "Tn K"],
    v: Float[Array, "Tn V"],
    log_alpha: Float[Array, " T"] | None,
    beta: Float[Array, " Tn"],
    *,
    num_householder: int,
    scale: float | None = None,
    initial_state: Float[Array, "V K"] | None = None,
    chunk_size: int = 64,
    schedule: checks.Schedule = "auto",
) -> tuple[Float[Array, "T V"], Float[Array, "V K"]]:
    """Gated DeltaProduct for one head and one sequence, chunkwise over the steps: the
    contract of ``gated_delta_product_recurrent`` with ``chunk_size`` (in steps) and
    ``schedule`` as in ``gated_delta_rule_chunked``."""
    fn = "gated_delta_product_chunked"
    checks.check_householder_steps(fn, q, k, v, log_alpha, beta, num_householder, lead=0)
    q_steps, la_steps = as_steps(q, log_alpha, beta, num_householder, axis=0)
    y, final = gated_delta_rule_chunked(
        q_steps, k, v, la_steps, beta, scale=scale, initial_state=initial_state,
        chunk_size=chunk_size, schedule=schedule,
    )  # fmt: skip
    return last_steps(y, num_householder, axis=0), final


@no_type_check  # a public entry point: checks.py names its bad arguments
def gated_delta_product(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B Tn H K"],
    v: Float[Array, "B Tn HV V"],
    log_alpha: Float[Array, "B T HV"] | None,
    beta: Float[Array, "B Tn HV"],
    *,
    num_householder: int,
    scale: float | None = None,
    initial_state: Float[Array, "B HV V K"] | None = None,
    use_qk_l2norm: bool = False,
    cu_seqlens: Int[Array, " N+1"] | None = None,
    impl: checks.Impl = "chunked",
    chunk_size: int = 64,
    schedule: checks.Schedule = "auto",
) -> tuple[Float[Array, "B T HV V"], Float[Array, "B HV V K"]]:
    """Gated DeltaProduct over a batch of sequences and heads, in flash-linear-attention's
    layout: per value head and sequence ``gated_delta_product_chunked`` (or ``_recurrent``).

    Args:
      q: ``[B, T, H, K]``; k: ``[B, T n, H, K]``; v: ``[B, T n, HV, V]``, ``n =
        num_householder`` steps a token (token ``t``'s ``j``-th at ``t n + j``).
      log_alpha: ``[B, T, HV]``, one decay a token, or ``None`` (no forget gate).
      beta: ``[B, T n, HV]``, one a step.
      cu_seqlens: optional ``[N+1]`` offsets of packed sequences, in tokens (``B == 1``).
      scale, initial_state, use_qk_l2norm, impl, chunk_size (in steps), schedule: as in
        ``gated_delta_rule``.

    Returns:
      ``(o [B, T, HV, V], final_state)`` as ``gated_delta_rule``'s.
    """
    q_steps, la_steps, cu_seqlens = batched_steps(
        "gated_delta_product", q, k, v, log_alpha, beta, num_householder, cu_seqlens
    )
    o, final = gated_delta_rule(
        q_steps, k, v, la_steps, beta, scale=scale, initial_state=initial_state,
        use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens, impl=impl,
        chunk_size=chunk_size, schedule=schedule,
    )  # fmt: skip
    return last_steps(o, num_householder, axis=1), final


@no_type_check  # a public entry point: checks.py names its bad arguments
def gated_delta_product_seq_parallel(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B Tn H K"],
    v: Float[Array, "B Tn HV V"],
    log_alpha: Float[Array, "B T HV"] | None,
    beta: Float[Array, "B Tn HV"],
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
    token's steps stay on its shard, so the gated delta rule's sequence-parallel form runs
    the steps as they are; arguments and results as in ``gated_delta_rule_seq_parallel``."""
    q_steps, la_steps, cu_seqlens = batched_steps(
        "gated_delta_product_seq_parallel", q, k, v, log_alpha, beta, num_householder,
        cu_seqlens,
    )  # fmt: skip
    o, final = gated_delta_rule_seq_parallel(
        q_steps, k, v, la_steps, beta, mesh=mesh, axis_name=axis_name, scale=scale,
        initial_state=initial_state, chunk_size=chunk_size, schedule=schedule,
        cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
    )  # fmt: skip
    return last_steps(o, num_householder, axis=1), final
