"""Causal depthwise short convolution, with carried history for decoding, and with T split
over a mesh axis (each shard takes its halo, the tokens it needs, from the previous one)."""

from __future__ import annotations

from typing import no_type_check

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Shaped

from gdn_jax.ops import checks


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


def short_conv(weight, bias, x, history, same_segment):
    """``(silu(conv(x)) [B, T, D], history [B, W-1, D])``: ``causal_depthwise_conv`` over each
    row of ``x [B, T, D]`` from its ``history`` (zeros when None), then SiLU."""

    def one(x, history):
        return causal_depthwise_conv(x, weight, bias, history=history, same_segment=same_segment)

    y, history = jax.vmap(one)(x, history)
    return jax.nn.silu(y), history


@no_type_check  # a public entry point: checks.py names its bad arguments
def halo_from_previous(x: Shaped[Array, "T ..."], width: int, axis_name: str):
    """Inside ``jax.shard_map``, given this shard's tokens ``x [T / n, ...]``: the last
    ``width`` tokens of the previous shard along ``axis_name``, ``[width, ...]``, zeros on
    shard 0.

    This is the history a causal convolution of ``width + 1`` taps needs at the shard's
    start (``conv.causal_depthwise_conv``'s ``history``). Only ``width`` tokens travel, one
    hop to the right, so ``width`` must be at most ``T / n``. With packed sequences the
    halo may belong to an earlier sequence; ``same_segment`` drops those taps as at any
    other sequence start.
    """
    fn = "halo_from_previous"
    checks.check_arrays(fn, x=x)
    checks.check_positive_int(fn, width=width)
    if x.ndim < 1 or width > x.shape[0]:
        raise ValueError(
            f"{fn}: width={width} must be at most the tokens per shard, x.shape[0], got "
            f"x.shape={x.shape}"
        )
    try:
        size = jax.lax.axis_size(axis_name)
    except NameError:  # JAX's "unbound axis name"
        raise ValueError(
            f"{fn}: axis_name={axis_name!r} is not an axis of an enclosing jax.shard_map; call "
            "it inside one that maps that axis"
        ) from None
    to_next = [(i, i + 1) for i in range(size - 1)]
    return jax.lax.ppermute(x[x.shape[0] - width :], axis_name, to_next)


def short_convs_seq_parallel(filters, xs, same_segment, mesh, axis_name: str):
    """``short_conv`` of each ``x [B, T, D]`` of ``xs`` with its ``(weight, bias)`` of
    ``filters``, T split over ``axis_name`` of ``mesh``: each shard convolves its own tokens
    from the halo of the previous shard (zeros on the first). ``same_segment [W-1, T]`` (or
    None) as in ``causal_depthwise_conv``. Returns the outputs, each ``[B, T, D]``."""
    width = filters[0][0].shape[0]

    def per_shard(filters, xs, same_segment):
        outs = []
        for (weight, bias), x in zip(filters, xs, strict=True):
            halo = halo_from_previous(x.swapaxes(0, 1), width - 1, axis_name).swapaxes(0, 1)
            outs.append(short_conv(weight, bias, x, halo, same_segment)[0])
        return tuple(outs)

    tokens = P(None, axis_name)
    segments = None if same_segment is None else P(None, axis_name)
    run = jax.shard_map(
        per_shard,
        mesh=mesh,
        in_specs=(P(), (tokens,) * len(xs), segments),
        out_specs=(tokens,) * len(xs),
        axis_names={axis_name},
    )
    return run(tuple(filters), tuple(xs), same_segment)
