"""How long a sequence the op's forward+backward fits on one TPU chip, by the TPU compiler.

    python benchmarks/tpu_reach.py                        # v5e, both schedules (minutes)
    python benchmarks/tpu_reach.py --coarse               # powers of two only: a quick look

For ``gated_delta_rule`` at B=1, H=16, K=V=128, C=64 with bfloat16 q, k, v (float32 gates
and state), ``jax.grad`` of ``sum(y)`` over every input is compiled ahead of time for one
chip of ``--topology`` by libtpu's compiler on this host (``gdn_jax.tpu_compile``; no TPU).
A T fits when the compiler takes the program and its arguments + outputs + temporaries
(``memory_analysis()``) are within the chip's HBM. The largest T that fits is found by
doubling from ``--start`` and then bisecting in steps of ``--resolution`` tokens; the temp
memory is also printed at ``--temp-at`` (8192 and 32768). These are the compiler's memory
figures, not timings: nothing runs.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this host only compiles

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import gdn_jax  # noqa: E402
from gdn_jax import tpu_compile  # noqa: E402

MIB = 2**20


@functools.cache  # the temp figures and the search ask for some T twice
def program_memory(device, schedule, seq_len, *, heads, dim, chunk, dtype):
    """``(arguments + outputs + temp, temp, compile seconds)`` in bytes for the op's
    forward+backward at ``T = seq_len``, or ``(None, None, seconds)`` when the compiler runs
    out of HBM."""
    q = jax.ShapeDtypeStruct((1, seq_len, heads, dim), dtype)
    gate = jax.ShapeDtypeStruct((1, seq_len, heads), jnp.float32)

    def loss(q, k, v, log_alpha, beta):
        y, _ = gdn_jax.gated_delta_rule(
            q, k, v, log_alpha, beta, chunk_size=chunk, schedule=schedule
        )
        return jnp.sum(y.astype(jnp.float32))

    start = time.perf_counter()
    try:
        compiled = tpu_compile.compile_for(
            jax.grad(loss, argnums=range(5)), q, q, q, gate, gate, device=device
        )
    except jax.errors.JaxRuntimeError as error:
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        return None, None, time.perf_counter() - start
    stats = compiled.memory_analysis()
    total = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
    return total - stats.alias_size_in_bytes, stats.temp_size_in_bytes, time.perf_counter() - start


def reach(measure, hbm, *, start, resolution, coarse, limit):
    """The largest multiple of ``resolution`` T with ``measure(T)`` within ``hbm``: doubling
    from ``start``, then bisection (none with ``coarse``). Returns ``(T, bytes)`` or
    ``(None, None)`` when even ``start`` does not fit."""

    def fits(seq_len):
        total = measure(seq_len)
        return total is not None and total <= hbm, total

    low, low_total = None, None
    high = start
    while high <= limit:
        ok, total = fits(high)
        if not ok:
            break
        low, low_total, high = high, total, 2 * high
    if low is None or coarse or high > limit:
        return low, low_total
    while high - low > resolution:
        middle = (low + high) // 2 // resolution * resolution
        if middle in (low, high):
            break
        ok, total = fits(middle)
        if ok:
            low, low_total = middle, total
        else:
            high = middle
    return low, low_total


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v5e:2x2", help="its first chip is compiled for")
    parser.add_argument("--schedules", nargs="+", default=["hoisted", "in_scan"])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128, help="K = V")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", help="of q, k and v")
    parser.add_argument("--start", type=int, default=8192)
    parser.add_argument("--resolution", type=int, default=4096)
    parser.add_argument("--limit", type=int, default=2**22, help="largest T tried")
    parser.add_argument("--coarse", action="store_true", help="powers of two, no bisection")
    parser.add_argument("--temp-at", type=int, nargs="*", default=[8192, 32768])
    args = parser.parse_args()

    topology = tpu_compile.parse_topology(args.topology)
    tpu_compile.quiet_libtpu(topology)
    device = tpu_compile.topology_devices(args.topology)[0]
    hbm = topology.hbm_bytes // tpu_compile.devices_per_chip([device])
    shape = dict(heads=args.heads, dim=args.dim, chunk=args.chunk, dtype=jnp.dtype(args.dtype))
    print(
        f"gated_delta_rule forward+backward, B=1 H={args.heads} K=V={args.dim} C={args.chunk} "
        f"{args.dtype} q/k/v, on one {topology.generation} chip ({hbm / 2**30:g} GiB HBM); "
        f"libtpu's compiler on {jax.devices()[0].device_kind}: memory figures, not timings"
    )
    for schedule in args.schedules:

        def measure(seq_len, schedule=schedule):
            total, temp, seconds = program_memory(device, schedule, seq_len, **shape)
            shown = "out of HBM" if total is None else f"{total / MIB:.0f} MiB"
            print(f"  {schedule} T={seq_len}: {shown} (compiled in {seconds:.1f} s)", flush=True)
            return total

        for seq_len in args.temp_at:
            total, temp, seconds = program_memory(device, schedule, seq_len, **shape)
            shown = "out of HBM" if temp is None else f"temp {temp / MIB:.0f} MiB"
            print(f"{schedule} at T={seq_len}: {shown} (compiled in {seconds:.1f} s)", flush=True)
        seq_len, total = reach(
            measure,
            hbm,
            start=args.start,
            resolution=args.resolution,
            coarse=args.coarse,
            limit=args.limit,
        )
        if seq_len is None:
            print(f"{schedule}: T={args.start} does not fit")
        else:
            step = "a power of two" if args.coarse else f"to {args.resolution} tokens"
            step += ", --limit reached" if 2 * seq_len > args.limit else ""
            print(
                f"{schedule}: largest T that fits ({step}): {seq_len} "
                f"({total / MIB:.0f} MiB of {hbm / MIB:.0f} MiB)",
                flush=True,
            )


if __name__ == "__main__":
    main()
