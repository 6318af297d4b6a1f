"""Causal softmax attention with rotary embeddings: the recall ceiling that the recurrent
mixers are compared against. A thin module around ``gdn_jax.ops.attention``."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from gdn_jax.ops.attention import causal_attention, rotary
from gdn_jax.ops.varlen import segment_positions


class KVCache(NamedTuple):
    """Keys and values of the tokens seen so far, in ``L = max_len`` slots (a pytree).

    Attributes:
      k, v: ``[B, L, H, D]``.
      valid: ``[B, L]``, whether a slot holds a real (not padded, already written) token.
      positions: ``[B, L]`` token positions of the slots, for the causal and window masks.
      length: slots written so far (the same for every row: prompts are left-padded).
      next_position: ``[B]`` position of each row's next token (its count of real tokens).
    """

    k: Float[Array, "B L H D"]
    v: Float[Array, "B L H D"]
    valid: Bool[Array, "B L"]
    positions: Int[Array, "B L"]
    length: Int[Array, ""]
    next_position: Int[Array, " B"]


class SoftmaxAttention(nnx.Module):
    """Multi-head causal softmax attention, bias-free projections, RoPE on q and k, an
    optional sliding ``window`` (a token sees itself and the ``window - 1`` before it)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        *,
        window: int | None = None,
        rope_theta: float = 10000.0,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        kernel_init=None,
        rngs: nnx.Rngs,
    ):
        if head_dim % 2:
            raise ValueError(f"SoftmaxAttention: head_dim={head_dim} must be even for RoPE")
        if window is not None and window < 1:
            raise ValueError(f"SoftmaxAttention: window={window} must be >= 1 or None")
        if kernel_init is None:
            kernel_init = nnx.initializers.lecun_normal()
        linear = functools.partial(
            nnx.Linear, use_bias=False, dtype=dtype, param_dtype=param_dtype,
            kernel_init=kernel_init, rngs=rngs,
        )  # fmt: skip
        inner = num_heads * head_dim
        self.q_proj, self.k_proj = linear(hidden_size, inner), linear(hidden_size, inner)
        self.v_proj, self.o_proj = linear(hidden_size, inner), linear(inner, hidden_size)
        self.num_heads, self.head_dim = num_heads, head_dim
        self.window, self.rope_theta = window, rope_theta

    def _qkv(self, x, positions):
        batch, seq_len, _ = x.shape
        shape = (batch, seq_len, self.num_heads, self.head_dim)
        q, k, v = (p(x).reshape(shape) for p in (self.q_proj, self.k_proj, self.v_proj))
        turn = jax.vmap(functools.partial(rotary, theta=self.rope_theta))
        return turn(q, positions), turn(k, positions), v

    def _attend(self, q, k, v, **masks):
        out = jax.vmap(functools.partial(causal_attention, window=self.window))(q, k, v, **masks)
        return self.o_proj(out.reshape(*out.shape[:2], -1))

    def __call__(self, x, *, mask=None, cu_seqlens=None):
        """``x [B, T, D]`` with an optional ``[B, T]`` padding mask or packed ``cu_seqlens``
        (positions restart and attention stops at each sequence start)."""
        batch, seq_len, _ = x.shape
        segments = None
        if cu_seqlens is not None:
            segments, positions = segment_positions(cu_seqlens, seq_len)
            segments, positions = segments[None], positions[None]
        elif mask is not None:
            positions = jnp.cumsum(mask, axis=1, dtype=jnp.int32) - 1
        else:
            positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
        valid = jnp.ones((batch, seq_len), bool) if mask is None else mask.astype(bool)
        q, k, v = self._qkv(x, positions)
        return self._attend(
            q, k, v, q_positions=positions, k_positions=positions, k_valid=valid,
            q_segments=segments, k_segments=segments,
        )  # fmt: skip

    def init_cache(self, batch_size: int, max_len: int) -> KVCache:
        shape = (batch_size, max_len, self.num_heads, self.head_dim)
        return KVCache(
            k=jnp.zeros(shape, self.q_proj.dtype),
            v=jnp.zeros(shape, self.q_proj.dtype),
            valid=jnp.zeros((batch_size, max_len), bool),
            positions=jnp.zeros((batch_size, max_len), jnp.int32),
            length=jnp.zeros((), jnp.int32),
            next_position=jnp.zeros((batch_size,), jnp.int32),
        )

    def prefill(self, x, cache, *, mask=None):
        """Append ``x [B, T, D]`` (left-padded with ``mask``) to ``cache`` and attend over
        everything cached; returns ``(y, cache)``."""
        batch, seq_len, _ = x.shape
        real = jnp.ones((batch, seq_len), bool) if mask is None else mask.astype(bool)
        positions = cache.next_position[:, None] + jnp.cumsum(real, axis=1, dtype=jnp.int32) - 1
        q, k, v = self._qkv(x, positions)
        zero = jnp.zeros((), jnp.int32)
        at = (zero, cache.length, zero, zero)
        cache = KVCache(
            k=jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), at),
            v=jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), at),
            valid=jax.lax.dynamic_update_slice(cache.valid, real, at[:2]),
            positions=jax.lax.dynamic_update_slice(cache.positions, positions, at[:2]),
            length=cache.length + seq_len,
            next_position=cache.next_position + jnp.sum(real, axis=1, dtype=jnp.int32),
        )
        y = self._attend(
            q, cache.k, cache.v, q_positions=positions, k_positions=cache.positions,
            k_valid=cache.valid,
        )  # fmt: skip
        return y, cache

    def step(self, x, cache):
        """One token per row, ``x [B, 1, D]``."""
        return self.prefill(x, cache)
