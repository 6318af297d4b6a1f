"""The GPU check: gdn_jax's ops, in each form that ``gpu_compile_report.py`` lists, against
flash-linear-attention's Triton kernels and jax-linear-attention's Mosaic GPU kernels on the same
inputs, then the MQAR training step and ``python train.py`` to its stop.

    python benchmarks/gpu_check.py --out DIR            # on a GPU host (benchmarks/gpu_run.sh)
    python benchmarks/gpu_check.py --out DIR --smoke    # tiny shapes, anywhere: a check that it runs
    python benchmarks/gpu_check.py --out DIR --dry-run  # every program built and traced, no GPU

For Gated DeltaNet, KDA and GDN-2 at each shape (B=4, T=4096 and B=1, T=32768; H=16, K=V=128;
bf16 q, k, v; float32 gates and state; the L2 norm of q and k inside the op):

- **agreement**: each implementation's output, final state and the gradient of every input
  against those of each one measured before it on the item, with the bf16 row of the tests'
  tolerance table (``tests/support/tolerance.py``);
- **time**: forward, and forward+backward as a training step (``value_and_grad`` of the loss
  ``sum(o * do)`` with respect to every input, ``do`` a fixed random array: the loss reads
  the outputs, so no side's forward kernel is dropped from the compiled program, as it is
  from a gradient alone), median of ``--repeats`` synchronised runs after two warm-ups (wall
  time), and beside it the device time from JAX's profiler over three more runs (every
  kernel, copy and memset on the GPU's streams, summed; the costliest kernels by name:
  ``stage_profile.kernel_times``), for gdn_jax's Mosaic GPU kernels (``impl="mosaic_gpu"``)
  and its chunked form in each schedule (``associative``, ``hoisted``, ``in_scan``), fla
  (torch autograd; wall time only) and jax-linear-attention, in the order ``--item`` names
  them;
- **memory**: the peak device memory of each program: for JAX its compiled arguments, outputs
  and temporaries (``memory_analysis``), for torch ``max_memory_allocated`` over the call with
  the inputs resident.

A peer that is not installed, or an implementation that refuses the call (the kernel for a
rule without one, or on a JAX without Mosaic GPU's interpret mode off a GPU), is recorded as
skipped with the reason. Results go to ``DIR/gpu_check.json`` and ``DIR/gpu_check.md`` after
every item, so a run cut short keeps what it measured. ``--budget`` seconds bound the op
measurements: an item that would start after it is recorded as skipped. At full shapes each
implementation of an item runs in a child process of its own with a time limit
(``--stage-timeout``, fla's ``IN_CHILD``), so that a hang or a crash costs that stage only.

``--dry-run`` does all of that but the GPU's part: each stage's child builds the forward and
the training step at the check's shapes and traces them on abstract arrays (no memory, no
compile), then stops; what refuses to trace here is recorded as skipped, as on the GPU.

``--autotune-to FILE`` has XLA write its autotune results (the gemm and fusion tilings it
measured on the GPU) to FILE at every timed program's compile. XLA keeps one cache a process
and writes all of it each time, so the file holds every timed JAX program's results once the
run ends; ``.textproto`` writes it as text. ``gpu_compile_report.py --autotune-results FILE``
compiles with those tilings on a host without the GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu_report import Report, autotune_record, environment  # noqa: E402 (after its path)

from gdn_jax.ops.mosaic import limits  # noqa: E402

# --smoke and --dry-run interpret the kernels on the CPU: two warpgroups need three threads in
# XLA's CPU pool, more than a 2-core host gives it (limits.interpreter_refusal).
limits.give_interpreter_threads()

# (B, T) at H heads of K = V = DIM: the shapes, and tiny ones for --smoke (chunks of
# 64, the kernels' only size; 96 tokens end off the chunk grid).
FULL = dict(shapes=[(4, 4096), (1, 32768)], heads=16, dim=128, chunk=64)
SMOKE = dict(shapes=[(1, 96)], heads=2, dim=16, chunk=64)
# gdn_jax's forms measured, as gpu_compile_report.py lists them: its kernel, and the chunked
# form in each schedule.
KERNEL = "mosaic_gpu"
FORMS = (KERNEL, "associative", "hoisted", "in_scan")
# Every implementation, in the order an item measures them by default: what no GPU has timed
# yet first; fla last, since its first call autotunes Triton kernels for minutes.
IMPLS = (KERNEL, "associative", "jla", "hoisted", "in_scan", "fla")
WARMUPS = 2
# XLA options for every timed program's compile (main sets the autotune dump here).
COMPILE_OPTIONS: dict[str, str] = {}
# Runs under the profiler after the timed ones, for the device time per kernel.
PROFILED_CALLS = 3
# jax-linear-attention's implementation measured: its Hopper kernels ("chunked" is its XLA form).
JLA_IMPL = "mosaic_gpu"
SMOKE_RUN = [
    "model.vocab_size=128", "data.vocab_size=128", "model.d_model=32", "model.mixers=[gdn]",
    "data.seq_len=64", "data.num_kv_pairs=4", "train.batch_size=4", "train.steps=4",
    "train.warmup_steps=2", "train.eval_every=2", "train.eval_examples=8",
    "train.checkpoint_every=4",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Op:
    """One rule as each implementation names it and the gates it takes.

    ``gates`` maps a gate's name (gdn_jax's) to ``(trailing shape letters, kind)``: a
    ``"decay"`` is a log-decay (``<= 0``), a ``"gate"`` an activated strength in (0, 1).
    ``fla_gates`` and ``jla_gates`` are the same gates' keyword names in each peer."""

    key: str
    name: str
    gdn_jax: str
    gates: dict[str, tuple[str, str]]
    fla: tuple[str, str]  # (module, function)
    jla: str
    fla_gates: tuple[str, ...]
    jla_gates: tuple[str, ...]


OPS = (
    Op("gdn", "Gated DeltaNet", "gated_delta_rule", {"log_alpha": ("", "decay"), "beta": ("", "gate")},
       ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"), "gated_deltanet",
       ("g", "beta"), ("g", "beta")),
    Op("kda", "KDA", "kda", {"log_alpha": ("K", "decay"), "beta": ("", "gate")},
       ("fla.ops.kda", "chunk_kda"), "kda", ("g", "beta"), ("g", "beta")),
    Op("gdn2", "GDN-2", "gdn2", {"log_alpha": ("K", "decay"), "b": ("K", "gate"), "w": ("V", "gate")},
       ("fla.ops.gdn2", "chunk_gdn2"), "gdn2", ("g", "b", "w"), ("g", "b", "w")),
)  # fmt: skip


def make_inputs(op: Op, batch, seq_len, heads, dim, seed=0) -> dict[str, np.ndarray]:
    """float32 inputs, rounded to bf16 where the op takes bf16, and the output cotangent.

    Decays are ``log_sigmoid(x) / 8`` (a token keeps about 0.92 on average), so a 64-token
    chunk's decay stays well inside every implementation's range."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    bf16 = ml_dtypes.bfloat16
    token = (batch, seq_len, heads)
    arrays = {
        name: rng.standard_normal((*token, dim), np.float32).astype(bf16).astype(np.float32)
        for name in ("q", "k", "v")
    }
    for name, (letters, kind) in op.gates.items():
        x = rng.standard_normal(token + (dim,) * len(letters), np.float32)
        arrays[name] = -np.logaddexp(0.0, -x) / 8 if kind == "decay" else 1 / (1 + np.exp(-x))
    arrays["do"] = rng.standard_normal((*token, dim), np.float32)
    return arrays


# --- timing -------------------------------------------------------------------------------


def median_ms(call: Callable[[], object], sync: Callable[[object], object], repeats: int):
    for _ in range(WARMUPS):
        sync(call())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sync(call())
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def jax_program(fn, args, repeats, profile=False):
    """``(result, median ms, compile s, peak bytes, reading)`` of ``jax.jit(fn)`` on
    ``args``; ``reading`` is the profiler's, ``{"kernels": stage_profile.kernel_times}`` and
    with ``profile`` the time by stage too (``"stages"``), or ``{"error": ...}``."""
    import jax

    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile(dict(COMPILE_OPTIONS))
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    peak = None
    if memory is not None:
        peak = (
            memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            + memory.temp_size_in_bytes
            - memory.alias_size_in_bytes
        )
    ms = median_ms(lambda: compiled(*args), jax.block_until_ready, repeats)
    import stage_profile

    try:
        events = stage_profile.trace(compiled, args, PROFILED_CALLS)
        reading = dict(kernels=stage_profile.kernel_times(events, PROFILED_CALLS))
        if profile:
            stages = stage_profile.op_stages(compiled.as_text())
            reading["stages"] = stage_profile.attribute(events, stages, PROFILED_CALLS)
    except Exception as error:  # a profiler that fails costs the reading, not the run
        reading = dict(error=f"{type(error).__name__}: {error}"[:400])
    return compiled(*args), ms, compile_s, peak, reading


# --- the three implementations -------------------------------------------------------------


def jax_forward(impl, op: Op, chunk):
    """``(forward, names)``: ``impl``'s forward of ``op`` (gdn_jax's kernel or a schedule of
    its chunked form, or jla), ``(o, final state as [B, H, K, V])``, and its inputs' names."""
    names = ["q", "k", "v", *op.gates]
    if impl == "jla":
        import jax.numpy as jnp  # noqa: F401 (jla needs JAX started first)
        from jla import ops as jla_ops

        def forward(q, k, v, *gates):
            kwargs = dict(zip(op.jla_gates, gates, strict=True))
            return jla_ops.linear_attention(
                op.jla, q, k, v, impl=JLA_IMPL, use_qk_l2norm=True, output_final_state=True,
                **kwargs,
            )  # fmt: skip

        return forward, names
    import jax.numpy as jnp

    import gdn_jax

    fn = getattr(gdn_jax, op.gdn_jax)
    options = dict(impl=KERNEL) if impl == KERNEL else dict(impl="chunked", schedule=impl)

    def forward(*args):
        y, state = fn(*args, chunk_size=chunk, use_qk_l2norm=True, **options)
        return y, jnp.swapaxes(state, -1, -2)

    return forward, names


def training_step(forward, num_inputs):
    """``step(*inputs, do) -> (loss, grads)``: ``value_and_grad`` of ``sum(o * do)`` with
    respect to every input. The loss is returned, so the compiled program keeps the
    forward's outputs, not only what the backward reads of it."""
    import jax
    import jax.numpy as jnp

    def loss(*args_and_do):
        *args, do = args_and_do
        return jnp.sum(forward(*args)[0].astype(jnp.float32) * do)

    return jax.value_and_grad(loss, argnums=tuple(range(num_inputs)))


def input_specs(op: Op, names, batch, seq_len, heads, dim):
    """The abstract inputs of ``make_inputs``, in ``names``' order, then ``do``."""
    import jax
    import jax.numpy as jnp

    token = (batch, seq_len, heads)
    shapes = {n: (*token, dim) for n in ("q", "k", "v", "do")}
    shapes.update({n: token + (dim,) * len(letters) for n, (letters, _) in op.gates.items()})
    return [
        jax.ShapeDtypeStruct(shapes[n], jnp.bfloat16 if n in "qkv" else jnp.float32)
        for n in [*names, "do"]
    ]


def jax_runs(impl, op: Op, arrays, chunk, repeats, profile=False):
    """``impl``'s forward and training step (``jax_forward``, ``training_step``):
    ``{"fwd": ..., "fwd+bwd": ...}`` with each program's time, memory and the profiler's
    reading, and the values to compare: o, the final state, the loss and every gradient."""
    import jax.numpy as jnp

    forward, names = jax_forward(impl, op, chunk)
    args = [jnp.asarray(arrays[n], jnp.bfloat16 if n in "qkv" else jnp.float32) for n in names]
    do = jnp.asarray(arrays["do"])
    step = training_step(forward, len(names))
    (y, state), fwd_ms, fwd_compile, fwd_peak, fwd_reading = jax_program(forward, args, repeats)
    (loss, grads), bwd_ms, bwd_compile, bwd_peak, bwd_reading = jax_program(
        step, [*args, do], repeats, profile=profile
    )
    values = {"o": y, "final_state": state, "loss": loss}
    values.update({f"d{n}": g for n, g in zip(names, grads, strict=True)})
    timings = _timings(fwd_ms, bwd_ms, fwd_peak, bwd_peak, fwd_compile, bwd_compile)
    for part, reading in (("fwd", fwd_reading), ("fwd+bwd", bwd_reading)):
        timings[part]["kernels"] = reading.get("kernels", reading)
        if "stages" in reading:
            timings[part]["stages"] = reading["stages"]
    return timings, values


def gdn_jax_runs(op: Op, arrays, form, chunk, repeats, profile=False):
    """gdn_jax in ``form`` (its kernel or a schedule of the chunked form): ``jax_runs``."""
    return jax_runs(form, op, arrays, chunk, repeats, profile)


def jla_runs(op: Op, arrays, repeats, profile=False):
    return jax_runs("jla", op, arrays, 64, repeats, profile)


def dry_run_of(impl, op: Op, sizes, shape) -> dict:
    """``impl``'s forward and training step of ``op`` built at ``shape`` and traced on
    abstract arrays (nothing compiled, nothing allocated): per program, the equations of its
    jaxpr and the seconds it took."""
    import jax

    if impl == "jla":
        # Its kernels' dispatch asks the device for Hopper; traced here, it is told so.
        from gpu_compile_report import as_if_on_hopper

        as_if_on_hopper()
    forward, names = jax_forward(impl, op, sizes["chunk"])
    specs = input_specs(op, names, *shape, sizes["heads"], sizes["dim"])
    done = {}
    for part, fn, args in (("fwd", forward, specs[:-1]),
                           ("fwd+bwd", training_step(forward, len(names)), specs)):  # fmt: skip
        start = time.perf_counter()
        traced = jax.jit(fn).trace(*args)
        done[part] = dict(
            equations=len(traced.jaxpr.eqns), trace_s=round(time.perf_counter() - start, 2)
        )
    return done


def fla_runs(op: Op, arrays, repeats):
    import importlib

    import torch

    fn = getattr(importlib.import_module(op.fla[0]), op.fla[1])
    names = ["q", "k", "v", *op.gates]
    device = torch.device("cuda")

    def tensor(name):
        dtype = torch.bfloat16 if name in "qkv" else torch.float32
        return torch.from_numpy(arrays[name]).to(device=device, dtype=dtype)

    inputs = [tensor(n).requires_grad_() for n in names]
    do = torch.from_numpy(arrays["do"]).to(device)

    def forward(*inputs):
        q, k, v, *gates = inputs
        kwargs = dict(zip(op.fla_gates, gates, strict=True))
        return fn(q, k, v, **kwargs, use_qk_l2norm_in_kernel=True, output_final_state=True)

    def fwd():
        with torch.no_grad():
            return forward(*inputs)

    def fwd_bwd():
        y, _ = forward(*inputs)
        return torch.autograd.grad((y.float() * do).sum(), inputs)

    def sync(_):
        torch.cuda.synchronize()

    def peak_bytes(call):
        sync(None)
        torch.cuda.reset_peak_memory_stats()
        result = call()
        sync(None)
        return torch.cuda.max_memory_allocated(), result

    fwd_ms = median_ms(fwd, sync, repeats)
    fwd_peak, (y, state) = peak_bytes(fwd)
    values = {"o": y, "final_state": state}
    try:
        bwd_ms = median_ms(fwd_bwd, sync, repeats)
        bwd_peak, grads = peak_bytes(fwd_bwd)
        values.update({f"d{n}": g for n, g in zip(names, grads, strict=True)})
    except RuntimeError as error:  # fla refuses some backwards on some Triton versions
        print(f"fla {op.name}: no backward: {error}", flush=True)
        bwd_ms = bwd_peak = None
    values = {n: x.float().cpu().numpy() for n, x in values.items()}
    return _timings(fwd_ms, bwd_ms, fwd_peak, bwd_peak, None, None), values


def _timings(fwd_ms, bwd_ms, fwd_peak, bwd_peak, fwd_compile, bwd_compile):
    """Both programs' figures."""
    return {
        "fwd": dict(ms=fwd_ms, peak_bytes=fwd_peak, compile_s=fwd_compile),
        "fwd+bwd": dict(ms=bwd_ms, peak_bytes=bwd_peak, compile_s=bwd_compile),
    }


def agreement(actual: dict, expected: dict) -> dict[str, float]:
    """Per quantity, the largest error as a fraction of the bf16 tolerance (``<= 1`` passes):
    ``|a - e| <= atol * max(1, max|e|) + rtol * |e|``, as ``support.tolerance.assert_close``."""
    import jax.numpy as jnp
    from support.tolerance import TOLERANCE

    rtol, atol = TOLERANCE[jnp.dtype(jnp.bfloat16)]
    fractions = {}
    for name, e in expected.items():
        if name not in actual:
            continue
        a, e = np.asarray(actual[name], np.float32), np.asarray(e, np.float32)
        if a.shape != e.shape:
            raise ValueError(f"{name}: shape {a.shape} against {e.shape}")
        bound = atol * max(1.0, float(np.max(np.abs(e), initial=0.0))) + rtol * np.abs(e)
        fractions[name] = float(np.max(np.abs(a - e) / bound, initial=0.0))
    return fractions


# --- the whole check ----------------------------------------------------------------------


def peers_available(dry_run=False) -> dict[str, str | None]:
    """Each peer: ``None`` if it can run here, else why not. A dry run traces JAX programs
    only: jla wherever it is installed, never fla."""
    import jax

    installed = importlib.util.find_spec("jla") is not None
    if dry_run:
        jla = None if installed else "jax-linear-attention is not installed"
        return {"fla": "a dry run traces JAX programs only", "jla": jla}
    gpu = jax.default_backend() == "gpu"
    reasons = {}
    torch_cuda = False
    if importlib.util.find_spec("torch") is not None:
        import torch

        torch_cuda = torch.cuda.is_available()
    if importlib.util.find_spec("fla") is None:
        reasons["fla"] = "fla-core is not installed"
    elif not torch_cuda:
        reasons["fla"] = "torch sees no CUDA device"
    else:
        reasons["fla"] = None
    if not installed:
        reasons["jla"] = "jax-linear-attention is not installed"
    elif not gpu:
        reasons["jla"] = "its kernels need a GPU backend"
    else:
        reasons["jla"] = None
    return reasons


def parse_items(specs: list[str], sizes) -> list[tuple]:
    """``OP@BxT:IMPL,IMPL`` (each part optional: ``kda``, ``gdn@1x32768``, ``gdn2:jla,hoisted``)
    to ``[(op, (B, T), impls)]``; no specs is every op at every shape with every implementation.
    """
    ops = {op.key: op for op in OPS}
    shapes = {f"{b}x{t}": (b, t) for b, t in sizes["shapes"]}
    if not specs:
        return [(op, shape, IMPLS) for shape in shapes.values() for op in OPS]
    items = []
    for spec in specs:
        head, _, impls = spec.partition(":")
        key, _, shape = head.partition("@")
        impls = tuple(impls.split(",")) if impls else IMPLS
        bad = [f"op {key!r} (one of {sorted(ops)})" for _ in [0] if key not in ops] + [
            f"shape {shape!r} (one of {sorted(shapes)})"
            for _ in [0]
            if shape and shape not in shapes
        ]
        bad += [f"implementation {i!r} (one of {list(IMPLS)})" for i in impls if i not in IMPLS]
        if bad:
            raise ValueError(f"--item {spec!r}: unknown {', '.join(bad)}")
        for s in [shapes[shape]] if shape else shapes.values():
            items.append((ops[key], s, impls))
    return items


def check_ops(report: Report, sizes, items, repeats, deadline, profile=False, stages=None):
    """Each item measured, its implementations in the order it names them, each one's values
    checked against those of every one measured before it; with ``profile``, each JAX
    forward+backward program is also timed by stage. ``stages`` (a ``Stages``) runs each
    implementation in a child process of its own, else they run in this one."""
    heads, dim = sizes["heads"], sizes["dim"]
    peers = peers_available(dry_run=stages is not None and stages.dry_run)
    for peer, why in peers.items():
        if why is not None:
            report.skip(peer, why)
    for op, (batch, seq_len), impls in items:
        shape = f"{batch}×{seq_len}"
        label = f"{op.name} {shape}"
        if time.perf_counter() > deadline:
            report.skip(label, "the --budget ran out")
            continue
        arrays = None if stages is not None else make_inputs(op, batch, seq_len, heads, dim)
        measured = {}  # the values (on the host) each implementation computed, by its row
        for impl in impls:
            if peers.get(impl) is not None:
                continue
            row_name = impl if impl in peers else f"gdn_jax {impl}"
            try:
                if stages is not None:
                    timings, values = stages.run(impl, op, (batch, seq_len), repeats, profile)
                else:
                    timings, values = RUNNERS[impl](op, arrays, repeats, sizes["chunk"], profile)
            except Exception as error:  # a refusal or a failed compile is recorded, not fatal
                report.skip(f"{row_name} {label}", f"{type(error).__name__}: {error}"[:400])
                continue
            if stages is not None and stages.dry_run:
                report.add_dry_run(dict(op=op.name, shape=shape, impl=row_name, **timings))
                print(f"{label} {row_name}: traced {timings}", flush=True)
                continue
            values = {n: np.asarray(x, np.float32) for n, x in values.items()}
            fractions = {other: agreement(values, seen) for other, seen in measured.items()}
            report.add_op(
                dict(op=op.name, shape=shape, impl=row_name, **timings, agreement=fractions)
            )
            print(f"{label} {row_name}: {_summary(timings)} {fractions}", flush=True)
            measured[row_name] = values


# fla's time limit as a child: its first call autotunes its Triton kernels, which on the H200
# took over five minutes for KDA (docs/benchmarks.md), and a process killed mid-call is the
# one way to stop that. Every other implementation has --stage-timeout.
IN_CHILD = {"fla": 150.0}


@dataclasses.dataclass
class Stages:
    """Each implementation of an item in a child process of its own (``in_child``), with
    its time limit: a hang or a crash costs that stage, not the run. ``autotune`` (a
    file, or None): each child writes XLA's autotune results of its programs beside it, and
    they are merged into it after every stage (``merge_autotune``)."""

    sizes: dict
    timeout: float
    dry_run: bool = False
    autotune: Path | None = None
    parts: list = dataclasses.field(default_factory=list)

    def run(self, impl, op, shape, repeats, profile):
        part = None
        if self.autotune is not None:
            name = f".{self.autotune.stem}.{len(self.parts)}{self.autotune.suffix}"
            part = self.autotune.with_name(name)
            self.parts.append(part)
        try:
            return in_child(
                impl, op, self.sizes, shape, repeats, profile,
                timeout=IN_CHILD.get(impl, self.timeout), dry_run=self.dry_run, autotune=part,
            )  # fmt: skip
        finally:
            if part is not None:
                merge_autotune(self.parts, self.autotune)


def merge_autotune(parts: list[Path], out: Path):
    """The autotune results of every child in one file, ``out``: each child's XLA writes
    its own process's results, so the children's files (``parts``, removed once read) are
    joined, each result once. A text file holds a header (``version``) and one
    ``results { ... }`` block a result; a binary one (any other suffix than ``.textproto``)
    is not read, and the last child's file is kept whole."""
    found = [p for p in [out, *parts] if p.is_file() and p.stat().st_size]
    if found and out.suffix != ".textproto":
        found[-1].replace(out)
        found = []
    header, blocks = None, []
    for path in found:
        head, *results = re.split(r"(?m)^(?=results \{)", path.read_text())
        header = header or head
        for block in results:
            block = block if block.endswith("\n") else block + "\n"
            if block not in blocks:
                blocks.append(block)
    for part in parts:
        part.unlink(missing_ok=True)
    if found:
        out.write_text((header or "") + "".join(blocks))


def _runners():
    runners = {"fla": lambda op, arrays, repeats, chunk, profile: fla_runs(op, arrays, repeats)}
    runners["jla"] = lambda op, arrays, repeats, chunk, profile: jla_runs(
        op, arrays, repeats, profile
    )
    for form in FORMS:
        runners[form] = functools.partial(_gdn_jax_runner, form=form)
    return runners


def _gdn_jax_runner(op, arrays, repeats, chunk, profile, *, form):
    return gdn_jax_runs(op, arrays, form, chunk, repeats, profile)


RUNNERS = _runners()


def in_child(
    impl, op, sizes, shape, repeats, profile=False, timeout=None, dry_run=False, autotune=None
):
    """``RUNNERS[impl]`` on ``op`` at ``shape`` in a child process (``--child``), which makes
    the same inputs: ``(timings, values)``, or ``TimeoutError`` after ``timeout`` seconds
    (``IN_CHILD[impl]``) with the child killed. With ``dry_run``, ``dry_run_of``'s reading
    and no values; with ``autotune``, the child writes XLA's autotune results there."""
    timeout = IN_CHILD.get(impl, 600.0) if timeout is None else timeout
    flags = (["--smoke"] if sizes is SMOKE else []) + (["--profile"] if profile else [])
    flags += ["--dry-run"] * dry_run + (["--autotune-to", str(autotune)] if autotune else [])
    with tempfile.TemporaryDirectory() as folder:
        spec = f"{impl}:{op.key}:{shape[0]}x{shape[1]}"
        command = [sys.executable, __file__, "--child", spec, "--out", folder, *flags]
        try:
            done = subprocess.run(
                [*command, "--repeats", str(repeats)],
                capture_output=True, text=True, timeout=timeout, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{impl} did not finish within {timeout:.0f} s") from None
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
            # The exception's own line, not JAX's note on its filtered traceback after it.
            raised = [line for line in lines if re.match(r"[\w.]+(Error|Exception)\b", line)]
            raise RuntimeError((raised or lines)[-1])
        timings = json.loads((Path(folder) / "timings.json").read_text())
        if dry_run:
            return timings, {}
        with np.load(Path(folder) / "values.npz") as values:
            return timings, dict(values)


def run_child(spec: str, sizes, out: Path, repeats: int, profile=False, dry_run=False):
    """The child's side of ``in_child``: ``IMPL:OP:BxT`` measured (or traced, with
    ``dry_run``), written to ``out``."""
    impl, key, shape = spec.split(":")
    batch, seq_len = (int(n) for n in shape.split("x"))
    op = next(o for o in OPS if o.key == key)
    if dry_run:
        out.mkdir(parents=True, exist_ok=True)
        (out / "timings.json").write_text(json.dumps(dry_run_of(impl, op, sizes, (batch, seq_len))))
        return
    arrays = make_inputs(op, batch, seq_len, sizes["heads"], sizes["dim"])
    timings, values = RUNNERS[impl](op, arrays, repeats, sizes["chunk"], profile)
    out.mkdir(parents=True, exist_ok=True)
    (out / "timings.json").write_text(json.dumps(timings))
    np.savez(out / "values.npz", **{k: np.asarray(v, np.float32) for k, v in values.items()})


@contextlib.contextmanager
def dumping_autotune(path: Path | None):
    """Every timed program compiled while the block runs writes XLA's autotune results (the
    process's whole cache) to ``path``; None: none written."""
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    COMPILE_OPTIONS["xla_gpu_dump_autotune_results_to"] = str(path.resolve())
    try:
        yield
    finally:
        del COMPILE_OPTIONS["xla_gpu_dump_autotune_results_to"]


def _summary(timings):
    def one(name, t):
        ms = "-" if t["ms"] is None else f"{t['ms']:.2f}"
        compile_s = "" if t["compile_s"] is None else f" (compile {t['compile_s']:.1f} s)"
        return f"{name} {ms} ms{compile_s}"

    return " ".join(one(name, t) for name, t in timings.items())


def check_training(report: Report, smoke, repeats):
    import jax

    from gdn_jax.data.mqar import make_batch, make_mqar
    from gdn_jax.training import mesh as mesh_lib
    from gdn_jax.training.config import load_config
    from gdn_jax.training.state import train_setup

    overrides = SMOKE_RUN if smoke else []
    config = load_config(REPO / "gdn_jax" / "configs" / "mqar_gdn.yaml", overrides)
    mesh = mesh_lib.check_mesh(config, jax.devices())
    steps, state = train_setup(config, mesh)
    examples = make_mqar(config.data, num_examples=config.train.batch_size, seed=0)
    batch = mesh_lib.place(make_batch(*examples), steps.batch_shardings)
    holder = [state]

    def step():
        holder[0], metrics = steps.train_step(holder[0], batch)
        return metrics

    with jax.set_mesh(mesh):
        start = time.perf_counter()
        jax.block_until_ready(step())
        first_s = time.perf_counter() - start
        step_ms = median_ms(step, jax.block_until_ready, repeats)
    report.data["training"].update(
        step_ms=step_ms, first_call_s=first_s, repeats=repeats,
        step_shape=f"{config.train.batch_size} x {config.data.seq_len} tokens",
    )  # fmt: skip
    report.write()
    print(f"MQAR train step: {step_ms:.2f} ms (first call {first_s:.1f} s)", flush=True)

    with tempfile.TemporaryDirectory() as out_dir:
        command = [sys.executable, str(REPO / "train.py"), "--set", f"train.out_dir={out_dir}"]
        command += [arg for o in overrides for arg in ("--set", o)]
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        wall_s = time.perf_counter() - start
        if done.returncode != 0:
            report.skip("python train.py", f"exit {done.returncode}: {done.stderr[-600:]}")
            return
        summary = json.loads((Path(out_dir) / "summary.json").read_text())
    report.data["training"]["train_py"] = dict(
        wall_s=wall_s, final_step=summary["final_step"], reason=summary["reason"],
        eval_accuracy=summary["eval_accuracy"],
    )  # fmt: skip
    report.write()
    print(f"python train.py: {wall_s:.1f} s, {summary}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON and table")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: a check that it runs")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs (default 10)")
    parser.add_argument("--budget", type=float, default=330.0, help="seconds for the op items")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument(
        "--dry-run", action="store_true",
        help="build and trace every program at the check's shapes, each in its child, then stop",
    )  # fmt: skip
    parser.add_argument(
        "--stage-timeout", type=float, default=120.0,
        help="seconds each implementation's child may run (fla: its own limit; default 120)",
    )  # fmt: skip
    parser.add_argument(
        "--profile", action="store_true",
        help="profile each JAX forward+backward: time per stage (stage_profile.py)",
    )  # fmt: skip
    parser.add_argument(
        "--item", action="append", default=[], metavar="OP@BxT:IMPL,..",
        help=f"measure only this (repeatable; default everything): OP in {[o.key for o in OPS]}, "
        f"IMPL in {list(IMPLS)}, e.g. kda@4x4096:jla,hoisted",
    )  # fmt: skip
    parser.add_argument(
        "--autotune-to", type=Path, metavar="FILE",
        help="write XLA's autotune results of the timed programs here (.textproto: as text)",
    )  # fmt: skip
    parser.add_argument("--child", metavar="IMPL:OP:BxT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    sizes = SMOKE if args.smoke else FULL
    if args.child:
        with dumping_autotune(args.autotune_to):
            run_child(args.child, sizes, args.out, args.repeats, args.profile, args.dry_run)
        return
    try:
        items = parse_items(args.item, sizes)
    except ValueError as error:
        parser.error(str(error))
    began = time.perf_counter()
    report = Report(args.out, environment())
    print(report.data["environment"], flush=True)
    # At the check's shapes every stage runs in its own child; --smoke runs them here.
    stages = None
    if args.dry_run or not args.smoke:
        autotune = None if args.dry_run or args.autotune_to is None else args.autotune_to.resolve()
        stages = Stages(sizes, args.stage_timeout, dry_run=args.dry_run, autotune=autotune)
    with dumping_autotune(None if stages is not None else args.autotune_to):
        check_ops(report, sizes, items, args.repeats, began + args.budget, args.profile, stages)
    if args.dry_run:
        print(f"dry run done in {time.perf_counter() - began:.0f} s; {args.out / 'gpu_check.md'}")
        return
    if args.autotune_to is not None:
        report.data["autotune"] = autotune_record(args.autotune_to)
        report.write()
        print(f"XLA autotune results: {report.data['autotune']}", flush=True)
    if not args.skip_training:
        check_training(report, args.smoke, args.repeats)
    print(f"done in {time.perf_counter() - began:.0f} s; {args.out / 'gpu_check.md'}")


if __name__ == "__main__":
    main()
