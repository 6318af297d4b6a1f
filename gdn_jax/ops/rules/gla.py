"""Gated linear attention (GLA; Yang et al., "Gated Linear Attention Transformers with
Hardware-Efficient Training", ICML 2024, arXiv 2312.06635), flash-linear-attention's
``chunk_gla``: one decay per key channel, no delta correction, no writing strength,

    S_t = S_{t-1} Diag(alpha_t) + v_t k_t^T,    y_t = S_t (scale q_t),
    alpha_t = exp(log_alpha_t) in (0, 1]^K.

flash-linear-attention keeps the transpose, ``S_t = Diag(alpha_t) S_{t-1} + k_t v_t^T`` on
``[K, V]``, and reads ``o_t = S_t^T (scale q_t)`` (``naive_recurrent_gla``). With every channel
of ``log_alpha`` equal it is ``simple_gla`` with ``beta = 1``. Its chunked form is
``ops/chunked/channel.py``'s without an erase gate (``erase=False``), whose backward is that
module's.

This rule took the name ``gated_linear_attention`` from the scalar-gated rule, which is now
``simple_gla`` (the name flash-linear-attention and jax-linear-attention give it). A call in
that rule's old form, with ``beta``, still runs it, with a ``DeprecationWarning`` once per
process.
"""

from __future__ import annotations

import functools

from jax.sharding import AbstractMesh, Mesh
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int

from gdn_jax.ops import checks
from gdn_jax.ops.api import batched
from gdn_jax.ops.chunked.channel import channel_chunked_rule
from gdn_jax.ops.renamed import warn_renamed
from gdn_jax.ops.rule import GateSpec, Rule, public_form
from gdn_jax.ops.rules import simple_gla as scalar
from gdn_jax.ops.sequence_parallel import seq_parallel
from gdn_jax.ops.single_head import chunked_single_head, recurrent_single_head
from gdn_jax.ops.step import checked_step, gla_step

GLA = Rule(
    name="gated_linear_attention",
    gates=(
        GateSpec(
            "log_alpha",
            "K",
            doc="decay gates in log space (``<= 0``; ``-inf`` resets a channel), one per key channel",
        ),
    ),
    step=gla_step,
    chunked=functools.partial(channel_chunked_rule, erase=False),
    shares_qk=False,  # every product of q or k carries a value head's own decays
)


def _old_form(fn: str, beta) -> bool:
    """Whether a call of ``fn`` is in the scalar-gated rule's old form (``beta`` given), and
    if so warn (once) that it is deprecated."""
    if beta is None:
        return False
    new = fn.replace("gated_linear_attention", "simple_gla")
    warn_renamed(f"{fn} with beta (the scalar-gated rule)", new, stacklevel=4)
    return True


@public_form(GLA, "step")
def gated_linear_attention_step(
    state: Float[Array, "V K"],
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_alpha: ArrayLike,
    beta: ArrayLike | None = None,
    *,
    scale: float | None = None,
) -> tuple[Float[Array, "V K"], Float[Array, " V"]]:
    """Advance one head's GLA memory by one token and read it: what a decoder calls per token.

    Args:
      state: memory ``[V, K]`` (flash-linear-attention stores the transpose, ``[K, V]``).
    {args}
      beta: ``None``. Given, the call is in the old form of the scalar-gated rule that had
        this name, and runs ``simple_gla_step`` (a ``DeprecationWarning``, once a process).
      scale: query scale; ``None`` means ``K ** -0.5``.

    Returns:
      ``(new_state, y)``: the state in float32 (float64 for float64 input) and ``y [V]`` in
      the dtype of ``v``.
    """
    fn = "gated_linear_attention_step"
    if _old_form(fn, beta):
        return scalar.simple_gla_step(state, q, k, v, log_alpha, beta, scale=scale)
    return checked_step(fn, GLA, state, q, k, v, (log_alpha,), scale=scale)


@public_form(GLA, "one_head")
def gated_linear_attention_recurrent(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_alpha: ArrayLike,
    beta: ArrayLike | None = None,
    *,
    scale: float | None = None,
    initial_state: Float[Array, "V K"] | None = None,
) -> tuple[Float[Array, "T V"], Float[Array, "V K"]]:
    """Gated linear attention for one head and one sequence, one token at a time: the
    reference form.

    Args:
    {args}
      beta: ``None``. Given, the call is in the old form of the scalar-gated rule that had
        this name, and runs ``simple_gla_recurrent`` (a ``DeprecationWarning``, once a
        process).
      scale: query scale; ``None`` means ``K ** -0.5``.
      initial_state: ``[V, K]`` or ``None``.

    Returns:
      ``(y [T, V], final_state [V, K])``: ``y`` in the input dtype, the state in float32
      (float64 for float64 input).
    """
    fn = "gated_linear_attention_recurrent"
    if _old_form(fn, beta):
        return scalar.simple_gla_recurrent(
            q, k, v, log_alpha, beta, scale=scale, initial_state=initial_state
        )
    return recurrent_single_head(fn, GLA, q, k, v, (log_alpha,), initial_state, scale=scale)


@public_form(GLA, "one_head")
def gated_linear_attention_chunked(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_alpha: ArrayLike,
    beta: ArrayLike | None = None,
    *,
    scale: float | None = None,
    initial_state: Float[Array, "V K"] | None = None,
    chunk_size: int = 64,
    schedule: checks.Schedule = "auto",
) -> tuple[Float[Array, "T V"], Float[Array, "V K"]]:
    """Gated linear attention for one head and one sequence, chunkwise; the contract of
    ``gated_linear_attention_recurrent``.

    Any ``T >= 1`` works. Gradients reach every input through the hand-written VJP of
    ``ops/chunked/channel.py``, which keeps the inputs and one ``[V, K]`` state per chunk.

    Args:
    {args}
      beta: ``None``. Given, the call is in the old form of the scalar-gated rule that had
        this name, and runs ``simple_gla_chunked`` (a ``DeprecationWarning``, once a
        process).
      scale: query scale; ``None`` means ``K ** -0.5``.
      initial_state: ``[V, K]`` or ``None`` (zeros).
      chunk_size: ``C``, one of 16, 32, 64, 128.
      schedule: ``"hoisted"``, ``"associative"``, ``"in_scan"`` or ``"auto"``, as in
        ``gated_delta_rule_chunked``.

    Returns:
      ``(y [T, V], final_state [V, K])``: ``y`` in the input dtype, the state in float32
      (float64 for float64 input).
    """
    fn = "gated_linear_attention_chunked"
    options = dict(scale=scale, initial_state=initial_state, chunk_size=chunk_size)
    if _old_form(fn, beta):
        return scalar.simple_gla_chunked(q, k, v, log_alpha, beta, **options, schedule=schedule)
    return chunked_single_head(
        fn, GLA, q, k, v, (log_alpha,), initial_state, scale=scale, chunk_size=chunk_size,
        schedule=schedule, recurrent="gated_linear_attention_recurrent",
    )  # fmt: skip


@public_form(GLA, "batched")
def gated_linear_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_alpha: ArrayLike,
    beta: ArrayLike | None = None,
    *,
    scale: float | None = None,
    initial_state: Float[Array, "B HV V K"] | None = None,
    use_qk_l2norm: bool = False,
    cu_seqlens: Int[Array, " N+1"] | None = None,
    impl: checks.Impl = "auto",
    chunk_size: int = 64,
    schedule: checks.Schedule = "auto",
) -> tuple[Float[Array, "B T HV V"], Float[Array, "B HV V K"]]:
    """Gated linear attention (GLA, flash-linear-attention's ``chunk_gla``) over a batch of
    sequences and heads: per value head and sequence ``gated_linear_attention_chunked`` (or
    ``gated_linear_attention_recurrent``).

    flash-linear-attention's ``chunk_gla(q, k, v, g, initial_state=h0,
    output_final_state=True)`` is ``gated_linear_attention(q, k, v, g, initial_state=h0 with
    its last two axes swapped)``, the final state likewise transposed.

    Args:
    {args}
      beta: ``None``. Given, the call is in the old form of the scalar-gated rule that had
        this name, and runs ``simple_gla`` (a ``DeprecationWarning``, once a process).
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
    options = dict(
        scale=scale, initial_state=initial_state, impl=impl, chunk_size=chunk_size,
        schedule=schedule, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
    )  # fmt: skip
    if _old_form("gated_linear_attention", beta):
        return scalar.simple_gla(q, k, v, log_alpha, beta, **options)
    return batched(GLA, q, k, v, (log_alpha,), **options)


@public_form(GLA, "batched")
def gated_linear_attention_seq_parallel(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_alpha: ArrayLike,
    beta: ArrayLike | None = None,
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
    """``gated_linear_attention`` with ``T`` split over the mesh axis ``axis_name``;
    arguments and results as in ``gated_delta_rule_seq_parallel``; ``beta`` given runs
    ``simple_gla_seq_parallel`` (the old form, deprecated)."""
    fn = "gated_linear_attention_seq_parallel"
    options = dict(
        mesh=mesh, axis_name=axis_name, scale=scale, initial_state=initial_state,
        chunk_size=chunk_size, schedule=schedule, cu_seqlens=cu_seqlens,
        use_qk_l2norm=use_qk_l2norm,
    )  # fmt: skip
    if _old_form(fn, beta):
        return scalar.simple_gla_seq_parallel(q, k, v, log_alpha, beta, **options)
    return seq_parallel(GLA, q, k, v, (log_alpha,), fn=fn, **options)
