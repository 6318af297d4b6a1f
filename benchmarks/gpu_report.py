"""What ``gpu_check.py`` measured, written as it goes: ``Report`` keeps the measurements and
writes ``gpu_check.json`` and the markdown table ``gpu_check.md`` after every item, so that a
run cut short keeps what it measured; ``environment`` records the versions it ran with, and
``autotune_record`` what XLA's autotune results file holds."""

from __future__ import annotations

import importlib.util
import json
import platform
import re
import subprocess
from pathlib import Path


class Report:
    """What the check measured, written to ``out`` (JSON and markdown) after every item."""

    def __init__(self, out: Path, environment: dict):
        self.out = out
        self.data = dict(environment=environment, ops=[], training={}, skipped=[])

    def add_op(self, row):
        self.data["ops"].append(row)
        self.write()

    def add_dry_run(self, row):
        self.data.setdefault("dry_run", []).append(row)
        self.write()

    def skip(self, what, why):
        print(f"skipped {what}: {why}", flush=True)
        self.data["skipped"].append(dict(what=what, why=why))
        self.write()

    def write(self):
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=1) + "\n")
        (self.out / "gpu_check.md").write_text(markdown(self.data))


def markdown(data) -> str:
    env = data["environment"]
    lines = [
        "| " + " · ".join(f"{k} {v}" for k, v in env.items()) + " |",
        "|---|",
        "",
        "| op | B×T | implementation | fwd ms | fwd+bwd ms | fwd+bwd kernel ms "
        "| fwd / fla | fwd+bwd / fla | fwd / jla | fwd+bwd / jla | fwd+bwd kernels / jla "
        "| peak fwd MiB | peak fwd+bwd MiB | worst error / bf16 tolerance |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]

    def number(value, form):
        return "-" if value is None else format(value, form)

    def ratio(row, peer, part, of=lambda part: part["ms"]):
        other = next(
            (r for r in data["ops"]
             if (r["op"], r["shape"], r["impl"]) == (row["op"], row["shape"], peer)), None,
        )  # fmt: skip
        if other is None or row is other or None in (of(row[part]), of(other[part])):
            return "-"
        return f"{of(row[part]) / of(other[part]):.2f}"

    for row in data["ops"]:
        errors = row.get("agreement", {})
        worst = "; ".join(
            f"vs {peer}: {max(f.values()):.2f} ({max(f, key=f.get)})" for peer, f in errors.items()
        )
        cells = [
            row["op"], row["shape"], row["impl"],
            number(row["fwd"]["ms"], ".2f"), number(row["fwd+bwd"]["ms"], ".2f"),
            number(kernel_ms(row["fwd+bwd"]), ".2f"),
            ratio(row, "fla", "fwd"), ratio(row, "fla", "fwd+bwd"),
            ratio(row, "jla", "fwd"), ratio(row, "jla", "fwd+bwd"),
            ratio(row, "jla", "fwd+bwd", kernel_ms),
            *(number(row[p]["peak_bytes"] and row[p]["peak_bytes"] / 2**20, ".1f")
              for p in ("fwd", "fwd+bwd")),
            worst or "-",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines += _kernel_lines(data["ops"]) + _stage_table(data["ops"])
    if data.get("dry_run"):
        lines += ["", "Dry run (each program built and traced at these shapes, nothing run):", ""]
        lines += [
            f"- {r['op']} {r['shape']} {r['impl']}: "
            + ", ".join(
                f"{p} {r[p]['equations']} equations in {r[p]['trace_s']} s"
                for p in ("fwd", "fwd+bwd")
            )  # fmt: skip
            for r in data["dry_run"]
        ]
    training = data["training"]
    if "step_ms" in training:
        lines += ["", f"MQAR training step ({training['step_shape']}): {training['step_ms']:.2f} ms "
                  f"(median of {training['repeats']}; first call {training['first_call_s']:.1f} s)"]  # fmt: skip
    if "train_py" in training:
        run = training["train_py"]
        lines += ["", f"`python train.py`: {run['wall_s']:.1f} s wall, stopped at step "
                  f"{run['final_step']} ({run['reason']}), held-out accuracy {run['eval_accuracy']}"]  # fmt: skip
    if "autotune" in data:
        lines += ["", _autotune_line(data["autotune"])]
    if data["skipped"]:
        lines += ["", "Skipped:", *(f"- {s['what']}: {s['why']}" for s in data["skipped"])]
    return "\n".join(lines) + "\n"


def kernel_ms(part: dict):
    """The device time per call the profiler read (``stage_profile.kernel_times``), or
    None."""
    return part.get("kernels", {}).get("ms_per_call")


def _kernel_lines(rows) -> list[str]:
    """Each training step's costliest kernels on the device, from the profiler."""
    read = [r for r in rows if "kernels" in r["fwd+bwd"]]
    if not read:
        return []
    lines = ["", "Training step's costliest kernels (ms per call, launches per call; the "
             "profiler's device time):", ""]  # fmt: skip
    for row in read:
        kernels = row["fwd+bwd"]["kernels"]
        if "error" in kernels:
            lines.append(f"- {row['op']} {row['shape']} {row['impl']}: {kernels['error']}")
            continue
        top = "; ".join(
            f"{k['name'][:60]} {k['ms_per_call']:.3f} (x{k['per_call']:g})"
            for k in kernels["top"][:6]
        )
        lines.append(
            f"- {row['op']} {row['shape']} {row['impl']}: {kernels['ms_per_call']:.3f} ms in "
            f"{kernels['launches_per_call']:g} launches ({kernels['where']}): {top}"
        )
    return lines


def _stage_table(rows) -> list[str]:
    """Where each profiled forward+backward spends its time: ms per call by stage (the
    chunked form's, the kernels', ``other``: those found in any row) and its costliest
    instruction."""
    from stage_profile import OTHER, ordered

    profiled = [r for r in rows if "stages" in r["fwd+bwd"]]
    if not profiled:
        return []
    found = {s for r in profiled for s in r["fwd+bwd"]["stages"].get("ms_per_call", {})}
    columns = ordered(found) or [OTHER]
    lines = [
        "",
        "Forward+backward by stage (ms per call, from JAX's profiler; `stage_profile.py`):",
        "",
        "| op | B×T | implementation | " + " | ".join(columns) + " | costliest op |",
        "|---|---|---|" + "---:|" * len(columns) + "---|",
    ]
    for row in profiled:
        stages = row["fwd+bwd"]["stages"]
        if "error" in stages:
            cells = [f"{stages['error']} ({stages.get('where', '')})"]
            cells += [""] * (len(columns) - 1)
            lines.append(
                f"| {row['op']} | {row['shape']} | {row['impl']} | " + " | ".join(cells) + " | |"
            )
            continue
        ms = stages["ms_per_call"]
        top = stages["top"][0] if stages["top"] else None
        costliest = (
            "-" if top is None else f"{top['op']} ({top['stage']}, {top['ms_per_call']:.2f})"
        )
        cells = [f"{ms[s]:.2f}" if s in ms else "-" for s in columns]
        lines.append(
            f"| {row['op']} | {row['shape']} | {row['impl']} | "
            + " | ".join(cells)
            + f" | {costliest} |"
        )
    return lines


def autotune_record(path: Path) -> dict:
    """What XLA's autotune results file at ``path`` holds: its size and, written as text
    (``.textproto``), how many results and for which devices (the GPU's description, part of
    every result's key: a compile for a target of other figures finds none of them)."""
    if not path.is_file():
        # On a GPU, XLA writes the file at every compile that has the option, tuned or not.
        return dict(file=path.name, written=False, why="no program was compiled for a GPU")
    record = dict(file=path.name, written=True, bytes=path.stat().st_size)
    if path.suffix in (".textproto", ".txt", ".pbtxt", ".prototxt"):
        text = path.read_text()
        record["results"] = len(re.findall(r"^results \{", text, re.M))
        record["devices"] = sorted(set(re.findall(r'^\s*device: "(.*)"$', text, re.M)))
    return record


def _autotune_line(record: dict) -> str:
    if not record["written"]:
        return f"XLA autotune results: none written to `{record['file']}` ({record['why']})"
    held = f"{record['bytes']:,} bytes"
    if "results" in record:
        held = f"{record['results']} results for {'; '.join(record['devices']) or 'no device'}"
    return f"XLA autotune results: `{record['file']}`, {held}"


def environment() -> dict:
    import jax
    import jaxlib

    env = dict(
        device=f"{len(jax.devices())} x {jax.devices()[0].device_kind}",
        jax=jax.__version__,
        jaxlib=jaxlib.__version__,
        python=platform.python_version(),
    )
    for package in ("torch", "triton", "fla", "jla", "flax"):
        if importlib.util.find_spec(package) is not None:
            try:
                env[package] = __import__(package).__version__
            except Exception as error:  # a broken install is reported, not fatal
                env[package] = f"unimportable: {type(error).__name__}: {error}"
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True, timeout=20,
        ).stdout.strip()  # fmt: skip
        env["driver"] = driver
    except (OSError, subprocess.SubprocessError):
        pass
    return env
