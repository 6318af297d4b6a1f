"""The feed-forward half of a block."""

from __future__ import annotations

import jax
from flax import nnx

from gdn_jax.layers.params import COLUMNS, ROWS, bias_free_linear, check_build_args
from gdn_jax.ops import checks


class SwiGLU(nnx.Module):
    """``down(silu(gate(x)) * up(x))`` (Shazeer, 2020), bias-free."""

    def __init__(self, hidden_size, intermediate_size, *, dtype, param_dtype, kernel_init, rngs):
        checks.check_positive_int(
            "SwiGLU", hidden_size=hidden_size, intermediate_size=intermediate_size
        )
        check_build_args("SwiGLU", rngs=rngs, kernel_init=kernel_init)
        linear = bias_free_linear(
            dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs
        )
        # Megatron's split over the model axis: the inner width by columns, then by rows.
        self.gate_proj = linear(hidden_size, intermediate_size, COLUMNS)
        self.up_proj = linear(hidden_size, intermediate_size, COLUMNS)
        self.down_proj = linear(intermediate_size, hidden_size, ROWS)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
