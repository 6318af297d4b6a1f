"""One token of each rule of the family (Yang, Kautz & Hatamizadeh, ICLR 2025, Eq. 10, and its
relatives): the steps the recurrent forms scan and a decoder calls.

Decay, then correct along the key, then read with the query. On arrays already in the
compute dtype; a gate per key channel (``[K]``) broadcasts along the state's rows, scaling
its columns: ``S Diag(alpha)``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

from gdn_jax.ops import checks
from gdn_jax.ops.single_head import compute_dtype, default_scale

Gate = Float[Array, ""] | Float[Array, " K"] | Float[Array, " V"]


def decay(state: Float[Array, "V K"], log_alpha: Float[Array, ""] | Float[Array, " K"]):
    """``alpha S`` for one gate per head, ``S Diag(alpha)`` for one per key channel."""
    return jnp.atleast_1d(jnp.exp(log_alpha))[None, :] * state


def delta_step(
    state: Float[Array, "V K"],
    q: Float[Array, " K"],
    k: Float[Array, " K"],
    v: Float[Array, " V"],
    log_alpha: Float[Array, ""] | Float[Array, " K"],
    beta: Float[Array, ""],
) -> tuple[Float[Array, "V K"], Float[Array, " V"]]:
    """The gated delta rule (per-channel ``log_alpha``: KDA):
        D = alpha S;  S' = D + beta (v - D k) k^T;  y = S' q.
    The error form costs two matrix-vector products and one outer product; the factored
    form ``S (alpha (I - beta k k^T)) + beta v k^T`` would cost a matrix-matrix product."""
    decayed = decay(state, log_alpha)
    new_state = decayed + beta * jnp.outer(v - decayed @ k, k)
    return new_state, new_state @ q


def linear_step(
    state: Float[Array, "V K"],
    q: Float[Array, " K"],
    k: Float[Array, " K"],
    v: Float[Array, " V"],
    log_alpha: Float[Array, ""],
    beta: Float[Array, ""],
) -> tuple[Float[Array, "V K"], Float[Array, " V"]]:
    """``delta_step`` without the delta correction: ``S' = alpha S + beta v k^T``."""
    new_state = decay(state, log_alpha) + beta * jnp.outer(v, k)
    return new_state, new_state @ q


def gla_step(
    state: Float[Array, "V K"],
    q: Float[Array, " K"],
    k: Float[Array, " K"],
    v: Float[Array, " V"],
    log_alpha: Float[Array, " K"],
) -> tuple[Float[Array, "V K"], Float[Array, " V"]]:
    """Gated linear attention (GLA): each key channel decays by its own gate, nothing is
    erased and the value is written as it is, ``S' = S Diag(alpha) + v k^T``, ``y = S' q``."""
    new_state = decay(state, log_alpha) + jnp.outer(v, k)
    return new_state, new_state @ q


def erase_write_step(
    state: Float[Array, "V K"],
    q: Float[Array, " K"],
    k: Float[Array, " K"],
    v: Float[Array, " V"],
    log_alpha: Float[Array, " K"],
    b: Float[Array, " K"],
    w: Float[Array, " V"],
) -> tuple[Float[Array, "V K"], Float[Array, " V"]]:
    """Gated DeltaNet-2: an erase gate ``b`` on the key axis and a write gate ``w`` on the
    value axis, ``D = S Diag(alpha)``, ``S' = D - (D (b * k)) k^T + (w * v) k^T``, ``y = S'
    q``; ``b = w = beta`` is ``delta_step``."""
    decayed = decay(state, log_alpha)
    new_state = decayed + jnp.outer(w * v - decayed @ (b * k), k)
    return new_state, new_state @ q


def householder_step(
    state: Float[Array, "V K"],
    q: Float[Array, " K"],
    k: Float[Array, "n K"],
    v: Float[Array, "n V"],
    log_alpha: Float[Array, ""],
    beta: Float[Array, " n"],
) -> tuple[Float[Array, "V K"], Float[Array, " V"]]:
    """Gated DeltaProduct: the token's decay once, then its ``n`` delta steps, ``S = S +
    beta_j (v_j - S k_j) k_j^T`` (a product of generalised Householder transitions), then
    the read ``y = S q``; ``n = 1`` is ``delta_step``."""
    state = decay(state, log_alpha)
    for j in range(k.shape[0]):
        state = state + beta[j] * jnp.outer(v[j] - state @ k[j], k[j])
    return state, state @ q


def checked_step(fn, rule, state, q, k, v, gates: tuple, *, scale, **rule_options):
    """``rule.step`` behind the one-token checks of ``rule``'s gates, for the public steps:
    inputs cast to the compute dtype, ``q`` scaled, ``y`` returned in the dtype of ``v``;
    ``rule_options`` are the public step's own (``Rule.steps``)."""
    steps = checks.check_steps(fn, rule, rule_options)
    named = dict(zip(rule.gate_names, gates, strict=True))
    sizes = checks.check_step(fn, rule, state, q, k, v, named, steps)
    checks.check_scale(fn, scale)
    gates = rule.with_defaults(gates, "step", sizes)
    scale = default_scale(q.shape[0]) if scale is None else scale
    compute = compute_dtype(state, q, *gates)
    new_state, y = rule.step(
        state.astype(compute),
        q.astype(compute) * scale,
        k.astype(compute),
        v.astype(compute),
        *(jnp.asarray(x, compute) for x in gates),
    )
    return new_state, y.astype(v.dtype)
