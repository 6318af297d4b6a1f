"""What one program of the Pallas kernels (``chunked_pallas.py``) does to one chunk of one
head, on register tiles: ``chunked.py``'s stages, term for term, written for Pallas.

Register tiles take no dynamic indexing, so a row or an entry is picked by a masked sum
(``pick``), and the inverse of the intra-chunk system is formed by forward substitution, one
row per step, rather than by ``triangular.py``'s doubling of blocks. Products accumulate in
the compute dtype, their operands at the ``precision`` the kernel passes (``products``); the
decays' segment sums always at full precision. Shapes: ``C`` tokens, ``K`` key and ``V``
value channels (a block of them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

EXACT = jax.lax.Precision.HIGHEST


def products(precision):
    """``(mm, mm_t, t_mm)``: ``a @ b``, ``a @ b^T`` and ``a^T @ b`` with operands at
    ``precision`` (a ``jax.lax.Precision`` or ``DotAlgorithmPreset``), accumulated in ``a``'s
    dtype (the compute dtype)."""

    def product(a, b, contract):
        dims = (contract, ((), ()))
        return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=a.dtype)

    return (
        lambda a, b: product(a, b, ((1,), (0,))),
        lambda a, b: product(a, b, ((1,), (1,))),
        lambda a, b: product(a, b, ((0,), (0,))),
    )


mm, _, _ = products(EXACT)  # the decays' segment sums


def pick(x, axis: int, index):
    """``x``'s slice ``index`` along ``axis`` of a ``[C, C]`` tile, or the entry of a ``[C]``
    vector, as a masked sum."""
    idx = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
    return jnp.sum(jnp.where(idx == index, x, 0), axis=axis)


def causal_masks(chunk: int):
    """``(rows, cols)`` index tiles ``[C, C]``."""
    shape = (chunk, chunk)
    return jax.lax.broadcasted_iota(jnp.int32, shape, 0), jax.lax.broadcasted_iota(
        jnp.int32, shape, 1
    )


def chunk_decays(log_alpha):
    """``(within [C, C], from_start [C], to_end [C], whole)`` of one chunk, each ``exp`` of a
    sum of the gates over its own segment only (``decays.chunk_decays``: sums of a segment's
    own terms, not differences of running sums, which a -1e4 reset would round away)."""
    t, i = causal_masks(log_alpha.shape[0])
    lower = jnp.where(t >= i, 1, 0).astype(log_alpha.dtype)
    masked = jnp.where(t > i, log_alpha[:, None], 0)
    seg = mm(lower, masked)  # seg[t, i] = sum(log_alpha[i+1 : t+1]) for t >= i
    from_start = pick(seg, 1, 0) + pick(log_alpha, 0, 0)
    within = jnp.where(t >= i, jnp.exp(jnp.where(t >= i, seg, 0)), 0)
    to_end = jnp.exp(pick(seg, 0, log_alpha.shape[0] - 1))
    whole = jnp.exp(pick(from_start, 0, log_alpha.shape[0] - 1))
    return within, jnp.exp(from_start), to_end, whole


def chunk_decays_bwd(decays, d_within, d_from_start, d_to_end, d_whole):
    """``decays.chunk_decays_bwd``: the gradient of ``log_alpha [C]`` from the cotangents of
    every decay, each a sum over the segments that hold the gate and no other."""
    within, from_start, to_end, whole = decays
    t, s = causal_masks(from_start.shape[0])
    before = jnp.where(t < s, 1, 0).astype(within.dtype)  # [i, s] (and [t, s]): i < s
    rows_before = mm(d_within * within, before)  # [t, s]: the sum over i < s
    held = jnp.where(t < s, 0, rows_before + (d_from_start * from_start)[:, None])
    to_end_part = jnp.sum((d_to_end * to_end)[:, None] * before, 0)
    return jnp.sum(held, 0) + to_end_part + d_whole * whole


def unit_lower_inverse(strict):
    """``(I + strict)^{-1}`` by forward substitution, one row per step: row ``i`` of the
    inverse is ``e_i - strict[i, :i] X[:i]``, from rows already final."""
    rows, cols = causal_masks(strict.shape[0])
    eye = jnp.where(rows == cols, 1, 0).astype(strict.dtype)

    def row(i, inverse):
        a = pick(strict, 0, i)  # strict[i, :], zero from column i on
        new = pick(eye, 0, i) - jnp.sum(a[:, None] * inverse, 0)
        return jnp.where(rows == i, new[None, :], inverse)

    return jax.lax.fori_loop(1, strict.shape[0], row, eye)


def stage_one(k, v, log_alpha, beta, precision):
    """The decays, ``k k^T`` and ``T = (I + strict)^{-1}`` with the WY factors ``w = T
    diag(beta exp(g)) K``, ``u = T diag(beta) V`` (``wy.delta_factors``)."""
    mm, mm_t, _ = products(precision)
    rows, cols = causal_masks(k.shape[0])
    decays = chunk_decays(log_alpha)
    within, from_start = decays[:2]
    gram = mm_t(k, k)
    strict = jnp.where(rows > cols, beta[:, None] * gram * within, 0)
    inverse = unit_lower_inverse(strict)
    w = mm(inverse, k * (beta * from_start)[:, None])
    u = mm(inverse, v * beta[:, None])
    return decays, gram, inverse, w, u


def forward(state, q, k, v, log_alpha, beta, *, precision=EXACT):
    """One chunk: ``(S [V, K], q, k [C, K], v [C, V], gates [C]) -> (S', y [C, V])``."""
    mm, mm_t, t_mm = products(precision)
    decays, _, _, w, u = stage_one(k, v, log_alpha, beta, precision)
    within, from_start, to_end, whole = decays
    corrections = u - mm_t(w, state)  # U = u - w S^T
    y = mm_t(q * from_start[:, None], state) + mm(mm_t(q, k) * within, corrections)
    new_state = whole * state + t_mm(corrections, k * to_end[:, None])
    return new_state, y


def backward(d_end, start, q, k, v, log_alpha, beta, d_y, *, precision=EXACT):
    """The pullback of ``forward`` given the chunk's start state (``chunked.chunk_backward``):
    ``(dS', S, inputs, dy) -> (dS, (dq, dk, dv, d log_alpha, d beta))``."""
    mm, mm_t, t_mm = products(precision)
    rows, cols = causal_masks(q.shape[0])
    decays, gram, inverse, w, u = stage_one(k, v, log_alpha, beta, precision)
    within, from_start, to_end, whole = decays
    qk = mm_t(q, k)
    corrections = u - mm_t(w, start)
    # The reverse state pass (chunked.state_pass_bwd).
    d_u = t_mm(qk * within, d_y) + mm_t(k * to_end[:, None], d_end)
    d_start = whole * d_end + t_mm(d_y, q * from_start[:, None]) - t_mm(d_u, w)
    d_k_to_end = mm(corrections, d_end)
    # The chunk's gradients (chunked.chunk_grads and wy.delta_factors_bwd).
    d_y_u = mm_t(d_y, corrections)
    d_y_start = mm(d_y, start)
    d_write = t_mm(inverse, d_u)
    d_erase = -mm(d_write, start)
    d_strict = -jnp.where(rows > cols, mm_t(d_write, corrections), 0)
    d_k_proj = jnp.sum(d_erase * k, 1)
    d_gram = d_strict * within * beta[:, None]
    d_q = d_y_start * from_start[:, None] + mm(d_y_u * within, k)
    d_k = (
        t_mm(d_y_u * within, q)
        + d_k_to_end * to_end[:, None]
        + d_erase * (beta * from_start)[:, None]
        + mm(d_gram, k)
        + t_mm(d_gram, k)
    )
    d_beta = jnp.sum(d_write * v, 1) + from_start * d_k_proj + jnp.sum(d_strict * within * gram, 1)
    d_log_alpha = chunk_decays_bwd(
        decays,
        d_y_u * qk + d_strict * beta[:, None] * gram,
        jnp.sum(d_y_start * q, 1) + beta * d_k_proj,
        jnp.sum(d_k_to_end * k, 1),
        jnp.sum(d_end * start),
    )
    return d_start, (d_q, d_k, d_write * beta[:, None], d_log_alpha, d_beta)
