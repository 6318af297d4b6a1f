"""What every public form of one head and one sequence does around its core: the checks, the
inputs in the compute dtype, and the outputs scaled and cast back."""

from __future__ import annotations

from typing import no_type_check

import jax.numpy as jnp

from gdn_jax.ops import checks
from gdn_jax.ops.forward_mode import reverse_mode_only
from gdn_jax.ops.recurrent import rule_recurrent


@no_type_check  # a public entry point: checks.py names its bad arguments
def default_scale(key_dim: int) -> float:
    """The query scale every op uses when ``scale=None``: ``K ** -0.5``, as in attention;
    ``key_dim`` is a positive integer."""
    checks.check_positive_int("default_scale", key_dim=key_dim)
    return key_dim**-0.5


def scaled_outputs(y, key_dim: int, scale: float | None, dtype):
    """The outputs ``y`` of unscaled queries, scaled and in ``dtype``: every form reads the
    state with ``q`` as given and scales after, ``S (scale q) = scale (S q)``; ``scale=None``
    means ``default_scale(key_dim)``."""
    scale = default_scale(key_dim) if scale is None else scale
    return (scale * y).astype(dtype)


def compute_dtype(*arrays) -> jnp.dtype:
    """float32, or float64 when any input array is float64: the state never drops below
    float32. Python numbers (scalar gates) are weakly typed and do not decide it."""
    if any(getattr(x, "dtype", None) == jnp.float64 for x in arrays):
        return jnp.dtype(jnp.float64)
    return jnp.dtype(jnp.float32)


def core_inputs(q, k, v, gates: tuple, initial_state):
    """One head's inputs as the cores take them: q, k, v and the gates as jax arrays in their
    own dtype (the cores cast them where they compute), and the initial state (zeros when
    None) in the compute dtype as a batch of one, ``[1, V, K]``. ``q`` is not scaled: the
    callers scale the outputs, ``S (scale q) = scale (S q)``."""
    key_dim, value_dim = q.shape[-1], v.shape[-1]
    compute = compute_dtype(q, *gates, initial_state)
    if initial_state is None:
        initial_state = jnp.zeros((value_dim, key_dim), compute)
    q, k, v, *gates = (jnp.asarray(x) for x in (q, k, v, *gates))
    return q, k, v, tuple(gates), jnp.asarray(initial_state, compute)[None]


def checked_single_head(
    fn, rule, core, q, k, v, gates: tuple, initial_state, *, scale, rule_options, **options
):
    """``core`` behind the one-sequence checks of ``rule``'s gates, for the public
    single-head forms: ``core(q, k, v, gates, initial_states [1, V, K], **options) -> (y,
    finals)`` is a one-head form (recurrent or chunked), ``rule_options`` the public form's
    own (``Rule.steps``); returns ``(y [T, V], final_state [V, K])`` with ``y`` scaled and in
    the dtype of ``v``."""
    steps = checks.check_steps(fn, rule, rule_options)
    named = dict(zip(rule.gate_names, gates, strict=True))
    sizes = checks.check_single_head(fn, rule, q, k, v, named, initial_state, steps)
    checks.check_scale(fn, scale)
    gates = rule.with_defaults(gates, "one_head", sizes)
    y, finals = core(*core_inputs(q, k, v, gates, initial_state), **options)
    return scaled_outputs(y, q.shape[-1], scale, v.dtype), finals[0]


def recurrent_single_head(fn, rule, q, k, v, gates: tuple, initial_state, *, scale, **rule_options):
    """``rule``'s token step scanned over one sequence (``recurrent.recurrent_rule``), for
    its public ``*_recurrent`` form."""
    core = rule_recurrent(rule)
    return checked_single_head(
        fn, rule, core, q, k, v, gates, initial_state, scale=scale, rule_options=rule_options
    )


def chunked_single_head(
    fn, rule, q, k, v, gates: tuple, initial_state, *, scale, chunk_size, schedule, recurrent,
    **rule_options,
):  # fmt: skip
    """``rule``'s chunked form over one sequence, for its public ``*_chunked`` form;
    ``recurrent`` names the form to use for forward-mode autodiff instead."""
    chunk_size = checks.check_chunk_size(fn, chunk_size)
    checks.check_schedule(fn, schedule)
    if not rule.forward_mode:
        q, k, v, gates, initial_state = reverse_mode_only(
            fn, recurrent, rule.gate_names, q, k, v, gates, initial_state
        )
    return checked_single_head(
        fn, rule, rule.chunked, q, k, v, gates, initial_state, scale=scale,
        rule_options=rule_options, chunk_size=chunk_size, schedule=schedule,
    )  # fmt: skip
