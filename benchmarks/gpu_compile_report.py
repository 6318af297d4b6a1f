"""What every rule's op launches and needs on an H100 or H200, compiled on this host without
a GPU (``gdn_jax.gpu_compile``): for each rule x implementation x schedule, at the shapes of
the GPU check, the forward's and the forward+backward's launches per call, the loops among
them, the forward+backward's peak memory (arguments + outputs + temporaries), and each Pallas
kernel's registers, spills, shared memory and tensor-core instructions.

    pip install -e ".[gpu-compile]"
    JAX_PLATFORMS=cpu python benchmarks/gpu_compile_report.py --out /tmp/gpu_compile.md

A program is q, k, v in bfloat16 and the gates in float32 (``use_qk_l2norm=True``), and its
forward+backward a training step: ``value_and_grad`` of ``sum(o * do)`` for every input. The
loss's value is what keeps each side's forward kernel in the program: from ``grad`` alone XLA
drops a forward whose output no backward reads (jla's, which recomputes its states). With jax-linear-attention
installed (``pip install jax-linear-attention``) its Mosaic GPU ops are compiled beside them
as ``jla``. Each program compiles in a child process, so that one the compiler cannot build
(or that crashes it) is a row that says so.

Without a GPU, XLA keeps its gemms' default tilings. ``--autotune-results FILE`` compiles with
the ones it measured on a GPU: the file ``benchmarks/gpu_run.sh`` brings back
(``xla_autotune.textproto``). XLA finds a result only for a GPU described as the target is (the
description is part of each result's key), so the report prints the file's descriptions beside
the target's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

SHAPES = [(4, 4096), (1, 32768)]  # (B, T) at H = 16 heads of K = V = 128, chunks of 64
HEADS, DIM, CHUNK = 16, 128, 64
# Each rule's op in gdn_jax, its name and gate keywords in jax-linear-attention, and the
# keyword options of gdn_jax's op.
RULES = {
    "gdn": ("gated_delta_rule", ("gated_deltanet", ("g", "beta")), {}),
    "kda": ("kda", ("kda", ("g", "beta")), {}),
    "gdn2": ("gdn2", ("gdn2", ("g", "b", "w")), {}),
    "gdp": ("gated_delta_product", None, {"num_householder": 2}),
    "simple_gla": ("simple_gla", None, {}),
    "gla": ("gated_linear_attention", None, {}),
}
# (impl, schedule) of gdn_jax's forms (a kernel impl for the rules that have it); "jla" is
# jax-linear-attention's Mosaic GPU op.
FORMS = [
    ("chunked", "hoisted"),
    ("chunked", "associative"),
    ("chunked", "in_scan"),
    ("mosaic_gpu", ""),
    ("jla", ""),
]
CHILD_TIMEOUT_S = 1800


def program(rule_key: str, impl: str, schedule: str, batch: int, seq_len: int, backward: bool):
    """The jitted function and its abstract arguments."""
    import jax
    import jax.numpy as jnp

    import gdn_jax
    from gdn_jax.ops import RULES as OPS

    op_name, jla_op, options = RULES[rule_key]
    rule = OPS[op_name]
    steps = options.get("num_householder", 1)
    sizes = {None: (), "K": (DIM,), "V": (DIM,)}

    def shape(per_step, channels):
        return (batch, seq_len * (steps if per_step else 1), HEADS, *sizes[channels])

    bf16, f32 = jnp.bfloat16, jnp.float32
    args = [
        jax.ShapeDtypeStruct(shape(False, "K"), bf16),
        jax.ShapeDtypeStruct(shape(steps > 1, "K"), bf16),
        jax.ShapeDtypeStruct(shape(steps > 1, "V"), bf16),
        *(jax.ShapeDtypeStruct(shape(g.per_step, g.channels), f32) for g in rule.gates),
    ]

    if impl == "jla":
        from jla import ops as jla_ops

        as_if_on_hopper()
        name, keywords = jla_op

        def forward(q, k, v, *gates):
            kwargs = dict(zip(keywords, gates, strict=True))
            return jla_ops.linear_attention(
                name, q, k, v, impl="mosaic_gpu", use_qk_l2norm=True, output_final_state=True,
                **kwargs,
            )[0]  # fmt: skip
    else:
        op = getattr(gdn_jax, op_name)
        kwargs = dict(options, impl=impl, chunk_size=CHUNK, use_qk_l2norm=True)
        if impl == "chunked":
            kwargs["schedule"] = schedule

        def forward(q, k, v, *gates):
            return op(q, k, v, *gates, **kwargs)[0]

    if not backward:
        return forward, args

    def loss(*arrays):
        *inputs, do = arrays
        return jnp.sum(forward(*inputs).astype(jnp.float32) * do.astype(jnp.float32))

    grad = jax.value_and_grad(loss, argnums=tuple(range(len(args))))
    do = jax.ShapeDtypeStruct((batch, seq_len, HEADS, DIM), bf16)
    return grad, [*args, do]


def as_if_on_hopper():
    """jax-linear-attention takes its kernels only when this process's first device is an
    sm_90 GPU; compiled for an H200 from a CPU host, it is told so."""
    import importlib
    import pkgutil

    import jla.ops.mosaic_gpu as kernels

    for found in pkgutil.walk_packages(kernels.__path__, f"{kernels.__name__}."):
        importlib.import_module(found.name)
    for name, module in list(sys.modules.items()):
        if name.startswith("jla.") and hasattr(module, "is_hopper"):
            module.is_hopper = lambda: True


def measure(rule_key, impl, schedule, batch, seq_len, target, autotune_results=None) -> dict:
    """One row: both programs' reports (in this process)."""
    from gdn_jax import gpu_compile
    from gdn_jax.ops.mosaic.limits import run_time_trips

    row = dict(rule=rule_key, impl=impl, schedule=schedule, shape=f"{batch}x{seq_len}")
    trips = run_time_trips(seq_len // CHUNK, DIM, DIM)
    for name, backward in (("fwd", False), ("fwd_bwd", True)):
        fn, args = program(rule_key, impl, schedule, batch, seq_len, backward)
        start = time.perf_counter()
        report = gpu_compile.report(
            fn, *args, target=target, autotune_results=autotune_results, open_trips=trips
        )
        row[f"{name}_compile_s"] = round(time.perf_counter() - start, 1)
        row[name] = summary(report)
    return row


def summary(report) -> dict:
    launches = report.launches
    return dict(
        error=report.error,
        launches=None if launches is None else launches.total,
        loops=[] if launches is None else [[lp.trips, lp.launches_per_trip] for lp in launches.loops],
        peak_mib=None if report.peak_bytes is None else round(report.peak_bytes / 2**20, 1),
        temp_mib=None if report.temp_bytes is None else round(report.temp_bytes / 2**20, 1),
        kernels=[
            dict(name=k.name, backend=k.backend, registers=k.registers, spill_stores=k.spill_stores,
                 spill_loads=k.spill_loads, shared_memory=k.shared_memory,
                 tensor_core_instructions=k.tensor_core_instructions, problem=k.problem,
                 grid=k.grid, ctas_per_sm=k.ctas_per_sm, waves=k.waves,
                 unfenced_stores=k.unfenced_stores, stall_cycles=k.stall_cycles,
                 stall_path=k.stall_path, issue_count=k.issue_count, modelled_us=k.modelled_us,
                 model_problem=k.model_problem)
            for k in report.kernels
        ],
    )  # fmt: skip


def in_child(spec: dict) -> dict:
    """``measure`` in a child process: a crash or a refusal is that row's error."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    command = [sys.executable, __file__, "--child", json.dumps(spec)]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=CHILD_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return dict(spec, error=f"no result within {CHILD_TIMEOUT_S} s")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return dict(spec, error=f"exit {done.returncode}: {tail[:300]}")
    return json.loads(lines[-1])


def cell_kernels(part: dict) -> str:
    cells = []
    for k in part.get("kernels", []):
        state = "ok" if k["problem"] is None else f"NOT launchable ({k['problem']})"
        waves = "?" if k.get("waves") is None else f"{k['waves']:.1f}"
        cells.append(
            f"{k['name']}: {k['registers']} regs, spills {k['spill_stores']}/{k['spill_loads']} B, "
            f"{k['shared_memory']} B smem, {k['tensor_core_instructions']} tc, grid "
            f"{k.get('grid')}, {k.get('ctas_per_sm')}/SM, {waves} waves, "
            f"{k.get('unfenced_stores')} unfenced, {k.get('stall_cycles')} stall cycles; {state}"
        )
    return "; ".join(cells)


def table(rows) -> list[str]:
    lines = [
        "| rule | impl | schedule | B x T | fwd launches | fwd+bwd launches | fwd+bwd loops "
        "(trips x launches) | fwd+bwd peak MiB | Pallas kernels |",
        "|---|---|---|---|---:|---:|---|---:|---|",
    ]
    for row in rows:
        head = f"| {row['rule']} | {row['impl']} | {row['schedule'] or '-'} | {row['shape']} |"
        if "error" in row:
            lines.append(f"{head} | | | | | not measured: {row['error']} |")
            continue
        fwd, both = row["fwd"], row["fwd_bwd"]
        if both["error"]:
            lines.append(
                f"{head} {fwd['launches']} | not built | | | {both['error']}; {cell_kernels(both)} |"
            )
            continue
        loops = ", ".join(f"{t}x{n}" for t, n in both["loops"]) or "none"
        kernels = cell_kernels(both) or "-"
        lines.append(
            f"{head} {fwd['launches']} | {both['launches']} | {loops} | {both['peak_mib']:,.0f} "
            f"| {kernels} |"
        )
    return lines


def modelled(part: dict) -> float | None:
    """A program's modelled Pallas kernel time (µs), None if a kernel's model is missing."""
    times = [k.get("modelled_us") for k in part.get("kernels", [])]
    return None if not times or None in times else sum(times)


def model_tables(rows) -> list[str]:
    """Each Mosaic kernel's model (fwd+bwd) and each rule's modelled time beside jla's."""
    lines = [
        "| rule | form | B x T | kernel | grid | CTAs a SM | waves | stall path | issue count "
        "| modelled µs |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        for k in row.get("fwd_bwd", {}).get("kernels", []):
            if k["backend"] != "mosaic_gpu":
                continue
            us = "-" if k.get("modelled_us") is None else f"{k['modelled_us']:,.1f}"
            waves = "-" if k.get("waves") is None else f"{k['waves']:.1f}"
            path, issue = (
                "-" if k.get(f) is None else f"{k[f]:,}" for f in ("stall_path", "issue_count")
            )
            name = re.sub(r"_\d+$", "", k["name"])
            lines.append(
                f"| {row['rule']} | {row['impl']} | {row['shape']} | `{name}` | {k['grid']} | "
                f"{k['ctas_per_sm']} | {waves} | {path} | {issue} | {us}"
                + (f" ({k['model_problem']})" if k.get("model_problem") else "")
                + " |"
            )
    lines += [
        "",
        "| rule | B x T | `mosaic_gpu` modelled µs | jla modelled µs | ratio | launches "
        "(`mosaic_gpu` / jla) | peak MiB (`mosaic_gpu` / jla) |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    by_key = {(r["rule"], r["impl"], r["shape"]): r.get("fwd_bwd") for r in rows}
    for (rule, impl, shape), ours in by_key.items():
        theirs = by_key.get((rule, "jla", shape))
        if impl != "mosaic_gpu" or not ours or not theirs:
            continue
        mine, peer = modelled(ours), modelled(theirs)
        ratio = "-" if None in (mine, peer) else f"{mine / peer:.2f}"

        def fmt(x):
            return "-" if x is None else f"{x:,.1f}"

        lines.append(
            f"| {rule} | {shape} | {fmt(mine)} | {fmt(peer)} | {ratio} | {ours['launches']} / "
            f"{theirs['launches']} | {ours['peak_mib']:,.0f} / {theirs['peak_mib']:,.0f} |"
        )
    return lines


def target_key(target: str) -> str:
    """The target's description as XLA's autotune keys write a GPU's (compute capability,
    cores, clock, memory bandwidth in GB/s rounded, L2 in MiB)."""
    from gdn_jax import gpu_compile

    config = gpu_compile.target_config(target)

    def field(name, default="0"):
        found = re.search(rf"^\s*{name}: ([\d.]+)", config, re.M)
        return float(found.group(1) if found else default)

    capability = config.split("cuda_compute_capability {")[1].split("}")[0]
    major, minor = (re.search(rf"{n}: (\d+)", capability) for n in ("major", "minor"))
    return (
        f"CUDA: {major.group(1) if major else 0}.{minor.group(1) if minor else 0}, "
        f"Cores: {field('core_count'):g}, GPU clock: {field('clock_rate_ghz'):g} GHz, "
        f"Memory bandwidth: {round(field('memory_bandwidth') / 1e9):g} GB/s, "
        f"L2 cache: {field('l2_cache_size') / 2**20:g} MB"
    )


def autotune_note(path: Path, target: str) -> str:
    """What the autotune results file holds, beside the target's description."""
    from gpu_report import autotune_record

    record = autotune_record(path)
    if "devices" in record:
        devices = ", ".join(f"'{d}'" for d in record["devices"]) or "no device"
        held = f"{record['results']} results for {devices}"
    else:
        held = f"{record['bytes']:,} bytes (binary: its devices not read)"
    return (
        f"XLA autotune results from {path}: {held}; the {target} target is "
        f"'{target_key(target)}' (a result is found only where these agree)"
    )


def main(argv=None) -> int:
    from gdn_jax.ops import RULES as OPS
    from gdn_jax.ops.checks import KERNEL_IMPLS
    from gdn_jax.ops.dispatch import kernel_of

    parser = argparse.ArgumentParser(
        prog="gpu_compile_report.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rules", default="gdn,kda,gdn2,gdp,simple_gla,gla")
    parser.add_argument(
        "--forms",
        default=",".join(f"{i}:{s}" if s else i for i, s in FORMS),
        help="IMPL[:SCHEDULE],... (chunked:hoisted, chunked:associative, jla)",
    )
    parser.add_argument("--shapes", default=",".join(f"{b}x{t}" for b, t in SHAPES))
    parser.add_argument("--target", default="h200", choices=("h100", "h200"))
    parser.add_argument("--out", type=Path, help="also write the table (markdown) here")
    parser.add_argument("--json", type=Path, help="also write every row (JSON lines) here")
    parser.add_argument(
        "--autotune-results", type=Path, metavar="FILE",
        help="compile with XLA's autotune results from a GPU (gpu_run.sh's xla_autotune.textproto)",
    )  # fmt: skip
    parser.add_argument(
        "--tables-from", type=Path, metavar="JSON",
        help="print the tables of the rows a --json run wrote, compiling nothing",
    )  # fmt: skip
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tables_from is not None:
        rows = [json.loads(line) for line in args.tables_from.read_text().splitlines() if line]
        print("\n".join([*table(rows), "", *model_tables(rows)]))
        return 0
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(measure(**spec)))
        return 0
    if args.autotune_results is not None and not args.autotune_results.is_file():
        parser.error(f"--autotune-results {str(args.autotune_results)!r} is not a file")
    forms = [tuple((f.split(":") + [""])[:2]) for f in args.forms.split(",")]
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    have_jla = importlib.util.find_spec("jla") is not None
    tuned, note = None, []
    if args.autotune_results is not None:
        tuned = str(args.autotune_results.resolve())
        note = [autotune_note(args.autotune_results, args.target), ""]
        print(note[0], flush=True)
    rows = []
    for rule_key in args.rules.split(","):
        for impl, schedule in forms:
            if impl == "jla" and (not have_jla or RULES[rule_key][1] is None):
                continue
            if impl in KERNEL_IMPLS and kernel_of(OPS[RULES[rule_key][0]], impl) is None:
                continue
            for batch, seq_len in shapes:
                spec = dict(rule_key=rule_key, impl=impl, schedule=schedule, batch=batch,
                            seq_len=seq_len, target=args.target, autotune_results=tuned)  # fmt: skip
                row = in_child(spec)
                row.update(rule=rule_key, impl=impl, schedule=schedule, shape=f"{batch}x{seq_len}")
                rows.append(row)
                print(table([row])[-1], flush=True)
                if args.json:
                    with args.json.open("a") as f:
                        f.write(json.dumps(row) + "\n")
    text = "\n".join([*note, *table(rows), "", *model_tables(rows)])
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
