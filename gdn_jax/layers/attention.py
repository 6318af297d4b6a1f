"""Causal softmax attention with rotary embeddings: the recall ceiling that the recurrent
mixers are compared against. A thin module around ``gdn_jax.ops.attention``, optionally with
the recurrent mixers' short convolutions on q, k and v."""

from __future__ import annotations

import functools
from typing import NamedTuple, no_type_check

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from gdn_jax.layers import input_checks
from gdn_jax.layers.conv import ShortConvolution, convolve_qkv
from gdn_jax.layers.params import COLUMNS, ROWS, bias_free_linear, check_build_args
from gdn_jax.ops import checks
from gdn_jax.ops.attention import causal_attention, rotary
from gdn_jax.ops.chunked.varlen import segment_positions


class KVCache(NamedTuple):
    """Keys and values of the tokens seen so far, in ``L = max_len`` slots (a pytree).

    Attributes:
      k, v: ``[B, S, H, K]``, ``S`` slots of head dim ``K``.
      valid: ``[B, S]``, whether a slot holds a real (not padded, already written) token.
      positions: ``[B, S]`` token positions of the slots, for the causal and window masks.
      length: slots written so far (the same for every row: prompts are left-padded).
      next_position: ``[B]`` position of each row's next token (its count of real tokens).
      conv: with short convolutions, the last ``conv_size - 1`` inputs of the q, k and v
        convolutions, each ``[B, W-1, H*K]``; otherwise None.
    """

    k: Float[Array, "B S H K"]
    v: Float[Array, "B S H K"]
    valid: Bool[Array, "B S"]
    positions: Int[Array, "B S"]
    length: Int[Array, ""]
    next_position: Int[Array, " B"]
    conv: tuple[Array, Array, Array] | None = None


@no_type_check  # checks.py names bad arguments and inputs
class SoftmaxAttention(nnx.Module):
    """Multi-head causal softmax attention, bias-free projections, RoPE on q and k, an
    optional sliding ``window`` (a token sees itself and the ``window - 1`` before it).

    With ``use_short_conv`` the projected q, k and v first pass the causal depthwise
    convolution with SiLU that the recurrent mixers have (kernel ``conv_size``): it hands each
    token its predecessors' features, which attention alone must learn to fetch with a
    previous-token head (see docs/benchmarks.md for what that costs on MQAR).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        *,
        window: int | None = None,
        rope_theta: float = 10000.0,
        use_short_conv: bool = False,
        conv_size: int = 4,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        kernel_init=None,
        rngs: nnx.Rngs,
    ):
        name = "SoftmaxAttention"
        checks.check_positive_int(
            name,
            hidden_size=hidden_size,
            num_heads=num_heads,
            head_dim=head_dim,
            conv_size=conv_size,
        )
        checks.check_flag(name, use_short_conv=use_short_conv)
        checks.require(name, head_dim % 2 == 0, f"head_dim={head_dim} must be even for RoPE")
        if window is not None:
            checks.check_positive_int(name, window=window)
        checks.check_positive_number(name, rope_theta=rope_theta)
        checks.check_floating_dtype(name, dtype=dtype, param_dtype=param_dtype)
        check_build_args(name, rngs=rngs, kernel_init=kernel_init)
        linear = bias_free_linear(
            dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs
        )
        inner = num_heads * head_dim
        self.q_proj = linear(hidden_size, inner, COLUMNS)
        self.k_proj = linear(hidden_size, inner, COLUMNS)
        self.v_proj = linear(hidden_size, inner, COLUMNS)
        self.o_proj = linear(inner, hidden_size, ROWS)
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.window, self.rope_theta, self.conv_size = window, rope_theta, conv_size
        convs = None
        if use_short_conv:
            convs = nnx.List(
                [
                    ShortConvolution(
                        inner, conv_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs
                    )
                    for _ in range(3)
                ]
            )
        self.convs = convs  # q, k, v

    def _check(self, x, mask):
        input_checks.check_hidden("SoftmaxAttention", x, self.hidden_size)
        if mask is not None:
            input_checks.check_mask("SoftmaxAttention", mask, *x.shape[:2])

    def _qkv(self, x, positions, *, mask=None, cu_seqlens=None, conv_history=None):
        """Projected, convolved (with short convolutions) and rotated q, k, v ``[B, T, H, K]``,
        and the convolutions' new history (None without them)."""
        batch, seq_len, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if mask is not None:
            # Padded tokens are selected away, so they enter the convolution as zeros and their
            # values meet the softmax's zero weights as zeros: 0 * NaN would be NaN.
            real = mask.astype(bool)[..., None]
            q, k, v = (jnp.where(real, z, 0) for z in (q, k, v))
        if self.convs is not None:
            (q, k, v), conv_history = convolve_qkv(
                tuple(self.convs), (q, k, v), histories=conv_history, cu_seqlens=cu_seqlens
            )
        shape = (batch, seq_len, self.num_heads, self.head_dim)
        q, k, v = q.reshape(shape), k.reshape(shape), v.reshape(shape)
        turn = jax.vmap(functools.partial(rotary, theta=self.rope_theta))
        return turn(q, positions), turn(k, positions), v, conv_history

    def _attend(self, q, k, v, **masks):
        out = jax.vmap(functools.partial(causal_attention, window=self.window))(q, k, v, **masks)
        return self.o_proj(out.reshape(*out.shape[:2], -1))

    def __call__(self, x, *, mask=None, cu_seqlens=None):
        """``x [B, T, D]`` with an optional ``[B, T]`` padding mask or packed ``cu_seqlens``
        (positions restart and attention stops at each sequence start)."""
        self._check(x, mask)
        cu_seqlens = input_checks.check_packed("SoftmaxAttention", cu_seqlens, x)
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
        q, k, v, _ = self._qkv(x, positions, mask=mask, cu_seqlens=cu_seqlens)
        return self._attend(
            q,
            k,
            v,
            q_positions=positions,
            k_positions=positions,
            k_valid=valid,
            q_segments=segments,
            k_segments=segments,
        )

    def init_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """An empty cache of ``max_len`` slots: prompt plus generated tokens must fit
        (``None`` is not a bound attention can use)."""
        checks.check_positive_int("SoftmaxAttention", batch_size=batch_size, max_len=max_len)
        shape = (batch_size, max_len, self.num_heads, self.head_dim)
        return KVCache(
            k=jnp.zeros(shape, self.q_proj.dtype),
            v=jnp.zeros(shape, self.q_proj.dtype),
            valid=jnp.zeros((batch_size, max_len), bool),
            positions=jnp.zeros((batch_size, max_len), jnp.int32),
            length=jnp.zeros((), jnp.int32),
            next_position=jnp.zeros((batch_size,), jnp.int32),
            conv=None
            if self.convs is None
            else tuple(
                jnp.zeros((batch_size, self.conv_size - 1, shape[2] * shape[3]), self.q_proj.dtype)
                for _ in range(3)
            ),
        )

    def prefill(self, x, cache=None, *, mask=None):
        """Append ``x [B, T, D]`` (left-padded with ``mask``) to ``cache`` and attend over
        everything cached; returns ``(y, cache)``. ``None`` is a cache that holds just this
        prompt, with no room to step on. The cache must have room: an overflow is an error
        when its length is known (eager decoding), and ``generate`` sizes it."""
        self._check(x, mask)
        if mask is not None:  # each row decodes on from its last token
            input_checks.check_left_padding("SoftmaxAttention", mask)
        batch, seq_len, _ = x.shape
        if cache is None:
            cache = self.init_cache(batch, seq_len)
        else:
            # Any number of slots S is the cache's own choice; everything else is the layer's.
            k_shape = np.shape(getattr(cache, "k", None))
            slots = k_shape[1] if len(k_shape) == 4 and k_shape[1] >= 1 else 1
            empty = jax.eval_shape(lambda: self.init_cache(batch, slots))
            input_checks.check_cache("SoftmaxAttention", cache, empty)
        max_len = cache.k.shape[1]
        filled = int(cache.length) if checks.is_concrete(cache.length) else 0
        checks.require(
            "SoftmaxAttention",
            filled + seq_len <= max_len,
            f"{seq_len} more token(s) do not fit a cache of max_len={max_len} holding {filled}; "
            f"make it with init_cache(batch, max_len >= {filled + seq_len})",
        )
        real = jnp.ones((batch, seq_len), bool) if mask is None else mask.astype(bool)
        positions = cache.next_position[:, None] + jnp.cumsum(real, axis=1, dtype=jnp.int32) - 1
        q, k, v, conv = self._qkv(x, positions, mask=mask, conv_history=cache.conv)
        zero = jnp.zeros((), jnp.int32)
        at = (zero, cache.length, zero, zero)
        cache = KVCache(
            k=jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), at),
            v=jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), at),
            valid=jax.lax.dynamic_update_slice(cache.valid, real, at[:2]),
            positions=jax.lax.dynamic_update_slice(cache.positions, positions, at[:2]),
            length=cache.length + seq_len,
            next_position=cache.next_position + jnp.sum(real, axis=1, dtype=jnp.int32),
            conv=conv,
        )
        y = self._attend(
            q,
            cache.k,
            cache.v,
            q_positions=positions,
            k_positions=cache.positions,
            k_valid=cache.valid,
        )
        return y, cache

    def step(self, x, cache):
        """One token per row, ``x [B, 1, D]``."""
        return self.prefill(x, cache)
