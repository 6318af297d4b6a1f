"""The one place that chooses how a rule runs: its form (``impl``: the token recurrence, the
chunked form, or one of the rule's kernels), whether a kernel runs compiled or interpreted,
and whether a kernel can take the inputs at all, before any work.

``impl="auto"`` is the chunked form: no kernel is taken until a GPU has timed it faster
(docs/benchmarks.md); its schedule ``"auto"`` resolves by the platform lowered for
(``chunked/schedules.py``). A kernel is a field of its rule (``Rule.kernels``): lowered for
its own platform it runs compiled, for any other in Pallas's interpret mode
(``kernel_interpret``). Its limits (``Kernel.refusals``) are checked here, forward and
backward alike, and named in one message with the calling op's name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from gdn_jax.ops import checks
from gdn_jax.ops.recurrent import rule_recurrent
from gdn_jax.ops.rule import Kernel, KernelInputs, Rule


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


def check_kernel(fn: str, rule: Rule, impl, q, k, v, compute, chunk_size: int, cu_seqlens) -> None:
    """An explicit kernel that cannot take these inputs is a ``ValueError`` naming every
    reason (``Kernel.refusals``: the forward's limits and the backward's), before any work.
    ``k`` counts the tokens (a token's steps included), ``cu_seqlens`` the sequences."""
    kernel = kernel_of(rule, impl)
    if kernel is None:
        return
    reasons = kernel.refuses(kernel_inputs(q, k, v, compute, chunk_size, cu_seqlens))
    if reasons:
        raise ValueError(
            f"{fn}: impl={impl!r} cannot take these inputs: {'; '.join(reasons)}; use "
            "impl='chunked'"
        )


def kernel_inputs(q, k, v, compute, chunk_size: int, cu_seqlens) -> KernelInputs:
    """What a kernel's limits read from the batched inputs: the tokens as laid out in whole
    chunks per sequence (at most), the value heads, the channels and the dtypes."""
    batch, tokens = k.shape[:2]
    if cu_seqlens is None:
        laid_out = batch * -(-tokens // chunk_size) * chunk_size
    else:
        laid_out = tokens + (cu_seqlens.shape[0] - 1) * chunk_size
    return KernelInputs(
        q.shape[-1], v.shape[-1], v.dtype, compute, chunk_size, laid_out, v.shape[2]
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


def platform_of(device) -> str:
    """``"cuda"`` for an NVIDIA GPU, ``"rocm"`` for another GPU, else the device's platform
    (``"cpu"``, ``"tpu"``, ...)."""
    if device.platform == "gpu":
        return "cuda" if "NVIDIA" in device.device_kind else "rocm"
    return device.platform


def kernel_interpret(kernel: Kernel) -> bool | None:
    """How ``kernel`` runs in the program being traced: False compiled, True interpreted,
    None as the platform it is lowered for decides (``tiles.kernel_call``).

    Tracing can tell the platform only from an abstract mesh in context (``gpu_compile``
    traces under one of the GPU it compiles for) or from this process's devices: on a host
    of the kernel's platform it runs compiled. Anywhere else the program may still be
    lowered for a GPU (``jax.jit(f).trace(args placed on a GPU target's device).lower()``),
    so the choice waits for the lowering."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.abstract_device is not None:
        return platform_of(mesh.abstract_device) != kernel.platform
    if platform_of(jax.devices()[0]) == kernel.platform:
        return False
    return None


def run_batched(
    rule: Rule, impl, inputs: tuple, cu_seqlens, *, chunk_size: int, schedule, over_batch: Callable
):
    """``rule`` by ``impl`` over ``api.prepare_batched``'s ``inputs`` (q, k, v, gates,
    initial states): ``(o, finals)``. ``over_batch(one_head, *inputs, cu_seqlens)`` maps a
    one-head form over batch and heads (``api.over_batch_and_heads``)."""
    if impl == "auto":
        impl = "chunked"
    if impl in ("recurrent", "chunked"):
        one_head = one_head_form(rule, impl, chunk_size=chunk_size, schedule=schedule)
        return over_batch(one_head, *inputs, cu_seqlens)
    kernel = kernel_of(rule, impl)
    return kernel(
        *inputs, cu_seqlens, chunk_size=chunk_size, op=rule.name, interpret=kernel_interpret(kernel)
    )
