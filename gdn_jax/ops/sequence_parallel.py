"""The gated delta rule with the tokens split over a mesh axis (sequence or context parallelism).

Each of the ``n`` devices along ``axis_name`` holds ``T / n`` consecutive tokens. Every
token's update is affine in the state, and so is a shard's:

    S_end = S_start P + R,   P [K, K] = prod_t alpha_t (I - beta_t k_t k_t^T)  (in order),
                             R [V, K] = the shard's end state from a zero start,

with ``P = prod_t alpha_t I`` for the linear rule. The rows of a state evolve independently,
so one run of ``chunked.chunked_rule`` over the shard's own tokens gives both at once: it
runs the stacked state ``[R; P]`` of ``V + K`` rows from ``[0; I]`` with values ``[v | 0]``.
Its outputs are stacked the same way, ``y_t = R_t q_t`` and ``z_t = P_t q_t``. The devices
then gather the shards' ``[R; P]`` carries, ``[V + K, K]`` per head (state-sized; no
activation leaves its device), compose them in order into each shard's true start state
``S_start``, and finish without a second pass over the tokens:

    o_t = S_t q_t = R_t q_t + S_start P_t q_t = y_t + S_start z_t.

So the whole op is one chunked run of width ``V + K`` (its backward keeps one ``[V + K, K]``
state per chunk) rather than the ``(P, R)`` runs followed by a second pass over the tokens
from ``S_start``.

Gradients come from autodiff: the transpose of the gather carries the cotangents of the
pairs back to the shards that made them, so they cross the shard boundaries in reverse.

Packed sequences (``cu_seqlens``, global offsets on every device) may cross shard boundaries.
At most one sequence enters a shard from the left: the one holding the shard's first token,
when it started earlier. Only it starts from ``[0; I]``; every sequence that starts inside
the shard starts from ``[its initial state; 0]``, so it does not depend on ``S_start``. The
state handed to the next shard is that of the sequence holding the shard's last token, and
each sequence's final state comes from the shard holding its last token.

Shapes, with the project's letters: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, gates
``[B, T, HV]``, states ``[B, HV, V, K]`` (``[N, HV, V, K]`` with ``cu_seqlens``, ``B == 1``;
the annotations write ``_`` for that axis); one shard holds ``T / n`` tokens, laid out in
chunks of ``C``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, Shaped

from gdn_jax.ops import checks
from gdn_jax.ops.api import DELTA_RULE, LINEAR_RULE, Rule
from gdn_jax.ops.chunked import chunked_rule
from gdn_jax.ops.normalize import l2_normalize
from gdn_jax.ops.step import compute_dtype, default_scale
from gdn_jax.ops.wy import DELTA


def _compose(first, second):
    """The affine state maps ``S -> S P + R`` of two consecutive spans, as one:
    ``(S P1 + R1) P2 + R2 = S (P1 P2) + (R1 P2 + R2)``."""
    (p1, r1), (p2, r2) = first, second
    return p1 @ p2, r1 @ p2 + r2


def shard_start_state(carry, value_dim, axis_name):
    """This shard's true start state from every shard's stacked ``[R; P]`` carry.

    ``carry [V + K, K]`` is the state this shard hands on, from a zero start and from the
    identity. The gather is the only communication of the forward pass; shard 0's ``P`` is
    zero (it starts from the known initial state), so the composition starts from zero.
    """
    stacked = jax.lax.all_gather(carry, axis_name)  # [n, V + K, K]
    maps = (stacked[:, value_dim:], stacked[:, :value_dim])
    _, through = jax.lax.associative_scan(jax.vmap(_compose), maps)  # after shards 0..j
    shard = jax.lax.axis_index(axis_name)
    before = through[jnp.maximum(shard - 1, 0)]
    return jnp.where(shard > 0, before, jnp.zeros_like(before))


def _with_start(stacked, start, value_dim):
    """Apply the start state to stacked ``[R; P]`` rows: ``R + S_start P``."""
    return stacked[..., :value_dim, :] + start @ stacked[..., value_dim:, :]


def seq_parallel_rule(
    q,
    k,
    v,
    log_alpha,
    beta,
    initial_states,
    *,
    axis_name,
    chunk_size,
    cu_seqlens=None,
    rule=DELTA,
    schedule="auto",
):
    """One head over one shard of the tokens, called inside ``jax.shard_map``; the
    sequence-parallel twin of ``chunked.chunked_rule``, with its arguments and results.

    Arrays are in the compute dtype and ``q`` is pre-scaled: q, k ``[T / n, K]``, v
    ``[T / n, V]``, gates ``[T / n]`` are this shard's tokens; ``initial_states [N, V, K]``
    and ``cu_seqlens [N+1]`` (global offsets) are the same on every shard. ``T / n`` need
    not be a multiple of ``chunk_size``.

    Returns ``(y [T / n, V], finals [N, V, K])``; ``finals`` is the same on every shard.
    """
    local_len, key_dim = q.shape
    value_dim = v.shape[1]
    dtype = initial_states.dtype
    shard = jax.lax.axis_index(axis_name)
    first = shard * local_len
    identity = jnp.eye(key_dim, dtype=dtype)
    stacked_v = jnp.concatenate([v, jnp.zeros((local_len, key_dim), v.dtype)], axis=1)

    # The values part starts from the known initial states, the transition part from I, and
    # each from zero where the other applies. Masking the values part alone keeps the
    # cotangent that the replicated initial states gather from every shard [V, K]-sized.
    if cu_seqlens is None:
        # Shard 0 starts from the initial state, every other one from the carry.
        first_shard = shard == 0
        values = jnp.where(first_shard, initial_states, jnp.zeros_like(initial_states))
        transition = jnp.where(first_shard, jnp.zeros_like(identity), identity)[None]
        local_cu = None
    else:
        cu = cu_seqlens.astype(jnp.int32)
        num_seqs = cu.shape[0] - 1
        ids = jnp.arange(num_seqs, dtype=jnp.int32)
        # Past a traced last offset the search returns N: no sequence holds the token.
        entering = jnp.searchsorted(cu, first, side="right") - 1
        enters = (entering < num_seqs) & (cu[jnp.minimum(entering, num_seqs - 1)] < first)
        from_left = (enters & (ids == entering))[:, None, None]
        values = jnp.where(from_left, jnp.zeros_like(initial_states), initial_states)
        transition = jnp.where(from_left, identity[None], jnp.zeros_like(identity)[None])
        # Local offsets; sequences outside the shard become empty and keep their start.
        local_cu = jnp.clip(cu - first, 0, local_len)
    starts = jnp.concatenate([values, transition], axis=1)

    ys, finals = chunked_rule(
        q,
        k,
        stacked_v,
        log_alpha,
        beta,
        starts,
        chunk_size=chunk_size,
        cu_seqlens=local_cu,
        rule=rule,
        schedule=schedule,
    )

    if cu_seqlens is None:
        carry = finals[0]
    else:
        holder = jnp.searchsorted(cu, first + local_len - 1, side="right") - 1
        held = holder < num_seqs
        carry = jnp.where(
            held, finals[jnp.minimum(holder, num_seqs - 1)], jnp.zeros_like(finals[0])
        )
    start = shard_start_state(carry, value_dim, axis_name)

    y = ys[:, :value_dim] + ys[:, value_dim:] @ start.T
    finals = _with_start(finals, start, value_dim)

    # Each sequence's final state lives on the shard with its last token; one masked sum
    # makes it the same on every shard (and sends the cotangent back to that shard alone).
    if cu_seqlens is None:
        owns = (shard == jax.lax.axis_size(axis_name) - 1)[None]
    else:
        last = cu[1:] - 1
        owns = (last >= cu[:-1]) & (last // local_len == shard)
    total = jax.lax.psum(jnp.where(owns[:, None, None], finals, jnp.zeros_like(finals)), axis_name)
    if cu_seqlens is not None:
        # A sequence without tokens has no shard; it keeps its initial state.
        empty = (cu[1:] == cu[:-1])[:, None, None]
        total = jnp.where(empty, initial_states, total)
    return y, total


def halo_from_previous(x: Shaped[Array, "T ..."], width: int, axis_name: str):
    """Inside ``jax.shard_map``, given this shard's tokens ``x [T / n, ...]``: the last
    ``width`` tokens of the previous shard along ``axis_name``, ``[width, ...]``, zeros on
    shard 0.

    This is the history a causal convolution of ``width + 1`` taps needs at the shard's
    start (``conv.causal_depthwise_conv``'s ``history``). Only ``width`` tokens travel, one
    hop to the right, so ``width`` must be at most ``T / n``. With packed sequences the
    halo may belong to an earlier sequence; ``same_segment`` drops those taps as at any
    other sequence start.
    """
    fn = "halo_from_previous"
    checks.check_arrays(fn, x=x)
    checks.check_positive_int(fn, width=width)
    if x.ndim < 1 or width > x.shape[0]:
        raise ValueError(
            f"{fn}: width={width} must be at most the tokens per shard, x.shape[0], got "
            f"x.shape={x.shape}"
        )
    size = jax.lax.axis_size(axis_name)
    to_next = [(i, i + 1) for i in range(size - 1)]
    return jax.lax.ppermute(x[x.shape[0] - width :], axis_name, to_next)


def _check_mesh(fn, mesh, axis_name, seq_len):
    if not isinstance(mesh, (Mesh, AbstractMesh)):
        raise ValueError(f"{fn}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"{fn}: axis_name={axis_name!r} must be an axis of the mesh, got axes "
            f"{tuple(mesh.axis_names)}"
        )
    shards = mesh.shape[axis_name]
    if seq_len % shards:
        raise ValueError(
            f"{fn}: T={seq_len} (q.shape[1]) must be divisible by the {shards} devices of mesh "
            f"axis {axis_name!r}"
        )


def _check_batched(fn, q, k, v, log_alpha, beta, initial_state, cu_seqlens):
    """The shapes and dtypes of ``api.gated_delta_rule``'s arguments."""
    arrays = dict(q=q, k=k, v=v, log_alpha=log_alpha, beta=beta, initial_state=initial_state)
    checks.check_arrays(fn, **arrays)
    checks.check_floating(fn, **arrays)
    checks.check_same_dtype(fn, q=q, k=k, v=v)
    checks.check_rank(fn, "q", q, 4, "[B, T, H, K]")
    checks.check_rank(fn, "v", v, 4, "[B, T, HV, V]")
    batch, seq_len, heads, key_dim = q.shape
    v_heads, value_dim = v.shape[2], v.shape[3]
    checks.check_shape(fn, "k", k, q.shape, "[B, T, H, K] like q")
    checks.check_shape(fn, "v", v, (batch, seq_len, v_heads, value_dim), "[B, T, HV, V]")
    checks.check_shape(fn, "log_alpha", log_alpha, (batch, seq_len, v_heads), "[B, T, HV]")
    checks.check_shape(fn, "beta", beta, (batch, seq_len, v_heads), "[B, T, HV]")
    if heads < 1 or v_heads % heads:
        raise ValueError(
            f"{fn}: value heads HV={v_heads} (v.shape={v.shape}) must be a multiple of "
            f"query/key heads H={heads} (q.shape={q.shape})"
        )
    if seq_len < 1:
        raise ValueError(f"{fn}: need at least one token, got q.shape={q.shape}")
    num_states = batch
    if cu_seqlens is not None:
        if batch != 1:
            raise ValueError(
                f"{fn}: cu_seqlens packs sequences along T and needs B == 1, got q.shape={q.shape}"
            )
        checks.check_cu_seqlens(fn, cu_seqlens, seq_len)
        num_states = cu_seqlens.shape[0] - 1
    if initial_state is not None:
        layout = "[N, HV, V, K]" if cu_seqlens is not None else "[B, HV, V, K]"
        checks.check_shape(
            fn, "initial_state", initial_state, (num_states, v_heads, value_dim, key_dim), layout
        )


def gated_delta_rule_seq_parallel(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T HV V"],
    log_alpha: Float[Array, "B T HV"],
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
    """``api.gated_delta_rule`` (chunked) with ``T`` split over the mesh axis ``axis_name``.

    The arguments and results are those of ``gated_delta_rule``, and so are the values, up to
    float rounding. Device ``i`` along ``axis_name`` holds tokens ``i T/n : (i+1) T/n``; the
    devices exchange one ``[V + K, K]`` state per head and sequence, never activations.
    The other axes of ``mesh`` are left to the compiler (``shard_map`` is manual over
    ``axis_name`` only), so a batch sharded over a data axis stays sharded.

    Args:
      q, k, v, log_alpha, beta, scale, initial_state, chunk_size, schedule, use_qk_l2norm:
        as in ``gated_delta_rule``. ``T`` must be divisible by the size ``n`` of the axis;
        ``T / n`` need not be a multiple of ``chunk_size``.
      mesh: a ``jax.sharding.Mesh`` with an axis ``axis_name``.
      axis_name: the mesh axis that splits ``T``.
      cu_seqlens: ``[N+1]`` global offsets of packed sequences (``B == 1``); a sequence may
        cross any number of shard boundaries. It may be traced.

    Returns:
      ``(o [B, T, HV, V], final_state)``: ``o`` in the input dtype, sharded like ``q``;
      ``final_state`` float32 (float64 for float64 input), ``[B, HV, V, K]`` or ``[N, HV, V,
      K]``, the same on every device of the axis.
    """
    options = dict(mesh=mesh, axis_name=axis_name, scale=scale, initial_state=initial_state)
    options.update(chunk_size=chunk_size, schedule=schedule, cu_seqlens=cu_seqlens)
    options.update(use_qk_l2norm=use_qk_l2norm)
    fn = "gated_delta_rule_seq_parallel"
    return _seq_parallel(fn, DELTA_RULE, q, k, v, log_alpha, beta, **options)


def gated_linear_attention_seq_parallel(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T HV V"],
    log_alpha: Float[Array, "B T HV"],
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
    """``api.gated_linear_attention`` (no delta correction) with ``T`` split over the mesh
    axis ``axis_name``; arguments and results as in ``gated_delta_rule_seq_parallel``."""
    options = dict(mesh=mesh, axis_name=axis_name, scale=scale, initial_state=initial_state)
    options.update(chunk_size=chunk_size, schedule=schedule, cu_seqlens=cu_seqlens)
    options.update(use_qk_l2norm=use_qk_l2norm)
    fn = "gated_linear_attention_seq_parallel"
    return _seq_parallel(fn, LINEAR_RULE, q, k, v, log_alpha, beta, **options)


def _seq_parallel(
    fn,
    rule: Rule,
    q,
    k,
    v,
    log_alpha,
    beta,
    *,
    mesh,
    axis_name,
    scale,
    initial_state,
    chunk_size,
    schedule,
    cu_seqlens,
    use_qk_l2norm,
):
    _check_batched(fn, q, k, v, log_alpha, beta, initial_state, cu_seqlens)
    _check_mesh(fn, mesh, axis_name, q.shape[1])
    checks.check_scale(fn, scale)
    checks.check_chunk_size(fn, chunk_size)
    checks.check_schedule(fn, schedule)
    batch, seq_len, heads, key_dim = q.shape
    v_heads, value_dim = v.shape[2], v.shape[3]
    scale = default_scale(key_dim) if scale is None else scale
    compute = compute_dtype(q, log_alpha, beta, initial_state)
    out_dtype = v.dtype

    q, k = q.astype(compute), k.astype(compute)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * scale
    v, log_alpha, beta = v.astype(compute), log_alpha.astype(compute), beta.astype(compute)
    num_states = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if initial_state is None:
        initial_state = jnp.zeros((num_states, v_heads, value_dim, key_dim), compute)
    initial_state = initial_state.astype(compute)

    one_head = functools.partial(
        seq_parallel_rule,
        axis_name=axis_name,
        chunk_size=chunk_size,
        rule=rule.chunk,
        schedule=schedule,
    )
    # As in api.gated_delta_rule: the R value heads of one key head share its q and k.
    group = v_heads // heads
    split_heads = (heads, group)

    def per_shard(q, k, v, log_alpha, beta, initial_state, *cu):
        cu = cu[0] if cu else None
        local_len = q.shape[1]
        v = v.reshape(batch, local_len, *split_heads, value_dim)
        log_alpha, beta = (x.reshape(batch, local_len, *split_heads) for x in (log_alpha, beta))
        states = initial_state.reshape(num_states, *split_heads, value_dim, key_dim)
        if cu is None:

            def one_sequence(q, k, v, log_alpha, beta, state):
                y, finals = one_head(q, k, v, log_alpha, beta, state[None])
                return y, finals[0]

            over_group = jax.vmap(one_sequence, in_axes=(None, None, 1, 1, 1, 0), out_axes=(1, 0))
            over_heads = jax.vmap(over_group, in_axes=(1, 1, 1, 1, 1, 0), out_axes=(1, 0))
            out, final = jax.vmap(over_heads)(q, k, v, log_alpha, beta, states)
        else:
            packed = functools.partial(one_head, cu_seqlens=cu)
            over_group = jax.vmap(packed, in_axes=(None, None, 1, 1, 1, 1), out_axes=(1, 1))
            over_heads = jax.vmap(over_group, in_axes=(1, 1, 1, 1, 1, 1), out_axes=(1, 1))
            out, final = over_heads(q[0], k[0], v[0], log_alpha[0], beta[0], states)
            out = out[None]
        out = out.reshape(batch, local_len, v_heads, value_dim)
        return out, final.reshape(num_states, v_heads, value_dim, key_dim)

    tokens = P(None, axis_name)
    # The states and offsets are the same on every shard.
    replicated = (initial_state,) if cu_seqlens is None else (initial_state, cu_seqlens)
    run = jax.shard_map(
        per_shard,
        mesh=mesh,
        in_specs=(tokens,) * 5 + (P(),) * len(replicated),
        out_specs=(tokens, P()),
        axis_names={axis_name},
    )
    out, final = run(q, k, v, log_alpha, beta, *replicated)
    return out.astype(out_dtype), final
