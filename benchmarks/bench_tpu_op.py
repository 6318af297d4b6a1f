"""The op's memory and loops on a TPU chip, from ahead-of-time compiles on this host.

    python benchmarks/bench_tpu_op.py --ops gdn kda gdn2 --schedules hoisted   # docs/benchmarks.md

For each of ``--ops`` (``gdn``, ``kda``, ``gdn2``: ``bench_ops.OPS``) and each schedule it
compiles the op's forward and its forward+backward (the
gradient of ``sum(y)`` with respect to every input) for one chip of ``--topology`` with
libtpu's compiler (``gdn_jax.tpu_compile``: no TPU needed), at ``--shape B T H K`` (K = V)
and chunk ``--chunk-size``, q, k, v and the gates in ``--dtype``, and prints the compiled
program's temp memory (``memory_analysis().temp_size_in_bytes``), its while loops, and the
fusions each loop body launches (its own fusion instructions: each is a kernel per chunk).
``--baseline REV`` adds the package as it was at git revision REV (``revision.py``). These
are the compiler's figures, not timings.
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp
from bench_ops import OPS
from revision import import_revision

import gdn_jax
from gdn_jax import tpu_compile

COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.-]+) .*\{$")
BODY = re.compile(r"body=%?([\w.-]+)")


def fusions_per_body(hlo: str) -> list[int]:
    """The fusion instructions of each while loop's body, in the order of the loops."""
    counts, name = {}, None
    for line in hlo.splitlines():
        match = COMPUTATION.match(line)
        if match:
            name = match.group(1)
            counts[name] = 0
        elif line.strip() == "}":
            name = None
        elif name is not None and " fusion(" in line:
            counts[name] += 1
    return [counts[body] for body in BODY.findall(hlo)]


def programs(package, op, schedule, chunk_size):
    entry = getattr(package, OPS[op][0])

    def forward(*args):
        return entry(*args, chunk_size=chunk_size, schedule=schedule)[0]

    def loss(*args):
        return jnp.sum(forward(*args).astype(jnp.float32))

    arity = 3 + len(OPS[op][1])
    return {"fwd": forward, "fwd+bwd": jax.grad(loss, argnums=range(arity))}


def abstract_inputs(op, batch, seq_len, heads, dim, dtype):
    """Shapes of ``op``'s inputs: q, k, v ``[B, T, H, K]`` (K = V) and its gates."""
    tails = {None: (), "K": (dim,), "V": (dim,)}
    inputs = [jax.ShapeDtypeStruct((batch, seq_len, heads, dim), dtype)] * 3
    return inputs + [
        jax.ShapeDtypeStruct((batch, seq_len, heads, *tails[channels]), dtype)
        for channels in OPS[op][1]
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topology", default="v5e:2x2")
    parser.add_argument("--shape", type=int, nargs=4, default=[2, 8192, 16, 128])
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--schedules", nargs="+", default=["hoisted", "in_scan"])
    parser.add_argument("--baseline", help="git revision to compile as well")
    one_step = sorted(op for op, (_, _, steps) in OPS.items() if steps == 1)
    parser.add_argument("--ops", nargs="+", choices=one_step, default=["gdn"])
    args = parser.parse_args()
    tpu_compile.quiet_libtpu(tpu_compile.parse_topology(args.topology))
    device = tpu_compile.topology_devices(args.topology)[0]
    batch, seq_len, heads, dim = args.shape
    dtype = jnp.dtype(args.dtype)
    print(
        f"# {args.topology}, one chip; B, T, H, K=V = {tuple(args.shape)}, C = "
        f"{args.chunk_size}, {dtype.name} inputs; jax {jax.__version__}\n"
    )
    print("| op | code | schedule | program | temp MiB | while loops | fusions per loop body |")
    print("|---|---|---|---|---:|---:|---|")
    packages = [("now", gdn_jax)]
    if args.baseline:
        packages.insert(0, (args.baseline, import_revision(args.baseline)))
    for op in args.ops:
        inputs = abstract_inputs(op, batch, seq_len, heads, dim, dtype)
        for schedule in args.schedules:
            for label, package in packages:
                if not hasattr(package, OPS[op][0]):
                    continue
                for name, fn in programs(package, op, schedule, args.chunk_size).items():
                    compiled = tpu_compile.compile_for(fn, *inputs, device=device)
                    hlo = compiled.as_text()
                    temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
                    loops = len(BODY.findall(hlo))
                    fusions = ", ".join(map(str, fusions_per_body(hlo)))
                    print(
                        f"| {op} | {label} | {schedule} | {name} | {temp:.0f} | {loops} | "
                        f"{fusions} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
