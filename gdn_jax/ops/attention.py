"""Causal softmax attention with rotary position embedding: the baseline mixer's math."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def rotary(
    x: Float[Array, "T H K"], positions: Int[Array, " T"], *, theta: float = 10000.0
) -> Float[Array, "T H K"]:
    """Rotary position embedding (Su et al., 2021), halves convention: feature ``i`` pairs with
    ``i + K/2`` and turns by ``position * theta^(-2i/K)``. Computed in float32."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None, None] * freqs[None, None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def causal_attention(
    q: Float[Array, "T H K"],
    k: Float[Array, "S H K"],
    v: Float[Array, "S H K"],
    *,
    q_positions: Int[Array, " T"],
    k_positions: Int[Array, " S"],
    k_valid: Bool[Array, " S"],
    q_segments: Int[Array, " T"] | None = None,
    k_segments: Int[Array, " S"] | None = None,
    window: int | None = None,
) -> Float[Array, "T H K"]:
    """Softmax attention where query ``t`` sees key ``s`` iff ``k_valid[s]``,
    ``k_positions[s] <= q_positions[t]``, the two share a segment (packed sequences) and, with
    ``window``, ``q_positions[t] - k_positions[s] < window``.

    Logits and softmax are float32; masked logits are set to a large negative finite value
    before ``exp``, and a query that sees no key returns zeros rather than NaN.
    """
    scale = q.shape[-1] ** -0.5
    logits = jnp.einsum("thd,shd->hts", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    delta = q_positions[:, None] - k_positions[None, :]
    visible = (delta >= 0) & k_valid[None, :]
    if window is not None:
        visible &= delta < window
    if q_segments is not None:
        visible &= q_segments[:, None] == k_segments[None, :]
    logits = jnp.where(visible[None], logits, jnp.finfo(jnp.float32).min)
    weights = jnp.where(visible[None], jax.nn.softmax(logits, axis=-1), 0.0)
    return jnp.einsum("hts,shd->thd", weights, v.astype(jnp.float32)).astype(v.dtype)
