"""A ``gpu_compile.Report`` as lines of text."""

from __future__ import annotations

MIB = 2**20


def report_lines(report) -> list[str]:
    """What one call launches, its memory and its Pallas kernels, one fact a line."""
    lines = [f"target: {report.target}"]
    if report.error is not None:
        lines.append(f"not built: {report.error}")
    else:
        launches = report.launches
        lines.append(f"launches per call: {launches.total} ({launches.top_level} at the top level)")
        for loop in launches.loops:
            trips = "unknown trips" if loop.trips is None else f"{loop.trips} trips"
            lines.append(f"  loop {loop.name}: {trips} x {loop.launches_per_trip} launches")
        fits = "fits" if report.peak_bytes <= report.device_memory else "does not fit"
        lines.append(
            f"memory: {report.argument_bytes / MIB:.1f} MiB arguments + "
            f"{report.output_bytes / MIB:.1f} outputs + {report.temp_bytes / MIB:.1f} temporaries"
            f" = {report.peak_bytes / MIB:.1f} MiB peak ({fits} the "
            f"{report.device_memory / 2**30:.1f} GiB)"
        )
    for kernel in report.kernels:
        lines.append(f"kernel {kernel.name} ({kernel.backend}): {kernel_summary(kernel)}")
    if not report.tuned:
        lines.append(
            "gemm tiles are XLA's defaults, not tuned on a device: launches and memory are the "
            "GPU's, the kernels' speed is not (load tuned ones with autotune_results=)"
        )
    return lines


def kernel_summary(kernel) -> str:
    def known(value, unit=""):
        return "?" if value is None else f"{value}{unit}"

    spills = (
        "?"
        if kernel.spill_stores is None
        else f"{kernel.spill_stores} B stored, {kernel.spill_loads} B loaded"
    )
    launch = "launchable" if kernel.launchable else f"NOT launchable: {kernel.problem}"
    summary = (
        f"{known(kernel.registers)} registers, spills {spills}, "
        f"{known(kernel.shared_memory, ' B')} shared memory, {known(kernel.threads)} threads, "
        f"{known(kernel.tensor_core_instructions)} tensor-core instructions"
    )
    if kernel.grid is not None:
        waves = "?" if kernel.waves is None else f"{kernel.waves:.2f}"
        summary += f", grid {kernel.grid}, {known(kernel.ctas_per_sm)} a SM, {waves} waves"
    if kernel.unfenced_stores is not None:
        summary += (
            f", {kernel.unfenced_stores} unfenced shared-memory stores, "
            f"{kernel.stall_cycles} stall cycles"
        )
    if kernel.modelled_us is not None:
        summary += (
            f", modelled {kernel.modelled_us:.1f} µs (a program's floor: stall path "
            f"{kernel.stall_path}, issue count {kernel.issue_count} cycles)"
        )
    elif kernel.model_problem is not None:
        summary += f", no model: {kernel.model_problem}"
    return f"{summary}; {launch}"
