"""Each hand-written backward of the staged chunked op against ``jax.vjp`` of its own forward.

Each comparison runs under one jit: one compilation per test instead of one per operation.

One chunk, float64, random cotangents: the decays (``chunk_decays_bwd``), the WY factors
(``delta_factors_bwd``, ``linear_factors_bwd``), one step of the state pass
(``state_step_bwd``), and all of them composed by ``chunk_grads`` as ``chunk_backward``
wires them, against autodiff of the one-chunk forward (``chunk_forward``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from support.reference import random_inputs, random_state
from support.tolerance import assert_close

from gdn_jax.ops.chunked.decays import LOG_ALPHA_FLOOR, ChunkDecays, chunk_decays, chunk_decays_bwd
from gdn_jax.ops.chunked.scalar import (
    chunk_backward,
    chunk_forward,
    state_step,
    state_step_bwd,
)
from gdn_jax.ops.chunked.triangular import unit_lower_inverse
from gdn_jax.ops.chunked.wy import DELTA, LINEAR

F64 = jnp.float64
SIZES = pytest.mark.parametrize(("chunk", "key_dim", "value_dim"), [(16, 8, 12), (32, 12, 8)])
RULES = pytest.mark.parametrize("rule", [DELTA, LINEAR], ids=["delta", "linear"])


def cotangent(seed, *shape):
    return random_state(seed, *shape, dtype=F64)


def check(pairs):
    for name, (actual, expected) in pairs.items():
        assert_close(actual, expected, F64, name)


@SIZES
@pytest.mark.parametrize("edges", [False, True], ids=["inside", "edges"])
def test_chunk_decays_bwd(chunk, key_dim, value_dim, edges):
    log_alpha = random_inputs(0, chunk, key_dim, value_dim, dtype=F64)[3]
    if edges:  # full resets (the last token among them) and gates that do not decay
        log_alpha = log_alpha.at[1::5].set(0.0).at[::5].set(LOG_ALPHA_FLOOR)
        log_alpha = log_alpha.at[-1].set(LOG_ALPHA_FLOOR)
    # A full matrix for `within`: chunk_decays masks what is above the diagonal.
    cts = ChunkDecays(
        cotangent(1, chunk, chunk), cotangent(2, chunk), cotangent(3, chunk), cotangent(4)
    )

    @jax.jit
    def pairs(log_alpha, cts):
        decays, pullback = jax.vjp(chunk_decays, log_alpha)
        return {"d log_alpha": (chunk_decays_bwd(decays, cts), pullback(cts)[0])}

    check(pairs(log_alpha, cts))


@SIZES
@RULES
def test_factors_bwd(chunk, key_dim, value_dim, rule):
    _, k, v, log_alpha, beta = random_inputs(1, chunk, key_dim, value_dim, dtype=F64)
    start = cotangent(5, value_dim, key_dim)
    d_corrections = cotangent(6, chunk, value_dim)

    def corrections_of(k, v, beta, decays):
        w, u, _ = rule.factors(k, v, beta, decays)
        return u if w is None else u - w @ start.T

    @jax.jit
    def pairs(k, v, beta, log_alpha, d_corrections):
        decays = chunk_decays(log_alpha)
        _, _, inverse = rule.factors(k, v, beta, decays)
        corrections, pullback = jax.vjp(corrections_of, k, v, beta, decays)
        d_k, d_v, d_beta, d_decays = pullback(d_corrections)
        grads = rule.factors_bwd(k, v, beta, decays, inverse, start, corrections, d_corrections)
        # The cotangent of k k^T is left for the caller to fold into dk (chunk_grads does).
        grads_k = grads.k if grads.gram is None else grads.k + (grads.gram + grads.gram.T) @ k
        # delta_factors reads `within` only through tril(., -1), so autodiff's cotangent is
        # zero on and above the diagonal, as is the hand-written one: the whole matrix is
        # compared.
        return {
            "dk": (grads_k, d_k),
            "dv": (grads.v, d_v),
            "dbeta": (grads.beta, d_beta),
            "d within": (grads.within, d_decays.within),
            "d from_start": (grads.from_start, d_decays.from_start),
        }, d_decays

    compared, d_decays = pairs(k, v, beta, log_alpha, d_corrections)
    check(compared)
    # FactorGrads has no fields for the decays the factors do not read.
    assert not np.any(d_decays.to_end) and not np.any(d_decays.whole)


def step_with_corrections(start, w, u, k_to_end, whole, q_from_start):
    """``state_step`` on keys and queries already decayed, returning ``U`` in both rules
    (without ``w`` it is ``u``, as in ``chunk_forward``), so that the cotangent of ``U`` from
    the outputs reaches ``u``."""
    ones = jnp.ones(u.shape[0], u.dtype)
    end, (corrections, y_start) = state_step(start, w, u, k_to_end, q_from_start, ones, ones, whole)
    return end, (u if w is None else corrections), y_start


@SIZES
@RULES
def test_state_step_bwd(chunk, key_dim, value_dim, rule):
    q, k, v, log_alpha, beta = random_inputs(2, chunk, key_dim, value_dim, dtype=F64)
    start = cotangent(7, value_dim, key_dim)
    # d_u_intra is the cotangent of U from the chunk's outputs, d_y that of Y, whose
    # state part is y_start.
    d_end, d_u_intra, d_y = (cotangent(s, *x.shape) for s, x in ((8, start), (9, v), (10, v)))

    @jax.jit
    def pairs(q, k, v, log_alpha, beta, start, d_end, d_u_intra, d_y):
        decays = chunk_decays(log_alpha)
        w, u, _ = rule.factors(k, v, beta, decays)
        k_to_end, q_from_start = k * decays.to_end[:, None], q * decays.from_start[:, None]
        primals = (start, w, u, k_to_end, decays.whole, q_from_start)
        (_, corrections, _), pullback = jax.vjp(step_with_corrections, *primals)
        d_start, d_w, d_u, d_k_to_end, d_whole, d_q_from_start = pullback((d_end, d_u_intra, d_y))
        got_start, outs = state_step_bwd(d_end, start, w, u, k, q, *decays[1:], d_u_intra, d_y)
        got_corrections, got_u, got_k_to_end, got_whole = outs
        compared = {
            "U": (got_corrections, corrections),
            "d start": (got_start, d_start),
            "dU": (got_u, d_u),
            # The products with the start state that chunk_grads and the WY backward form.
            "dY S": (d_y @ start, d_q_from_start),
            "d k_to_end": (got_k_to_end, d_k_to_end),
            "d whole": (got_whole, d_whole),
        }
        if w is not None:
            compared["dw"] = (-got_u @ start, d_w)
        return compared

    check(pairs(q, k, v, log_alpha, beta, start, d_end, d_u_intra, d_y))


@SIZES
@RULES
def test_chunk_backward(chunk, key_dim, value_dim, rule):
    q, k, v, log_alpha, beta = random_inputs(3, chunk, key_dim, value_dim, dtype=F64)
    start = cotangent(11, value_dim, key_dim)
    d_y, d_end = cotangent(12, chunk, value_dim), cotangent(13, value_dim, key_dim)

    @jax.jit
    def pairs(q, k, v, log_alpha, beta, start, d_y, d_end):
        def forward(*args):
            return chunk_forward(rule, args[-1], *args[:-1])

        _, pullback = jax.vjp(forward, q, k, v, log_alpha, beta, start)
        expected = pullback((d_end, d_y))
        d_start, grads = chunk_backward(rule, d_end, start, q, k, v, log_alpha, beta, d_y)
        d_q, d_k, d_v, d_beta, d_log_alpha = grads
        actual = (d_q, d_k, d_v, d_log_alpha, d_beta, d_start)
        names = ("dq", "dk", "dv", "d log_alpha", "dbeta", "d start")
        return {n: (a, e) for n, a, e in zip(names, actual, expected, strict=True)}

    check(pairs(q, k, v, log_alpha, beta, start, d_y, d_end))


def test_unit_lower_inverse_derivative_is_the_closed_form_in_both_modes():
    """Its custom JVP, -X dA X on the strict lower triangle, and the VJP transposed from it,
    against finite differences to second order: the chunked forms' forward and backward
    call it, so forward over reverse through them runs it forward."""
    strict = jnp.tril(cotangent(40, 16, 16), -1) / 4
    check_grads(jax.jit(unit_lower_inverse), (strict,), order=2, modes=["fwd", "rev"], eps=1e-6)
