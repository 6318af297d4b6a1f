"""Trace-time argument checks shared by the ops.

Every check raises ``ValueError`` naming the offending argument and showing the shapes
or values it saw, so a bad call fails where it is made rather than deep inside a scan.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

SUPPORTED_CHUNK_SIZES = (16, 32, 64, 128)
SUPPORTED_IMPLS = ("chunked", "recurrent")
SUPPORTED_SCHEDULES = ("auto", "hoisted", "in_scan")


def check_floating(fn: str, **arrays) -> None:
    """Every named array must have a floating dtype (None entries are skipped)."""
    for name, x in arrays.items():
        if x is not None and not jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating):
            raise ValueError(f"{fn}: {name} must be a floating array, got dtype {x.dtype}")


def check_same_dtype(fn: str, **arrays) -> None:
    """q, k and v must agree in dtype: the output is returned in that dtype."""
    dtypes = {name: jnp.asarray(x).dtype for name, x in arrays.items()}
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{n}.dtype={d}" for n, d in dtypes.items())
        raise ValueError(f"{fn}: {', '.join(dtypes)} must share one dtype, got {listed}")


def check_rank(fn: str, name: str, x, rank: int, layout: str) -> None:
    if jnp.ndim(x) != rank:
        raise ValueError(f"{fn}: {name} must be {layout} (rank {rank}), got shape {jnp.shape(x)}")


def check_shape(fn: str, name: str, x, expected: tuple, layout: str) -> None:
    if tuple(jnp.shape(x)) != tuple(expected):
        raise ValueError(
            f"{fn}: {name} must have shape {layout} = {tuple(expected)}, got {jnp.shape(x)}"
        )


def check_chunk_size(fn: str, chunk_size) -> None:
    if chunk_size not in SUPPORTED_CHUNK_SIZES:
        raise ValueError(f"{fn}: chunk_size={chunk_size!r} must be one of {SUPPORTED_CHUNK_SIZES}")


def check_impl(fn: str, impl) -> None:
    if impl not in SUPPORTED_IMPLS:
        raise ValueError(f"{fn}: impl={impl!r} must be one of {SUPPORTED_IMPLS}")


def check_schedule(fn: str, schedule) -> None:
    if schedule not in SUPPORTED_SCHEDULES:
        raise ValueError(f"{fn}: schedule={schedule!r} must be one of {SUPPORTED_SCHEDULES}")


def check_single_head(fn: str, q, k, v, log_alpha, beta, initial_state) -> None:
    """Shapes of the one-head, one-sequence contract: q, k [T, K], v [T, V], gates [T]."""
    check_floating(fn, q=q, k=k, v=v, log_alpha=log_alpha, beta=beta, initial_state=initial_state)
    check_same_dtype(fn, q=q, k=k, v=v)
    check_rank(fn, "q", q, 2, "[T, K]")
    check_rank(fn, "k", k, 2, "[T, K]")
    check_rank(fn, "v", v, 2, "[T, V]")
    seq_len, key_dim = q.shape
    value_dim = v.shape[1]
    check_shape(fn, "k", k, (seq_len, key_dim), "[T, K] like q")
    check_shape(fn, "v", v, (seq_len, value_dim), "[T, V] with T of q")
    check_shape(fn, "log_alpha", log_alpha, (seq_len,), "[T]")
    check_shape(fn, "beta", beta, (seq_len,), "[T]")
    if initial_state is not None:
        check_shape(fn, "initial_state", initial_state, (value_dim, key_dim), "[V, K]")
    if seq_len < 1:
        raise ValueError(f"{fn}: need at least one token, got q.shape={q.shape}")


def check_cu_seqlens(fn: str, cu_seqlens, seq_len: int) -> None:
    """Structure always; values too when they are concrete (not traced)."""
    if jnp.ndim(cu_seqlens) != 1 or jnp.shape(cu_seqlens)[0] < 2:
        raise ValueError(
            f"{fn}: cu_seqlens must be a 1-D int array [N+1] with N >= 1, "
            f"got shape {jnp.shape(cu_seqlens)}"
        )
    if not jnp.issubdtype(jnp.asarray(cu_seqlens).dtype, jnp.integer):
        raise ValueError(f"{fn}: cu_seqlens must be integer, got dtype {cu_seqlens.dtype}")
    try:
        values = np.asarray(cu_seqlens)
    except Exception:  # a tracer: its values are checked by the caller's data pipeline
        return
    if values[0] != 0 or values[-1] != seq_len or np.any(np.diff(values) < 0):
        raise ValueError(
            f"{fn}: cu_seqlens must rise from 0 to T={seq_len} without decreasing, "
            f"got {values.tolist()}"
        )
