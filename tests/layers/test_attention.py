"""Softmax attention and rotary embedding against float64 NumPy loops written from the
definitions: the attention baseline is the recall ceiling, so it gets its own reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.tolerance import assert_close

from gdn_jax.ops.attention import causal_attention, rotary


def rotary_reference(x, positions, theta):
    """Feature pair (i, i + D/2) as the complex number x_i + i x_{i+D/2}, turned by
    position * theta^(-2i/D)."""
    half = x.shape[-1] // 2
    z = x[..., :half] + 1j * x[..., half:]
    angles = positions[:, None, None] * theta ** (-np.arange(half) / half)
    turned = z * np.exp(1j * angles)
    return np.concatenate([turned.real, turned.imag], -1)


def attention_reference(q, k, v, q_pos, k_pos, k_valid, q_seg, k_seg, window):
    """One query at a time: softmax over the keys it may see, zeros when it sees none."""
    out = np.zeros((q.shape[0], q.shape[1], v.shape[-1]))
    for t in range(q.shape[0]):
        for h in range(q.shape[1]):
            seen = [
                s
                for s in range(k.shape[0])
                if k_valid[s]
                and k_pos[s] <= q_pos[t]
                and (window is None or q_pos[t] - k_pos[s] < window)
                and q_seg[t] == k_seg[s]
            ]
            if not seen:
                continue
            logits = np.array([q[t, h] @ k[s, h] for s in seen]) / np.sqrt(q.shape[-1])
            weights = np.exp(logits - logits.max())
            out[t, h] = (weights / weights.sum()) @ v[seen, h]
    return out


@pytest.mark.parametrize("theta", [10000.0, 100.0])
def test_rotary_matches_complex_rotation(theta):
    x = np.random.default_rng(0).normal(size=(9, 3, 8))
    positions = np.arange(9) * 3
    actual = rotary(jnp.asarray(x, jnp.float32), jnp.asarray(positions), theta=theta)
    assert_close(actual, rotary_reference(x, positions, theta), jnp.float32)


def test_rotary_logits_depend_on_relative_position_only():
    rng = np.random.default_rng(1)
    q, k = (jnp.asarray(rng.normal(size=(1, 1, 16)), jnp.float32) for _ in range(2))

    def logit(i, j):
        qi = rotary(q, jnp.array([i]))
        kj = rotary(k, jnp.array([j]))
        return float(jnp.sum(qi * kj))

    assert_close(logit(7, 3), logit(104, 100), jnp.float32)


@pytest.mark.parametrize("window", [None, 1, 5])
@pytest.mark.parametrize("packed", [False, True])
def test_causal_attention_matches_reference(window, packed):
    rng = np.random.default_rng(2)
    seq_len, heads, dim = 17, 2, 6
    q, k, v = (rng.normal(size=(seq_len, heads, dim)) for _ in range(3))
    positions = np.arange(seq_len)
    segments = np.zeros(seq_len, int)
    if packed:  # three sequences; positions restart at each
        segments = np.repeat([0, 1, 2], [5, 8, 4])
        positions = np.concatenate([np.arange(5), np.arange(8), np.arange(4)])
    valid = rng.random(seq_len) > 0.2
    valid[0] = False  # query 0 then sees no key at all: zeros, not NaN
    actual = causal_attention(
        *(jnp.asarray(a, jnp.float32) for a in (q, k, v)),
        q_positions=jnp.asarray(positions),
        k_positions=jnp.asarray(positions),
        k_valid=jnp.asarray(valid),
        q_segments=jnp.asarray(segments),
        k_segments=jnp.asarray(segments),
        window=window,
    )
    expected = attention_reference(q, k, v, positions, positions, valid, segments, segments, window)
    assert np.all(np.isfinite(np.asarray(actual)))
    assert_close(actual, expected, jnp.float32)


def test_causal_attention_gradients_match_a_dense_float64_formula():
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.normal(size=(6, 1, 4))) for _ in range(3))
    positions = jnp.arange(6)

    def attend(q, k, v):
        return causal_attention(
            q, k, v, q_positions=positions, k_positions=positions, k_valid=jnp.ones(6, bool)
        )

    # float64 inputs: the op computes in float32 and returns the input dtype, so compare
    # its float32-accurate gradient with a float64 reference of the same function.
    def loss(q, k, v):
        return jnp.sum(attend(q, k, v) ** 2)

    def loss64(q, k, v):
        logits = jnp.einsum("thd,shd->hts", q, k) / 2.0
        logits = jnp.where(jnp.tril(jnp.ones((6, 6), bool))[None], logits, -1e30)
        out = jnp.einsum("hts,shd->thd", jax.nn.softmax(logits, -1), v)
        return jnp.sum(out**2)

    grads = [jax.jit(jax.grad(f, (0, 1, 2)))(q, k, v) for f in (loss, loss64)]  # 2 compiles, not 81
    for actual, expected in zip(*grads, strict=True):
        assert_close(actual, expected, jnp.float32)
