"""The one place that chooses how a rule runs: its form (``impl``: the token recurrence, the
chunked form, or one of the rule's kernels) and where the chunked form does each chunk's own
work (``schedule``).

``"auto"`` resolves both for the platform the program is compiled for, not the host that
traces it. The schedules by ``jax.lax.platform_dependent``, which keeps the lowered
platform's branch. A kernel is a field of its rule (``Rule.kernels``): compiled for its own
platform it runs as a kernel, for any other in Pallas's interpret mode, and ``"auto"``
takes it only for its platform; these two are decided when the program is traced, by
``compiled_for`` (an interpreted kernel's callbacks are effects, which a
``platform_dependent`` branch without them cannot stand beside).
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


def check_kernel(fn: str, rule: Rule, impl, q, v, compute, chunk_size: int) -> None:
    """An explicit kernel that cannot take these inputs is a ``ValueError`` saying why
    (``Kernel.refuses``), before any work."""
    kernel = kernel_of(rule, impl)
    if kernel is None:
        return
    reason = kernel.refuses(q.shape[-1], v.shape[-1], v.dtype, compute, chunk_size)
    if reason is not None:
        raise ValueError(f"{fn}: impl={impl!r} {reason}; use impl='auto' or 'chunked'")


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


def compiled_for() -> str:
    """The platform the program being traced is compiled for, as tracing can tell: the
    device of the abstract mesh in context (``gpu_compile`` traces under one of the GPU it
    compiles for; ``jax.sharding.use_abstract_mesh``), else this process's first device.
    ``"cuda"`` for an NVIDIA GPU, else the device's platform (``"cpu"``, ``"tpu"``, ...)."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    device = device if device is not None else jax.devices()[0]
    if device.platform == "gpu":
        return "cuda" if "NVIDIA" in device.device_kind else "rocm"
    return device.platform


def run_batched(
    rule: Rule, impl, inputs: tuple, cu_seqlens, *, chunk_size: int, schedule, over_batch: Callable
):
    """``rule`` by ``impl`` over ``api.prepare_batched``'s ``inputs`` (q, k, v, gates,
    initial states): ``(o, finals)``. ``over_batch(one_head, *inputs, cu_seqlens)`` maps a
    one-head form over batch and heads (``api.over_batch_and_heads``)."""
    if impl == "auto":
        q, v, initial_states = inputs[0], inputs[2], inputs[4]
        dims = (q.shape[-1], v.shape[-1], v.dtype, initial_states.dtype, chunk_size)
        platform = compiled_for()
        takes = (k for k in rule.kernels if k.auto and k.platform == platform)
        impl = next((k.impl for k in takes if k.refuses(*dims) is None), "chunked")
    if impl in ("recurrent", "chunked"):
        one_head = one_head_form(rule, impl, chunk_size=chunk_size, schedule=schedule)
        return over_batch(one_head, *inputs, cu_seqlens)
    kernel = kernel_of(rule, impl)
    interpret = compiled_for() != kernel.platform
    return kernel.run(*inputs, cu_seqlens, chunk_size=chunk_size, interpret=interpret)


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
