"""Time and memory of the recurrent and chunked gated delta rule and Kimi Delta Attention.

    python benchmarks/bench_ops.py                               # the first table in docs/benchmarks.md
    python benchmarks/bench_ops.py --seq-lens 4096 --chunk-sizes 16 32 64 128
    python benchmarks/bench_ops.py --shape mqar --seq-lens 256 --chunk-sizes 16 32 64 \\
        --baseline REV --no-recurrent                            # before/after, one run
    python benchmarks/bench_ops.py --ops gdn kda --seq-lens 4096 --no-recurrent \\
        --schedules auto                                         # KDA next to Gated DeltaNet

``--ops`` picks the recurrences: ``gdn`` (``gated_delta_rule``, one gate per head and token),
``kda`` (``kda``, one decay per key channel), ``gdn2`` (``gdn2``, per-channel erase and
write gates too) and ``gdp2``, ``gdp3`` (``gated_delta_product`` with 2 and 3 steps a token);
the baseline runs each of them that it has.

``--schedules`` picks the chunked schedules to time (``in_scan``, ``hoisted``, ``auto``);
``--xla-defaults`` leaves out the XLA options of ``gdn_jax.training.xla_flags``.

For each impl and T it prints the forward and forward+backward wall time (best of --repeats
after a warm-up call; the gradient is that of ``sum(y ** 2)`` with respect to every input),
the compiled programs' temp memory (``memory_analysis().temp_size_in_bytes``), and for the
chunked forward its achieved GFLOP/s next to a 2048^3 matmul timed in the same run.
``--baseline REV`` adds the chunked form of the package as it was at git revision REV in each
of ``--schedules`` (``auto`` for a revision from before schedules), imported next to the
current one (``revision.py``), so before and after share one run: ratios within one run are
what to compare, these machines are noisy from run to run. Within a run, programs timed one
after the other still meet the machine's slow and fast spells unevenly; ``--interleave``
times one call of each per round instead.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from revision import import_revision

import gdn_jax
from gdn_jax.training.xla_flags import add_cpu_flags

# (B, H, K, V): the long-sequence shape of the issue and the MQAR training shape.
SHAPES = {"long": (1, 8, 128, 128), "mqar": (32, 2, 32, 32)}


def best_ms(fn, args, repeats):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def interleaved_best_ms(calls, repeats):
    """Best wall ms of each ``(fn, args)`` in ``calls``, timed one call of each per round,
    the order reversed every round: a slow spell of the machine then falls on all of them,
    not on whichever ran through it."""
    for fn, args in calls:
        jax.block_until_ready(fn(*args))
    times = [[] for _ in calls]
    for round_ in range(repeats):
        order = range(len(calls)) if round_ % 2 == 0 else reversed(range(len(calls)))
        for i in order:
            fn, args = calls[i]
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[i].append(time.perf_counter() - start)
    return [1e3 * min(t) for t in times]


def temp_mb(jitted, args):
    return jitted.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20


def chunked_forward_flops(shape, seq_len, chunk):
    """Matmul flops of the staged chunked forward per chunk and head: k k^T and q k^T
    (2 C^2 K each), the inverse (~2 C^3 / 3), T [k | v] (2 C^2 (K + V)), the state reads
    [w; q] S^T and the update U^T k (2 C K V each for three C-row products), attn U
    (2 C^2 V)."""
    batch, heads, key, value = shape
    num_chunks = -(-seq_len // chunk)
    per_chunk = 4 * chunk**2 * key + 2 * chunk**2 * (key + value) + 2 * chunk**2 * value
    per_chunk += 6 * chunk * key * value + 2 * chunk**3 // 3
    return batch * heads * num_chunks * per_chunk


# The batched entry point of each recurrence, the trailing axis of each of its gates after
# log_alpha's and beta's [B, T, H] (None, "K": one per key channel, or "V"), and its steps a
# token (Gated DeltaProduct's num_householder: k, v and beta have T n of them).
OPS = {
    "gdn": ("gated_delta_rule", (None, None), 1),
    "kda": ("kda", ("K", None), 1),
    "gdn2": ("gdn2", ("K", "K", "V"), 1),
    "gdp2": ("gated_delta_product", (None, None), 2),
    "gdp3": ("gated_delta_product", (None, None), 3),
}


def inputs(shape, seq_len, op):
    """q, k, v and the gates of ``op``: log-decays in [-0.5, -0.01], the others in [0, 1]."""
    batch, heads, key, value = shape
    rng = np.random.default_rng(0)
    q = rng.standard_normal((batch, seq_len, heads, key))
    steps = seq_len * OPS[op][2]
    k = rng.standard_normal((batch, steps, heads, key))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((batch, steps, heads, value))
    gates = []
    for i, channels in enumerate(OPS[op][1]):
        tail = {None: (), "K": (key,), "V": (value,)}[channels]
        low, high = (-0.5, -0.01) if i == 0 else (0.0, 1.0)
        length = seq_len if i == 0 else steps  # a decay a token, the rest a step
        gates.append(rng.uniform(low, high, (batch, length, heads, *tail)))
    return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v, *gates))


class Row(NamedTuple):
    """One program pair to time: its table labels, compiled forward and gradient, inputs and
    temp memory."""

    op: str
    label: str
    impl: str
    chunk: int
    forward: Callable
    grad: Callable
    args: tuple
    fwd_mb: float
    grad_mb: float


def programs(package, op, impl, chunk, schedule):
    options = dict(impl=impl, chunk_size=chunk)
    if OPS[op][2] > 1:
        options.update(num_householder=OPS[op][2])
    if schedule not in (None, "auto"):  # a baseline revision may predate schedules
        options.update(schedule=schedule)
    entry = getattr(package, OPS[op][0])

    def forward(*args):
        return entry(*args, **options)[0]

    def loss(*args):
        return jnp.sum(forward(*args) ** 2)

    arity = 3 + len(OPS[op][1])
    return jax.jit(forward), jax.jit(jax.grad(loss, argnums=range(arity)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="long")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--schedules", nargs="+", default=["in_scan", "hoisted"])
    parser.add_argument("--ops", nargs="+", choices=sorted(OPS), default=["gdn"])
    parser.add_argument("--baseline", help="git revision whose chunked form to time as well")
    parser.add_argument("--no-recurrent", action="store_true", help="skip the recurrent form")
    parser.add_argument(
        "--max-temp-gb",
        type=float,
        default=12.0,
        help="compile but do not run programs whose temp memory exceeds this",
    )
    parser.add_argument(
        "--xla-defaults", action="store_true", help="leave out training.xla_flags.CPU_FLAGS"
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="time every program once per round, --repeats rounds, instead of one program "
        "after the other",
    )
    args = parser.parse_args()
    if not args.xla_defaults:
        add_cpu_flags()  # before the first JAX computation starts the backend
    shape = SHAPES[args.shape]

    size = 2048
    a = jnp.asarray(np.random.default_rng(1).standard_normal((size, size)), jnp.float32)
    matmul_ms = best_ms(jax.jit(lambda x: x @ x), (a,), args.repeats)
    matmul_gflops = 2 * size**3 / matmul_ms / 1e6
    print(
        f"# {platform.processor() or platform.machine()}, {jax.devices()[0].device_kind}, "
        f"jax {jax.__version__}; B, H, K, V = {shape}, float32"
    )
    print(f"# reference: {size}^3 matmul {matmul_ms:.1f} ms = {matmul_gflops:.1f} GFLOP/s\n")
    print(
        "| op | impl | C | T | fwd ms | fwd+bwd ms | fwd temp MB | fwd+bwd temp MB | fwd GFLOP/s (% of matmul) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")

    runs = []
    baseline = import_revision(args.baseline) if args.baseline else None
    for op in args.ops:
        if not args.no_recurrent:
            runs.append((op, "recurrent", gdn_jax, "recurrent", 64, None))
        for chunk in args.chunk_sizes:
            for schedule in args.schedules:
                if baseline is not None and hasattr(baseline, OPS[op][0]):
                    label = f"chunked@{args.baseline} {schedule}"
                    runs.append((op, label, baseline, "chunked", chunk, schedule))
                runs.append((op, f"chunked {schedule}", gdn_jax, "chunked", chunk, schedule))
    for seq_len in args.seq_lens:
        data = {op: inputs(shape, seq_len, op) for op in args.ops}
        rows = []
        for op, label, package, impl, chunk, schedule in runs:
            forward, grad = programs(package, op, impl, chunk, schedule)
            fwd_mb, grad_mb = temp_mb(forward, data[op]), temp_mb(grad, data[op])
            rows.append(Row(op, label, impl, chunk, forward, grad, data[op], fwd_mb, grad_mb))
        ran = [row for row in rows if row.grad_mb / 1024 <= args.max_temp_gb]
        if args.interleave:
            fwd_ms = interleaved_best_ms([(r.forward, r.args) for r in rows], args.repeats)
            grad_ms = interleaved_best_ms([(r.grad, r.args) for r in ran], args.repeats)
        else:
            fwd_ms = [best_ms(r.forward, r.args, args.repeats) for r in rows]
            grad_ms = [best_ms(r.grad, r.args, max(1, args.repeats - 1)) for r in ran]
        grad_ms = dict(zip(map(id, ran), grad_ms, strict=True))
        for row, fwd in zip(rows, fwd_ms, strict=True):
            grad = grad_ms.get(id(row))
            grad = f"{grad:.1f}" if grad is not None else f"not run (> {args.max_temp_gb:g} GB)"
            rate = "-"
            if row.impl == "chunked" and row.op == "gdn":  # the flop count is the GDN rule's
                gflops = chunked_forward_flops(shape, seq_len, row.chunk) / fwd / 1e6
                rate = f"{gflops:.1f} ({100 * gflops / matmul_gflops:.0f}%)"
            label_c = row.chunk if row.impl == "chunked" else "-"
            print(
                f"| {row.op} | {row.label} | {label_c} | {seq_len} | {fwd:.1f} | {grad} | "
                f"{row.fwd_mb:.1f} | {row.grad_mb:.1f} | {rate} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
