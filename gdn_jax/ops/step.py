"""One token of the gated delta rule (Yang, Kautz & Hatamizadeh, ICLR 2025, Eq. 10)."""

from __future__ import annotations

from typing import no_type_check

import jax.numpy as jnp
from jaxtyping import Array, Float

from gdn_jax.ops import checks


def default_scale(key_dim: int) -> float:
    """The query scale every op uses when ``scale=None``: ``K ** -0.5``, as in attention."""
    return key_dim**-0.5


def scaled_outputs(y, key_dim: int, scale: float | None, dtype):
    """The outputs ``y`` of unscaled queries, scaled and in ``dtype``: every form reads the
    state with ``q`` as given and scales after, ``S (scale q) = scale (S q)``; ``scale=None``
    means ``default_scale(key_dim)``."""
    scale = default_scale(key_dim) if scale is None else scale
    return (scale * y).astype(dtype)


def compute_dtype(*arrays) -> jnp.dtype:
    """float32, or float64 when any input array is float64: the state never drops below
    float32. Python numbers (scalar gates) are weakly typed and do not decide it."""
    if any(getattr(x, "dtype", None) == jnp.float64 for x in arrays):
        return jnp.dtype(jnp.float64)
    return jnp.dtype(jnp.float32)


def core_inputs(q, k, v, log_alpha, beta, initial_state):
    """One head's inputs as the cores take them: q, k and v as jax arrays in their own dtype
    (the cores cast them where they compute), the gates in the compute dtype, and the initial
    state (zeros when None) as a batch of one, ``[1, V, K]``. ``q`` is not scaled: the
    callers scale the outputs, ``S (scale q) = scale (S q)``."""
    key_dim, value_dim = q.shape[-1], v.shape[-1]
    compute = compute_dtype(q, log_alpha, beta, initial_state)
    if initial_state is None:
        initial_state = jnp.zeros((value_dim, key_dim), compute)
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    log_alpha, beta, initial_state = (
        jnp.asarray(x, compute) for x in (log_alpha, beta, initial_state)
    )
    return q, k, v, log_alpha, beta, initial_state[None]


def checked_single_head(
    fn, rule, q, k, v, log_alpha, beta, initial_state, *, scale, per_channel=False, **options
):
    """``rule`` behind the one-sequence checks, for the public single-head forms: ``rule(q, k,
    v, log_alpha, beta, initial_states [1, V, K], **options) -> (y, finals)`` is a core
    (recurrent or chunked); returns ``(y [T, V], final_state [V, K])`` with ``y`` scaled and
    in the dtype of ``v``. ``per_channel`` takes ``[T, K]`` gates (KDA) instead of ``[T]``."""
    checks.check_single_head(fn, q, k, v, log_alpha, beta, initial_state, per_channel=per_channel)
    checks.check_scale(fn, scale)
    y, finals = rule(*core_inputs(q, k, v, log_alpha, beta, initial_state), **options)
    return scaled_outputs(y, q.shape[-1], scale, v.dtype), finals[0]


def token_step(
    state: Float[Array, "V K"],
    q: Float[Array, " K"],
    k: Float[Array, " K"],
    v: Float[Array, " V"],
    log_alpha: Float[Array, ""] | Float[Array, " K"],
    beta: Float[Array, ""],
) -> tuple[Float[Array, "V K"], Float[Array, " V"]]:
    """The update on arrays already in the compute dtype, ``q`` already scaled.

    Decay, then correct along the key, then read with the query:
        D = alpha S;  S' = D + beta (v - D k) k^T;  y = S' q.
    The error form costs two matrix-vector products and one outer product; the factored
    form ``S (alpha (I - beta k k^T)) + beta v k^T`` would cost a matrix-matrix product.

    A gate per key channel, ``log_alpha [K]``, broadcasts along the state's rows: then
    ``D = S Diag(alpha)``, Kimi Delta Attention's decay (``kda_token.py``).
    """
    # [1, 1] for a head's gate, [1, K] for per-channel gates: either scales S's columns.
    decayed = jnp.atleast_1d(jnp.exp(log_alpha))[None, :] * state
    error = v - decayed @ k
    new_state = decayed + beta * jnp.outer(error, k)
    return new_state, new_state @ q


def linear_token_step(
    state: Float[Array, "V K"],
    q: Float[Array, " K"],
    k: Float[Array, " K"],
    v: Float[Array, " V"],
    log_alpha: Float[Array, ""],
    beta: Float[Array, ""],
) -> tuple[Float[Array, "V K"], Float[Array, " V"]]:
    """``token_step`` without the delta correction: ``S' = alpha S + beta v k^T``."""
    new_state = jnp.exp(log_alpha) * state + beta * jnp.outer(v, k)
    return new_state, new_state @ q


@no_type_check  # a public entry point: checks.py names its bad arguments
def gated_delta_step(
    state: Float[Array, "V K"],
    q: Float[Array, " K"],
    k: Float[Array, " K"],
    v: Float[Array, " V"],
    log_alpha: Float[Array, ""],
    beta: Float[Array, ""],
    *,
    scale: float | None = None,
) -> tuple[Float[Array, "V K"], Float[Array, " V"]]:
    """Advance one head's memory by one token and read it.

    ``S_t = alpha_t S_{t-1} + beta_t (v_t - alpha_t S_{t-1} k_t) k_t^T``, ``y_t = S_t (scale q_t)``
    with ``alpha_t = exp(log_alpha_t)``. This is what a decoder calls per token.

    Args:
      state: memory ``[V, K]``, one row per value feature (flash-linear-attention stores the
        transpose, ``[K, V]``).
      q, k: query and key ``[K]``.
      v: value ``[V]``; q, k and v share one dtype.
      log_alpha: scalar decay gate in log space, ``<= 0``: a 0-d floating array or a Python
        number.
      beta: scalar writing strength, already activated (in ``[0, 1]``, up to 2 with negative
        eigenvalues), as an array or a Python number like ``log_alpha``.
      scale: query scale; ``None`` means ``K ** -0.5``.

    Returns:
      ``(new_state, y)``: the state in float32 (float64 for float64 input) and ``y [V]`` in
      the dtype of ``v``.
    """
    return checked_step("gated_delta_step", state, q, k, v, log_alpha, beta, scale=scale)


def checked_step(fn, state, q, k, v, log_alpha, beta, *, scale, per_channel=False):
    """``token_step`` behind the one-token checks, for the public steps: inputs cast to the
    compute dtype, ``q`` scaled, ``y`` returned in the dtype of ``v``. ``per_channel`` takes
    a ``[K]`` gate (KDA) instead of a scalar."""
    checks.check_step(fn, state, q, k, v, log_alpha, beta, per_channel=per_channel)
    checks.check_scale(fn, scale)
    scale = default_scale(q.shape[0]) if scale is None else scale
    compute = compute_dtype(state, q, log_alpha, beta)
    new_state, y = token_step(
        state.astype(compute),
        q.astype(compute) * scale,
        k.astype(compute),
        v.astype(compute),
        jnp.asarray(log_alpha, compute),
        jnp.asarray(beta, compute),
    )
    return new_state, y.astype(v.dtype)
