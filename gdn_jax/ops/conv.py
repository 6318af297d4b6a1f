"""Causal depthwise short convolution, with carried history for decoding."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float


def causal_depthwise_conv(
    x: Float[Array, "T D"],
    weight: Float[Array, "W D"],
    bias: Float[Array, " D"] | None = None,
    *,
    history: Float[Array, "W-1 D"] | None = None,
    same_segment: Bool[Array, "W-1 T"] | None = None,
) -> tuple[Float[Array, "T D"], Float[Array, "W-1 D"]]:
    """``y_t = bias + sum_i weight[i] * x_{t - (W-1) + i}``, one filter per channel.

    ``weight[W-1]`` multiplies the current token, as in PyTorch's ``Conv1d`` with ``W-1`` zeros
    of left padding (flash-linear-attention's ``ShortConvolution``).

    Args:
      x: ``[T, D]`` inputs.
      weight: ``[W, D]`` filters.
      bias: optional ``[D]``.
      history: the ``W-1`` inputs before ``x`` (zeros when ``None``), from a previous call.
      same_segment: for packed sequences, ``same_segment[j, t]`` says whether token
        ``t - (W-1) + j`` belongs to the same sequence as ``t``; taps that cross a sequence
        start are dropped, as if each sequence were padded on its own.

    Returns:
      ``(y [T, D], history [W-1, D])``: the new history is the last ``W-1`` inputs seen.
    """
    width, seq_len = weight.shape[0], x.shape[0]
    if history is None:
        history = jnp.zeros((width - 1, x.shape[1]), x.dtype)
    padded = jnp.concatenate([history.astype(x.dtype), x])
    y = padded[width - 1 :] * weight[width - 1][None, :]
    for i in range(width - 1):
        tap = padded[i : i + seq_len]
        if same_segment is not None:
            tap = jnp.where(same_segment[i][:, None], tap, 0)
        y = y + tap * weight[i][None, :]
    if bias is not None:
        y = y + bias[None, :]
    return y, padded[seq_len:]
