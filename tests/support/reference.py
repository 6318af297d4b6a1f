"""A float64 NumPy loop written straight from the gated delta rule, and test inputs."""

import jax
import jax.numpy as jnp
import numpy as np


def gated_delta_reference(q, k, v, log_alpha, beta, *, scale, initial_state=None, delta=True):
    """S_t = a_t S_{t-1} + b_t (v_t - a_t S_{t-1} k_t) k_t^T;  y_t = S_t (scale q_t).

    With delta=False the correction is dropped: S_t = a_t S_{t-1} + b_t v_t k_t^T.
    Gates log_alpha [T, K] (KDA) decay each key channel by its own a_t[c]: a_t S is then
    S Diag(a_t), column c of S [V, K] times a_t[c].
    """
    q, k, v, log_alpha, beta = (np.asarray(x, np.float64) for x in (q, k, v, log_alpha, beta))
    seq_len, key_dim = q.shape
    state = np.zeros((v.shape[1], key_dim))
    if initial_state is not None:
        state = np.array(initial_state, np.float64)
    ys = []
    for t in range(seq_len):
        alpha = np.exp(log_alpha[t])
        decayed = alpha * state
        written = v[t] - decayed @ k[t] if delta else v[t]
        state = decayed + beta[t] * np.outer(written, k[t])
        ys.append(state @ (scale * q[t]))
    return np.stack(ys), state


def random_inputs(
    seed,
    seq_len,
    key_dim,
    value_dim,
    *,
    dtype=jnp.float32,
    lead=(),
    heads=None,
    log_alpha_range=(-1.0, 0.0),
    beta_range=(0.0, 1.0),
    unit_keys=True,
    per_channel=False,
):
    """q, k [*lead, T, (H,) K], v [*lead, T, (HV,) V], gates [*lead, T, (HV,)] as jnp arrays.

    `heads` is None for the single-head layout or (H, HV) for the batched one; with
    `per_channel` log_alpha has a trailing K axis (KDA's gates).
    """
    rng = np.random.default_rng(seed)
    qk_heads = () if heads is None else (heads[0],)
    v_heads = () if heads is None else (heads[1],)
    q = rng.standard_normal((*lead, seq_len, *qk_heads, key_dim))
    k = rng.standard_normal((*lead, seq_len, *qk_heads, key_dim))
    if unit_keys:
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((*lead, seq_len, *v_heads, value_dim))
    channels = (key_dim,) if per_channel else ()
    log_alpha = rng.uniform(*log_alpha_range, (*lead, seq_len, *v_heads, *channels))
    beta = rng.uniform(*beta_range, (*lead, seq_len, *v_heads))
    return tuple(as_array(x, dtype) for x in (q, k, v, log_alpha, beta))


def random_state(seed, *shape, dtype=jnp.float32):
    return as_array(np.random.default_rng(seed).standard_normal(shape), dtype)


def as_array(x: np.ndarray, dtype) -> jax.Array:
    """``x`` as a JAX array of ``dtype``, converted by NumPy and put on the device as it is:
    ``jnp.asarray(x, dtype)`` of a float64 array converts on the device, and ``jnp.asarray``
    of a NumPy array stages a copy, each one compiled program per shape (jax 0.10.2)."""
    return jax.device_put(np.asarray(x, jnp.dtype(dtype)))


def grouped_heads_reference(q, k, v, log_alpha, beta, *, scale, initial_state=None, delta=True):
    """``gated_delta_reference`` per value head of one sequence: q, k ``[T, H, K]``, v ``[T,
    HV, V]``, gates ``[T, HV]`` (or ``[T, HV, K]``), initial state ``[HV, V, K]`` or None;
    value head ``h`` reads key head ``h // (HV // H)``. Returns ``(y [T, HV, V], final [HV,
    V, K])``."""
    group = v.shape[1] // q.shape[1]
    heads = [
        gated_delta_reference(
            q[:, h // group],
            k[:, h // group],
            v[:, h],
            log_alpha[:, h],
            beta[:, h],
            scale=scale,
            initial_state=None if initial_state is None else initial_state[h],
            delta=delta,
        )
        for h in range(v.shape[1])
    ]
    return np.stack([y for y, _ in heads], axis=1), np.stack([s for _, s in heads])


def erase_write_reference(q, k, v, log_alpha, b, w, *, scale, initial_state=None):
    """Gated DeltaNet-2, straight from its recurrence: with ``D = S_{t-1} Diag(exp(g_t))``,
    ``S_t = D - (D (b_t * k_t)) k_t^T + (w_t * v_t) k_t^T``; ``y_t = S_t (scale q_t)``.
    Gates ``log_alpha, b [T, K]``, ``w [T, V]``."""
    q, k, v, log_alpha, b, w = (np.asarray(x, np.float64) for x in (q, k, v, log_alpha, b, w))
    state = np.zeros((v.shape[1], q.shape[1]))
    if initial_state is not None:
        state = np.array(initial_state, np.float64)
    ys = []
    for t in range(q.shape[0]):
        decayed = state * np.exp(log_alpha[t])
        state = decayed + np.outer(w[t] * v[t] - decayed @ (b[t] * k[t]), k[t])
        ys.append(state @ (scale * q[t]))
    return np.stack(ys), state


def householder_reference(q, k, v, log_alpha, beta, n, *, scale, initial_state=None):
    """Gated DeltaProduct, straight from its recurrence: per token ``t``, ``S = alpha_t S``,
    then ``n`` delta steps ``S = S + beta_j (v_j - S k_j) k_j^T`` with the token's keys
    ``k [t n + j]``, then ``y_t = S (scale q_t)``. ``log_alpha [T]`` or None."""
    q, k, v, beta = (np.asarray(x, np.float64) for x in (q, k, v, beta))
    state = np.zeros((v.shape[1], q.shape[1]))
    if initial_state is not None:
        state = np.array(initial_state, np.float64)
    ys = []
    for t in range(q.shape[0]):
        if log_alpha is not None:
            state = state * np.exp(np.float64(log_alpha[t]))
        for j in range(t * n, t * n + n):
            state = state + beta[j] * np.outer(v[j] - state @ k[j], k[j])
        ys.append(state @ (scale * q[t]))
    return np.stack(ys), state


def gla_reference(q, k, v, log_alpha, *, scale, initial_state=None):
    """Gated linear attention (GLA), straight from its recurrence: ``S_t = S_{t-1}
    Diag(exp(g_t)) + v_t k_t^T``, ``y_t = S_t (scale q_t)``, gates ``log_alpha [T, K]``."""
    q, k, v, log_alpha = (np.asarray(x, np.float64) for x in (q, k, v, log_alpha))
    state = np.zeros((v.shape[1], q.shape[1]))
    if initial_state is not None:
        state = np.array(initial_state, np.float64)
    ys = []
    for t in range(q.shape[0]):
        state = state * np.exp(log_alpha[t]) + np.outer(v[t], k[t])
        ys.append(state @ (scale * q[t]))
    return np.stack(ys), state
