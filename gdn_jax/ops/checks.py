"""Trace-time argument checks shared by the ops, layers and models (what a layer or model
is called with, hidden states, masks, token ids, caches and keys, is ``layers/input_checks.py``'s).

Every check raises ``ValueError`` as ``"{fn}: {argument}... must ..., got ..."``, naming the
offending argument and showing the shapes or values it saw, so a bad call fails where it
is made rather than deep inside a scan.
"""

from __future__ import annotations

import math
import numbers
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np

Impl = Literal["chunked", "recurrent"]
Schedule = Literal["auto", "hoisted", "in_scan"]

SUPPORTED_CHUNK_SIZES = (16, 32, 64, 128)
SUPPORTED_IMPLS: tuple[str, ...] = get_args(Impl)
SUPPORTED_SCHEDULES: tuple[str, ...] = get_args(Schedule)


def require(fn: str, condition: bool, message: str) -> None:
    """The general rule: ``ValueError("{fn}: {message}")`` unless ``condition``; ``message``
    names the argument and its value, as the specific checks below do."""
    if not condition:
        raise ValueError(f"{fn}: {message}")


def is_python_number(x) -> bool:
    """A Python ``int`` or ``float`` (not a bool): weakly typed, it takes the dtype of the
    arrays it meets, so it counts as floating wherever a scalar is taken."""
    return type(x) in (int, float)


def is_real_number(x) -> bool:
    """A Python or NumPy real number, ``int`` or ``float`` alike (not a bool, not an array):
    what an option that takes a number accepts."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool | np.bool_)


def check_floating(fn: str, **arrays) -> None:
    """Every named array must have a floating dtype (None entries and Python numbers, see
    ``is_python_number``, are skipped)."""
    for name, x in arrays.items():
        if x is None or is_python_number(x):
            continue
        dtype = jnp.asarray(x).dtype
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"{fn}: {name} must be a floating array, got dtype {dtype}")


def check_floating_dtype(fn: str, **dtypes) -> None:
    """Each named dtype (None entries skipped) is a floating one that JAX computes in:
    parameters and activations cast to an integer dtype would be truncated, or fail inside
    Flax, and float64 without 64-bit mode (``jax_enable_x64``) would silently be float32."""
    for name, dtype in dtypes.items():
        if dtype is None:
            continue
        shown = dtype.__name__ if isinstance(dtype, type) else repr(dtype)
        try:
            floating = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
        except TypeError:
            floating = False
        if not floating:
            raise ValueError(f"{fn}: {name}={shown} must be a floating dtype")
        if jnp.dtype(dtype) == jnp.float64 and not jax.config.jax_enable_x64:
            raise ValueError(
                f"{fn}: {name}={shown} needs JAX's 64-bit mode, which is off (it would "
                "compute in float32): set JAX_ENABLE_X64=1, or call "
                "jax.config.update('jax_enable_x64', True) before anything else"
            )


def check_same_dtype(fn: str, **arrays) -> None:
    """q, k and v must agree in dtype: the output is returned in that dtype."""
    dtypes = {name: jnp.asarray(x).dtype for name, x in arrays.items()}
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{n}.dtype={d}" for n, d in dtypes.items())
        raise ValueError(f"{fn}: {', '.join(dtypes)} must share one dtype, got {listed}")


def check_rank(fn: str, name: str, x, rank: int, layout: str) -> None:
    if jnp.ndim(x) != rank:
        raise ValueError(f"{fn}: {name} must be {layout} (rank {rank}), got shape {jnp.shape(x)}")


def check_features(fn: str, name: str, x, dim: str, layout: str) -> None:
    """The last axis of ``x`` (``dim``: K or V) holds at least one feature: an empty one
    would make the default scale ``K ** -0.5`` a division by zero."""
    if jnp.shape(x)[-1] < 1:
        raise ValueError(f"{fn}: {name} must be {layout} with {dim} >= 1, got shape {x.shape}")


def check_shape(fn: str, name: str, x, expected: tuple, layout: str) -> None:
    if tuple(jnp.shape(x)) != tuple(expected):
        raise ValueError(
            f"{fn}: {name} must have shape {layout} = {tuple(expected)}, got {jnp.shape(x)}"
        )


def is_concrete(x) -> bool:
    """Whether ``x``'s values are known now (not a tracer under ``jit``, ``vmap`` or ``grad``)."""
    return not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(x))


def check_arrays(fn: str, **arrays) -> None:
    """Each named argument (None entries skipped) is an array, not a list or a scalar."""
    for name, x in arrays.items():
        if x is not None and not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise ValueError(f"{fn}: {name} must be an array, got {type(x).__name__}")


def check_positive_int(fn: str, **values) -> None:
    """Each named value is a Python or NumPy integer >= 1 (a bool is not a count)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{fn}: {name}={value!r} must be a positive integer")


def check_positive_number(fn: str, **values) -> None:
    """Each named value is a finite real number > 0 (not a bool, a string or an array).

    An array, even a 0-d one, is refused as such: under ``jit`` it is a tracer that could be
    neither checked nor used as the static option these values are. (NumPy scalars such as
    ``np.float32(0.5)`` are numbers.)"""
    for name, value in values.items():
        if hasattr(value, "shape") and not isinstance(value, numbers.Real):
            raise ValueError(
                f"{fn}: {name} must be a Python number, got an array of shape {value.shape}; "
                f"pass float({name}) outside jit"
            )
        real = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not real or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{fn}: {name}={value!r} must be a finite number > 0")


def check_lower_bound(fn: str, name: str, bound) -> None:
    """``None`` or a finite negative number, Python or NumPy: the least log-decay a bounded
    forget gate may reach per step (KDA's ``gate_lower_bound``)."""
    if bound is not None and not (is_real_number(bound) and -math.inf < bound < 0):
        raise ValueError(f"{fn}: {name}={bound!r} must be a finite negative number or None")


def check_scale(fn: str, scale) -> None:
    """``None`` (the default ``K ** -0.5``) or a finite number > 0; an array would be traced
    into the op where nothing checks it."""
    if scale is not None:
        check_positive_number(fn, scale=scale)


def forward_traced(x) -> bool:
    """Whether forward-mode autodiff (``jax.jvp``, ``jax.jacfwd``) traces ``x``: reverse
    mode traces with other tracers, and forward over reverse reaches a ``custom_vjp`` as
    reverse mode."""
    return isinstance(x, jax.interpreters.ad.JVPTracer)


def check_reverse_mode(fn: str, instead: str, **arrays) -> None:
    """No input is traced by forward-mode autodiff (``jax.jvp``, ``jax.jacfwd``): the chunked
    forms' gradient is a hand-written reverse-mode rule (a ``jax.custom_vjp``), which JAX
    cannot run forward. ``instead`` names what to use for forward mode. Reverse mode, and
    forward over reverse (``jax.hessian``), work."""
    forward = [name for name, x in arrays.items() if forward_traced(x)]
    if forward:
        raise ValueError(
            f"{fn}: forward-mode autodiff (jax.jvp, jax.jacfwd) reaches {', '.join(forward)}, "
            "but the chunked form differentiates in reverse mode only (a hand-written "
            f"custom_vjp); for forward mode use {instead} (jax.grad, jax.vjp and "
            "jax.hessian work with either)"
        )


def check_chunk_size(fn: str, chunk_size) -> int:
    """One of ``SUPPORTED_CHUNK_SIZES``, as a Python or NumPy integer (not a bool); returned
    as a Python ``int``, the static value the forms take."""
    integer = isinstance(chunk_size, numbers.Integral) and not isinstance(
        chunk_size, bool | np.bool_
    )
    if not integer or int(chunk_size) not in SUPPORTED_CHUNK_SIZES:
        raise ValueError(f"{fn}: chunk_size={chunk_size!r} must be one of {SUPPORTED_CHUNK_SIZES}")
    return int(chunk_size)


def check_impl(fn: str, impl) -> None:
    if impl not in SUPPORTED_IMPLS:
        raise ValueError(f"{fn}: impl={impl!r} must be one of {SUPPORTED_IMPLS}")


def check_schedule(fn: str, schedule) -> None:
    if schedule not in SUPPORTED_SCHEDULES:
        raise ValueError(f"{fn}: schedule={schedule!r} must be one of {SUPPORTED_SCHEDULES}")


def check_gates(fn: str, gates: dict, specs, dims: dict[str, int], key_dim: int, value_dim: int):
    """Each gate of ``specs`` (``rule.GateSpec``s) in ``gates`` (name to array) holds one
    number per position of ``dims`` (names to sizes, e.g. ``{"T": 100}``), and one per key
    or value channel where its spec says so (KDA's ``log_alpha [..., K]``)."""
    for spec in specs:
        names, shape = list(dims), tuple(dims.values())
        if spec.channels is not None:
            size = key_dim if spec.channels == "K" else value_dim
            names, shape = [*names, spec.channels], (*shape, size)
        layout = f"[{', '.join(names)}]" if names else "a scalar"
        if spec.channels is not None:
            kind = "key" if spec.channels == "K" else "value"
            layout += f" (one gate per {kind} channel)"
        check_shape(fn, spec.name, gates[spec.name], shape, layout)


def check_step(fn: str, state, q, k, v, gates: dict, specs) -> None:
    """Shapes of the one-token contract: state [V, K], q, k [K], v [V], and each gate a
    scalar (an array or a Python number), or one per key or value channel (``specs``)."""
    arrays = dict(state=state, q=q, k=k, v=v)
    per_channel = {s.name: gates[s.name] for s in specs if s.channels is not None}
    check_arrays(fn, **arrays, **per_channel)
    check_floating(fn, **arrays, **gates)
    check_same_dtype(fn, q=q, k=k, v=v)
    check_rank(fn, "q", q, 1, "[K]")
    check_rank(fn, "v", v, 1, "[V]")
    check_features(fn, "q", q, "K", "[K]")
    check_features(fn, "v", v, "V", "[V]")
    (key_dim,), (value_dim,) = q.shape, v.shape
    check_shape(fn, "k", k, (key_dim,), "[K] like q")
    check_shape(fn, "state", state, (value_dim, key_dim), "[V, K]")
    check_gates(fn, gates, specs, {}, key_dim, value_dim)


def check_single_head(fn: str, q, k, v, gates: dict, specs, initial_state) -> None:
    """Shapes of the one-head, one-sequence contract: q, k [T, K], v [T, V] and each gate
    [T], or [T, K] or [T, V] where its spec says so."""
    check_arrays(fn, q=q, k=k, v=v, **gates, initial_state=initial_state)
    check_floating(fn, q=q, k=k, v=v, **gates, initial_state=initial_state)
    check_same_dtype(fn, q=q, k=k, v=v)
    check_rank(fn, "q", q, 2, "[T, K]")
    check_rank(fn, "k", k, 2, "[T, K]")
    check_rank(fn, "v", v, 2, "[T, V]")
    check_features(fn, "q", q, "K", "[T, K]")
    check_features(fn, "v", v, "V", "[T, V]")
    seq_len, key_dim = q.shape
    value_dim = v.shape[1]
    check_shape(fn, "k", k, (seq_len, key_dim), "[T, K] like q")
    check_shape(fn, "v", v, (seq_len, value_dim), "[T, V] with T of q")
    check_gates(fn, gates, specs, {"T": seq_len}, key_dim, value_dim)
    if initial_state is not None:
        check_shape(fn, "initial_state", initial_state, (value_dim, key_dim), "[V, K]")
    if seq_len < 1:
        raise ValueError(f"{fn}: need at least one token, got q.shape={q.shape}")


def check_cu_seqlens(fn: str, cu_seqlens, seq_len: int) -> None:
    """Structure always; values too when they are concrete (not traced)."""
    check_arrays(fn, cu_seqlens=cu_seqlens)
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


def check_householder_steps(fn: str, q, k, v, log_alpha, beta, n, *, lead: int) -> None:
    """Gated DeltaProduct's layout: per token a query and a decay (``log_alpha`` may be
    None), per step (``n`` a token) a key, a value and a ``beta``. ``lead`` is 1 for the
    batched layout (``q [B, T, H, K]``, ``k [B, T n, H, K]``, ``v [B, T n, HV, V]``,
    ``log_alpha [B, T, HV]``, ``beta [B, T n, HV]``) and 0 for one head (the same without
    ``B`` and the head axes). The rest is the gated delta rule's, checked by its op."""
    check_positive_int(fn, num_householder=n)
    check_arrays(fn, q=q, k=k, v=v, log_alpha=log_alpha, beta=beta)
    rank = 2 + 2 * lead
    q_layout, k_layout, v_layout = (
        ("[B, T, H, K]", "[B, T n, H, K]", "[B, T n, HV, V]")
        if lead
        else ("[T, K]", "[T n, K]", "[T n, V]")
    )
    check_rank(fn, "q", q, rank, q_layout)
    steps = (*q.shape[:lead], q.shape[lead] * n)
    wanted = {"k": (k, k_layout, (*steps, *q.shape[lead + 1 :])), "v": (v, v_layout, steps)}
    for name, (x, layout, leading) in wanted.items():
        check_rank(fn, name, x, rank, layout)
        if tuple(x.shape[: len(leading)]) != leading:
            shape = leading if name == "k" else (*steps, "...")
            raise ValueError(
                f"{fn}: {name} must have shape {layout} with n = num_householder = {n} steps "
                f"a token = {shape}, got {tuple(x.shape)}"
            )
    heads = v.shape[lead + 1 :][:1] if lead else ()
    per_token = (*q.shape[: lead + 1], *heads)
    per_step = (*steps, *heads)
    if log_alpha is not None and tuple(log_alpha.shape) != per_token:
        layout = "[B, T, HV]" if lead else "[T]"
        raise ValueError(
            f"{fn}: log_alpha must have shape {layout} (one decay a token) = {per_token}, "
            f"got {tuple(log_alpha.shape)}"
        )
    if tuple(beta.shape) != per_step:
        layout = "[B, T n, HV]" if lead else "[T n]"
        raise ValueError(
            f"{fn}: beta must have shape {layout} (one a step, n = {n}) = {per_step}, "
            f"got {tuple(beta.shape)}"
        )


def check_batched(fn: str, q, k, v, gates: dict, specs, initial_state, cu_seqlens) -> None:
    """The batched, multi-head contract: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]`` with HV a
    multiple of H, each gate ``[B, T, HV]`` (``[B, T, HV, K]`` or ``[B, T, HV, V]`` where its
    spec says so), ``initial_state [B, HV, V, K]`` (``[N, HV, V, K]`` with packed
    ``cu_seqlens``, which need ``B == 1``)."""
    arrays = dict(q=q, k=k, v=v, **gates, initial_state=initial_state)
    check_arrays(fn, **arrays)
    check_floating(fn, **arrays)
    check_same_dtype(fn, q=q, k=k, v=v)
    check_rank(fn, "q", q, 4, "[B, T, H, K]")
    check_rank(fn, "v", v, 4, "[B, T, HV, V]")
    check_features(fn, "q", q, "K", "[B, T, H, K]")
    check_features(fn, "v", v, "V", "[B, T, HV, V]")
    batch, seq_len, heads, key_dim = q.shape
    v_heads, value_dim = v.shape[2], v.shape[3]
    check_shape(fn, "k", k, q.shape, "[B, T, H, K] like q")
    check_shape(fn, "v", v, (batch, seq_len, v_heads, value_dim), "[B, T, HV, V]")
    gate_dims = {"B": batch, "T": seq_len, "HV": v_heads}
    check_gates(fn, gates, specs, gate_dims, key_dim, value_dim)
    require(
        fn,
        heads >= 1 and v_heads % heads == 0,
        f"value heads HV={v_heads} (v.shape={v.shape}) must be a multiple of query/key heads "
        f"H={heads} (q.shape={q.shape})",
    )
    require(fn, seq_len >= 1, f"need at least one token, got q.shape={q.shape}")
    num_states = batch
    if cu_seqlens is not None:
        require(
            fn,
            batch == 1,
            f"cu_seqlens packs sequences along T and needs B == 1, got q.shape={q.shape}",
        )
        check_cu_seqlens(fn, cu_seqlens, seq_len)
        num_states = cu_seqlens.shape[0] - 1
    if initial_state is not None:
        layout = "[N, HV, V, K]" if cu_seqlens is not None else "[B, HV, V, K]"
        expected = (num_states, v_heads, value_dim, key_dim)
        check_shape(fn, "initial_state", initial_state, expected, layout)
