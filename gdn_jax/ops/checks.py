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

from gdn_jax.ops.rule import LOG_DECAY, STEPS, Form, GateSpec, Rule, shape_of

# "auto", the forms every rule has, and the kernels some rules have (``Rule.kernels``).
Impl = Literal["auto", "chunked", "recurrent", "mosaic_gpu"]
Schedule = Literal["auto", "hoisted", "associative", "in_scan"]

SUPPORTED_CHUNK_SIZES = (16, 32, 64, 128)
SUPPORTED_IMPLS: tuple[str, ...] = get_args(Impl)
KERNEL_IMPLS: tuple[str, ...] = ("mosaic_gpu",)
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
    """Every named array must have a floating dtype that JAX computes in (``check_x64``);
    None entries and Python numbers (see ``is_python_number``) are skipped."""
    for name, x in arrays.items():
        if x is None or is_python_number(x):
            continue
        # The array's own dtype: jnp.asarray would already have turned float64 into float32.
        dtype = x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"{fn}: {name} must be a floating array, got dtype {dtype}")
        check_x64(fn, f"{name} of dtype {dtype}", dtype, cast=name)


def check_x64(fn: str, shown: str, dtype, *, cast: str | None = None) -> None:
    """float64 (``shown`` names the argument that has it) only where JAX's 64-bit mode
    (``jax_enable_x64``) is on: without it JAX turns float64 into float32 as it goes, so the
    work would silently be done in float32. The ops, the layers and their dtypes all refuse
    it here, with one message; ``cast`` names the array that could be cast instead."""
    if jnp.dtype(dtype) != jnp.float64 or jax.config.jax_enable_x64:
        return
    fix = (
        "set JAX_ENABLE_X64=1, or call jax.config.update('jax_enable_x64', True) before "
        "anything else"
    )
    if cast is not None:
        fix += f", or cast {cast} to float32"
    raise ValueError(
        f"{fn}: {shown} needs JAX's 64-bit mode, which is off (it would compute in float32): " + fix
    )


def check_floating_dtype(fn: str, **dtypes) -> None:
    """Each named dtype (None entries skipped) is a floating one that JAX computes in:
    parameters and activations cast to an integer dtype would be truncated, or fail inside
    Flax, and float64 needs 64-bit mode (``check_x64``)."""
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
        check_x64(fn, f"{name}={shown}", dtype)


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


def check_flag(fn: str, **flags) -> None:
    """Each named option is a Python or NumPy bool. Anything else would be taken by its
    truthiness (the string ``"no"`` is true), and an array, traced under ``jit`` or not, is
    refused as such: the flag chooses what is traced, so it must be known while tracing."""
    for name, value in flags.items():
        if isinstance(value, bool | np.bool_):
            continue
        if hasattr(value, "shape") and hasattr(value, "dtype"):
            raise ValueError(
                f"{fn}: {name} must be a Python bool, known while tracing, got an array of "
                f"shape {value.shape} and dtype {value.dtype} (a jit argument is one unless "
                f"static): make it static (static_argnames) or pass bool({name}) outside jit"
            )
        raise ValueError(f"{fn}: {name}={value!r} must be a Python bool (True or False)")


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
    """Whether forward-mode autodiff (``jax.jvp``, ``jax.jacfwd``) traces ``x`` itself:
    reverse mode traces with other tracers, and forward over reverse reaches a
    ``custom_vjp`` as reverse mode. A trace-time test: under ``jax.jit``, ``nnx.jit`` or
    ``jax.linearize`` the program is differentiated after it was traced, with no such
    tracer (the ops refuse forward mode on every route: ``forward_mode.py``)."""
    return isinstance(x, jax.interpreters.ad.JVPTracer)


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


def check_steps(fn: str, rule: Rule, options: dict) -> int:
    """The steps a token takes under the public form's ``options`` (``Rule.steps``): 1 for a
    rule of one step a token, else the option's value, a positive integer."""
    if rule.steps is None:
        return 1
    check_positive_int(fn, **{rule.steps: options[rule.steps]})
    return int(options[rule.steps])


def layout_shown(rule: Rule, spec: GateSpec, form: Form, steps: int) -> str:
    """How the errors show ``spec``'s layout in ``form``: its axes (``Rule.layout``) and,
    where it helps, what they mean: k is ``like q``; a gate per channel says so; with
    several steps a token, whether the argument is one a step or one a token."""
    axes = rule.layout(spec, form)
    shown = f"[{', '.join(axes)}]" if axes else "a scalar"
    if spec.name == "k" and not spec.per_step:
        shown += " like q"
    elif spec.channels is not None and spec.name not in ("q", "k", "v"):
        kind = "key" if spec.channels == "K" else "value"
        shown += f" (one gate per {kind} channel)"
    if rule.steps is not None and spec.per_step:
        shown += f" with n = {rule.steps} = {steps} steps a token"
    elif rule.steps is not None and spec.name != "q":
        shown += " (one a token)"
    return shown


def check_layouts(fn: str, rule: Rule, form: Form, arrays: dict, sizes: dict) -> None:
    """Each of q, k, v and the gates in ``arrays`` has the shape of its layout in ``form``
    (``Rule.layout``) for ``sizes`` (the legend's letters); a gate with a default may be
    None."""
    for spec in rule.arguments:
        x = arrays[spec.name]
        if x is None and spec.default is not None:
            continue
        expected = shape_of(rule.layout(spec, form), sizes)
        check_shape(fn, spec.name, x, expected, layout_shown(rule, spec, form, sizes[STEPS]))


def check_qv(fn: str, rule: Rule, form: Form, q, v, steps: int) -> None:
    """Ranks of q and v and their feature axes, from which the other sizes are read."""
    for spec in rule.arguments[0], rule.arguments[2]:
        x = q if spec.name == "q" else v
        axes = rule.layout(spec, form)
        check_rank(fn, spec.name, x, len(axes), layout_shown(rule, spec, form, steps))
        check_features(fn, spec.name, x, axes[-1], f"[{', '.join(axes)}]")


def check_inputs(fn: str, rule: Rule, form: Form, arrays: dict) -> None:
    """Arrays (a gate that is one number in ``form`` may be a Python number) of floating
    dtypes, q, k and v of one."""
    scalars = {spec.name for spec in rule.gates if not rule.layout(spec, form)}
    check_arrays(fn, **{name: x for name, x in arrays.items() if name not in scalars})
    check_floating(fn, **arrays)
    check_same_dtype(fn, q=arrays["q"], k=arrays["k"], v=arrays["v"])
    check_log_decay(fn, arrays.get(LOG_DECAY))


def check_log_decay(fn: str, log_alpha) -> None:
    """``log_alpha <= 0`` where its values are concrete (above 0 the state grows every token
    and the outputs turn to NaN); a tracer's, or an array's spread over several hosts, this
    process cannot read."""
    if log_alpha is None or isinstance(log_alpha, jax.core.Tracer):
        return
    if not getattr(log_alpha, "is_fully_addressable", True):
        return
    values = np.asarray(log_alpha, np.float64)
    if (values > 0).any():
        at = tuple(int(i) for i in np.argwhere(values > 0)[0])
        raise ValueError(
            f"{fn}: log_alpha must be <= 0 (decays in log space), got {values[at]:g} at index "
            f"{at} (largest {np.nanmax(values):g}, shape {values.shape})"
        )


def check_step(fn: str, rule: Rule, state, q, k, v, gates: dict, steps: int = 1) -> dict:
    """Shapes of the one-token contract: state [V, K], q [K], k [K] and v [V] (``[n, K]`` and
    ``[n, V]`` with ``n`` steps a token), and each gate a scalar (an array or a Python
    number), or one per key or value channel, or per step, as its spec says. Returns the
    sizes of the legend's letters, for ``Rule.with_defaults``."""
    check_inputs(fn, rule, "step", dict(state=state, q=q, k=k, v=v, **gates))
    check_qv(fn, rule, "step", q, v, steps)
    sizes = {"K": q.shape[-1], "V": v.shape[-1], STEPS: steps}
    check_shape(fn, "state", state, (sizes["V"], sizes["K"]), "[V, K]")
    check_layouts(fn, rule, "step", dict(q=q, k=k, v=v, **gates), sizes)
    return sizes


def check_single_head(fn: str, rule: Rule, q, k, v, gates: dict, initial_state, steps=1) -> dict:
    """Shapes of the one-head, one-sequence contract: q [T, K], k [T, K], v [T, V] and each
    gate [T], or [T, K] or [T, V] where its spec says so (``T n`` long where it is per step).
    Returns the sizes of the legend's letters."""
    check_inputs(fn, rule, "one_head", dict(q=q, k=k, v=v, **gates, initial_state=initial_state))
    check_qv(fn, rule, "one_head", q, v, steps)
    (seq_len, key_dim), value_dim = q.shape, v.shape[-1]
    sizes = {"T": seq_len, "K": key_dim, "V": value_dim, STEPS: steps}
    check_layouts(fn, rule, "one_head", dict(q=q, k=k, v=v, **gates), sizes)
    if initial_state is not None:
        check_shape(fn, "initial_state", initial_state, (value_dim, key_dim), "[V, K]")
    if seq_len < 1:
        raise ValueError(f"{fn}: need at least one token, got q.shape={q.shape}")
    return sizes


def as_cu_seqlens(fn: str, cu_seqlens):
    """``cu_seqlens`` as the forms take it: None, an array as it is, or an array-like (a
    list or tuple of ints) as a JAX array, which the forms' ``.astype`` and ``.shape``
    need; ``check_cu_seqlens`` checks what comes out."""
    if cu_seqlens is None or (hasattr(cu_seqlens, "shape") and hasattr(cu_seqlens, "dtype")):
        return cu_seqlens
    try:
        return jnp.asarray(cu_seqlens)
    except (TypeError, ValueError):
        raise ValueError(
            f"{fn}: cu_seqlens must be a 1-D int array [N+1] (or a list of ints), got "
            f"{cu_seqlens!r}"
        ) from None


def check_cu_seqlens(fn: str, cu_seqlens, name: str, shape: tuple) -> None:
    """Offsets ``cu_seqlens`` (``as_cu_seqlens``) of sequences packed along T of the input
    ``name`` of ``shape`` ``[B, T, ...]``, which must then have ``B == 1``: their structure
    always, their values too when they are concrete (not traced). ``name`` is what the
    caller was given (a layer's ``x``, an op's ``q``), so the error shows the caller's view."""
    check_arrays(fn, cu_seqlens=cu_seqlens)
    batch, seq_len = shape[:2]
    if batch != 1:
        raise ValueError(
            f"{fn}: cu_seqlens packs sequences along T and needs B == 1, got {name}.shape={shape}"
        )
    if jnp.ndim(cu_seqlens) != 1 or jnp.shape(cu_seqlens)[0] < 2:
        raise ValueError(
            f"{fn}: cu_seqlens must be a 1-D int array [N+1] with N >= 1, "
            f"got shape {jnp.shape(cu_seqlens)}"
        )
    if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
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


def check_batched(
    fn: str, rule: Rule, q, k, v, gates: dict, initial_state, cu_seqlens, steps: int = 1
) -> dict:
    """The batched, multi-head contract: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]`` with HV a
    multiple of H, each gate ``[B, T, HV]`` (``[B, T, HV, K]`` or ``[B, T, HV, V]`` where its
    spec says so; ``T n`` long for what is per step), ``initial_state [B, HV, V, K]``
    (``[N, HV, V, K]`` with packed ``cu_seqlens``, which need ``B == 1``). Returns the sizes
    of the legend's letters."""
    arrays = dict(q=q, k=k, v=v, **gates, initial_state=initial_state)
    check_inputs(fn, rule, "batched", arrays)
    check_qv(fn, rule, "batched", q, v, steps)
    batch, seq_len, heads, key_dim = q.shape
    v_heads, value_dim = v.shape[2], v.shape[3]
    sizes = dict(B=batch, T=seq_len, H=heads, HV=v_heads, K=key_dim, V=value_dim)
    sizes[STEPS] = steps  # the letter of Rule.layout, as check_step and check_single_head key it
    check_layouts(fn, rule, "batched", dict(q=q, k=k, v=v, **gates), sizes)
    require(
        fn,
        heads >= 1 and v_heads % heads == 0,
        f"value heads HV={v_heads} (v.shape={v.shape}) must be a multiple of query/key heads "
        f"H={heads} (q.shape={q.shape})",
    )
    require(fn, seq_len >= 1, f"need at least one token, got q.shape={q.shape}")
    num_states = batch
    if cu_seqlens is not None:
        check_cu_seqlens(fn, cu_seqlens, "q", q.shape)
        num_states = cu_seqlens.shape[0] - 1
    if initial_state is not None:
        layout = "[N, HV, V, K]" if cu_seqlens is not None else "[B, HV, V, K]"
        expected = (num_states, v_heads, value_dim, key_dim)
        check_shape(fn, "initial_state", initial_state, expected, layout)
    return sizes
