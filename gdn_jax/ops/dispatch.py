"""The one place that chooses how a rule runs: its form (``impl``: the token recurrence, the
chunked form, or one of the rule's kernels) and where the chunked form does each chunk's own
work (``schedule``).

``"auto"`` resolves both for the platform the program is lowered for, not the host that
traces it (``jax.lax.platform_dependent``: traced on a CPU and compiled for a GPU, it is the
GPU's choice). A kernel is a field of its rule (``Rule.kernels``); lowered for its own
platform it is compiled, for any other it runs in Pallas's interpret mode.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from gdn_jax.ops import checks
from gdn_jax.ops.recurrent import rule_recurrent
from gdn_jax.ops.rule import Kernel, Rule

# What schedule="auto" means on each platform the program is lowered for
# (``jax.lax.platform_dependent`` keys): in the scan on CPU, where it measured faster; the
# associative scan over chunks on NVIDIA GPUs, where a loop over chunks launched some 1,700
# kernels a forward+backward against some 260 (both in docs/benchmarks.md); hoisted on TPU
# and anything else.
AUTO_SCHEDULES = {"cpu": "in_scan", "cuda": "associative", "default": "hoisted"}


def kernel_of(rule: Rule, impl) -> Kernel | None:
    """``rule``'s kernel named ``impl``, or None (a form every rule has, or no such kernel)."""
    return next((kernel for kernel in rule.kernels if kernel.impl == impl), None)


def check_impl(fn: str, rule: Rule, impl) -> None:
    """``impl`` must be ``"auto"``, a form every rule has, or one of ``rule``'s kernels.

    Called where an op, a layer or a model is built, so that a rule without the kernel asked
    for is refused there, not at its first call."""
    checks.check_impl(fn, impl)
    if impl in checks.KERNEL_IMPLS and kernel_of(rule, impl) is None:
        has = ", ".join(k.impl for k in rule.kernels) or "none"
        raise ValueError(
            f"{fn}: impl={impl!r} is a kernel {rule.name} does not have (its kernels: {has});"
            " use impl='auto' or 'chunked'"
        )


def splits_sequence(impl) -> bool:
    """Whether ``impl`` runs under sequence parallelism, whose shards each run the chunked
    form: ``"chunked"``, and ``"auto"``, which then takes it."""
    return impl in ("auto", "chunked")


def one_head_form(rule: Rule, impl, *, chunk_size: int, schedule: checks.Schedule):
    """``rule``'s form of one head, ``(q, k, v, gates, initial_states, *, cu_seqlens) -> (y,
    finals)``: its token step scanned (``"recurrent"``), or its chunked form with
    ``chunk_size`` and ``schedule`` (``"chunked"``)."""
    match impl:
        case "recurrent":
            return rule_recurrent(rule)
        case "chunked":
            return functools.partial(rule.chunked, chunk_size=chunk_size, schedule=schedule)
    raise ValueError(f"{rule.name}: impl={impl!r} has no one-head form")


def run_batched(
    rule: Rule, impl, inputs: tuple, cu_seqlens, *, chunk_size: int, schedule, over_batch: Callable
):
    """``rule`` by ``impl`` over ``api.prepare_batched``'s ``inputs`` (q, k, v, gates,
    initial states): ``(o, finals)``. ``over_batch(one_head, *inputs, cu_seqlens)`` maps a
    one-head form over batch and heads (``api.over_batch_and_heads``)."""

    def by_form(form, *args):
        one_head = one_head_form(rule, form, chunk_size=chunk_size, schedule=schedule)
        return over_batch(one_head, *args, cu_seqlens)

    def by_kernel(kernel, *args):
        return run_kernel(kernel, args, cu_seqlens, chunk_size=chunk_size)

    if impl in ("recurrent", "chunked"):
        return by_form(impl, *inputs)
    if impl != "auto":
        return by_kernel(kernel_of(rule, impl), *inputs)
    chosen = {k.platform: functools.partial(by_kernel, k) for k in rule.kernels if k.auto}
    if not chosen:
        return by_form("chunked", *inputs)
    return jax.lax.platform_dependent(
        *inputs, **chosen, default=functools.partial(by_form, "chunked")
    )


def run_kernel(kernel: Kernel, inputs: tuple, cu_seqlens, *, chunk_size: int):
    """``kernel`` on ``inputs``: compiled where the program is lowered for its platform,
    in Pallas's interpret mode anywhere else. Both are traced; a lowering keeps its own."""

    def run(interpret, *args):
        return kernel.run(*args, cu_seqlens, chunk_size=chunk_size, interpret=interpret)

    branches = {kernel.platform: functools.partial(run, False)}
    return jax.lax.platform_dependent(*inputs, **branches, default=functools.partial(run, True))


def run_schedule(schedules: dict[str, Callable], schedule: checks.Schedule, *args):
    """``schedules[schedule](*args)``, with ``"auto"`` resolved by the platform the program
    is lowered for (``AUTO_SCHEDULES``): traced on a CPU and compiled for a TPU, it is
    ``"hoisted"``.

    A schedule's forward and backward sit whole inside its branch of
    ``jax.lax.platform_dependent``, so both follow one choice. Both branches are traced; a
    lowering for one platform keeps only that platform's.
    """
    if schedule != "auto":
        return schedules[schedule](*args)
    branches = {platform: schedules[choice] for platform, choice in AUTO_SCHEDULES.items()}
    return jax.lax.platform_dependent(*args, **branches)
