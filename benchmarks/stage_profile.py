"""Where a compiled JAX program's time goes, stage by stage, from JAX's profiler.

    stages = stage_profile.measure(compiled, args, calls=3)

runs ``compiled(*args)`` ``calls`` times under ``jax.profiler.trace``, takes the trace's op
events (each names the HLO instruction it ran, ``hlo_op``), and gives each instruction the
stage whose named scope its ``op_name`` metadata holds: the chunked form's
(``gdn_jax.ops.chunked.stages``), else the Mosaic GPU kernel's it runs in (each kernel is the scope of
its name, ``gdn_mosaic_*``; interpreted off a GPU, every instruction of its interpreter). An
instruction in none of them is ``"other"``: the layouts, the norms of q and k, the gates,
casts and pads around the stages.

Time is each event's own time, its nested events taken out (a loop's event on the CPU holds
its body's). On a GPU the device's "XLA Ops" line is read where the trace has it, else its
kernel events; on the CPU the host's events. A trace with no op events of the program says
so, with the trace's thread names, rather than a table of zeros.
"""

from __future__ import annotations

import collections
import gzip
import json
import re
import tempfile
from pathlib import Path

from gdn_jax.ops.chunked import stages as stage_names

STAGES = stage_names.ALL
OTHER = "other"
# A Mosaic GPU kernel of gdn_jax's: the scope of its name (ops/mosaic/scalar/*.py).
KERNEL = re.compile(r"gdn_mosaic_\w+")
# One instruction of HLO text: its name and its metadata's op_name.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?op_name=\"([^\"]*)\"")


def op_stages(hlo_text: str) -> dict[str, str]:
    """Each instruction with an ``op_name`` in the HLO text: its stage, the outermost named
    scope of ``STAGES`` on its path (the backward's ``factors_again`` holds ``factors``), else
    the kernel's whose scope it is in, else ``OTHER``."""
    stages = {}
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if match:
            names = re.findall(r"\w+", match.group(2))
            stage = next((n for n in names if n in STAGES), None)
            stage = stage or next((n for n in names if KERNEL.fullmatch(n)), OTHER)
            stages[match.group(1)] = stage
    return stages


def ordered(stages) -> list[str]:
    """``stages`` in the order of a table's columns: the chunked form's, the kernels'
    (by name), then ``OTHER``."""
    found = set(stages)
    kernels = sorted(found - {*STAGES, OTHER})
    return [s for s in STAGES if s in found] + kernels + [OTHER] * (OTHER in found)


def _trace_events(folder: Path) -> list[dict]:
    traces = sorted(folder.rglob("perfetto_trace.json.gz")) or sorted(folder.rglob("*.json.gz"))
    if not traces:
        raise FileNotFoundError(f"the profiler wrote no trace under {folder}")
    with gzip.open(traces[-1], "rt") as file:
        data = json.load(file)
    return data["traceEvents"] if isinstance(data, dict) else data


def _self_times(events: list[dict]) -> list[tuple[dict, float]]:
    """Each complete event with its own time (µs): its duration less that of the events
    nested in it on the same thread."""
    by_thread = collections.defaultdict(list)
    for event in events:
        by_thread[event["pid"], event["tid"]].append(event)
    out = []
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [event, end, own time]
        for event in thread:
            while stack and stack[-1][1] <= event["ts"]:
                done = stack.pop()
                out.append((done[0], done[2]))
            if stack:
                stack[-1][2] -= event["dur"]
            stack.append([event, event["ts"] + event["dur"], event["dur"]])
        out.extend((e, own) for e, _, own in stack)
    return out


def op_events(events: list[dict]) -> tuple[str, list[dict]]:
    """``(where, events)``: the complete events that ran an HLO instruction, from the devices'
    lines where the trace has devices ("XLA Ops" where there is such a line), else the
    host's."""
    meta = [e for e in events if e.get("ph") == "M"]
    processes = {e["pid"]: e["args"]["name"] for e in meta if e.get("name") == "process_name"}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in meta if e.get("name") == "thread_name"
    }
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    devices = {pid for pid, name in processes.items() if name.startswith("/device:")}
    if devices:
        on_devices = [e for e in complete if e["pid"] in devices]
        xla_ops = [e for e in on_devices if threads.get((e["pid"], e["tid"])) == "XLA Ops"]
        if xla_ops:
            return "device, XLA Ops line", xla_ops
        return "device, kernels", [e for e in on_devices if "hlo_op" in e.get("args", {})]
    return "host", [e for e in complete if "hlo_op" in e.get("args", {})]


def attribute(events: list[dict], stages: dict[str, str], calls: int, top: int = 10) -> dict:
    """Milliseconds per call by stage, and the ``top`` instructions by time."""
    where, ops = op_events(events)
    per_stage: dict[str, float] = collections.defaultdict(float)
    per_op: dict[str, float] = collections.defaultdict(float)
    unknown = 0.0
    for event, own in _self_times(ops):
        name = event.get("args", {}).get("hlo_op") or event["name"]
        name = name.lstrip("%").split(" ")[0]
        if name not in stages:
            unknown += own
            continue
        per_stage[stages[name]] += own
        per_op[name] += own
    if not per_op:
        names = sorted({str(e.get("args", {}).get("name")) for e in events if e.get("ph") == "M"})
        return dict(where=where, error="no op events of this program in the trace", threads=names)
    ms = 1e-3 / calls
    ranked = sorted(per_op.items(), key=lambda item: -item[1])[:top]
    return dict(
        where=where,
        calls=calls,
        ms_per_call={s: per_stage[s] * ms for s in ordered(per_stage)},
        unmatched_ms_per_call=unknown * ms,
        top=[dict(op=op, stage=stages[op], ms_per_call=t * ms) for op, t in ranked],
    )


def kernel_events(events: list[dict]) -> tuple[str, list[tuple[str, float]]]:
    """``(where, [(name, µs)])``: what ran on the device, each kernel, copy and memset on a
    device's stream lines by its name and duration (what the GPU spent, whatever launched
    it: XLA, a Mosaic GPU or Triton kernel, a library); with no device in the trace, each
    HLO instruction's own time on the host."""
    meta = [e for e in events if e.get("ph") == "M"]
    processes = {e["pid"]: e["args"]["name"] for e in meta if e.get("name") == "process_name"}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in meta if e.get("name") == "thread_name"
    }
    devices = {pid for pid, name in processes.items() if name.startswith("/device:")}
    streams = [
        e
        for e in events
        if e.get("ph") == "X" and e["pid"] in devices
        and threads.get((e["pid"], e["tid"]), "").startswith("Stream")
    ]  # fmt: skip
    if streams:
        return "device streams", [(e["name"], float(e["dur"])) for e in streams]
    where, ops = op_events(events)
    named = [((e.get("args", {}).get("hlo_op") or e["name"]), own) for e, own in _self_times(ops)]
    return where, named


def kernel_times(events: list[dict], calls: int, top: int = 12) -> dict:
    """Device time per call from the profiler: the sum over ``kernel_events``, and the
    ``top`` kernels by summed time with their launches per call."""
    where, named = kernel_events(events)
    total: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter = collections.Counter()
    for name, us in named:
        total[name] += us
        count[name] += 1
    ms = 1e-3 / calls
    ranked = sorted(total.items(), key=lambda item: -item[1])[:top]
    return dict(
        where=where,
        calls=calls,
        ms_per_call=sum(total.values()) * ms,
        launches_per_call=sum(count.values()) / calls,
        top=[dict(name=n, ms_per_call=t * ms, per_call=count[n] / calls) for n, t in ranked],
    )


def trace(compiled, args, calls: int = 3) -> list[dict]:
    """The profiler's events over ``calls`` runs of ``compiled`` on ``args``."""
    import jax

    jax.block_until_ready(compiled(*args))  # nothing of a first call's set-up in the trace
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            for _ in range(calls):
                jax.block_until_ready(compiled(*args))
        return _trace_events(Path(folder))


def measure(compiled, args, calls: int = 3) -> dict:
    """Profile ``calls`` runs of ``compiled`` (a ``jax.stages.Compiled``) on ``args``."""
    return attribute(trace(compiled, args, calls), op_stages(compiled.as_text()), calls)
