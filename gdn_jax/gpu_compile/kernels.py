"""The Mosaic GPU kernels of a program compiled for a GPU (gdn_jax's, and jax-linear-attention's
in the benchmark that compares them): registers, spills, shared memory, tensor-core
instructions, and whether one block of each can launch.

Mosaic GPU kernels are compiled to machine code when JAX lowers them; with
``MOSAIC_GPU_DUMP_TO`` and ``MOSAIC_GPU_DUMP_PTXAS`` set at that moment, each kernel leaves its
PTX, ptxas's report and its MLIR (whose launch states the grid and the dynamic shared memory)
in the folder. The tensor-core count is of the PTX's ``wgmma.mma_async`` and ``mma.sync``
instructions, as written, not as executed.

A Mosaic GPU kernel's machine code (SASS, with its control codes: ``MOSAIC_GPU_DUMP_SASS_CTRL``)
is read for what interpret mode cannot show: a shared-memory store from registers that a
wgmma or a TMA store reads through the async proxy with no proxy fence between them
(``unfenced_stores``), and the stall counts of its instructions (``stall_cycles``). Its
launch grid comes from its MLIR, and with the GPU's figures gives the programs a streaming
multiprocessor holds at once and the waves over the GPU. ``sass.py`` models its time from
the same code: one program's issue floor along its path (loops by their trips), a wave's, and
the waves' (``modelled_us``; a model, not a timing).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from pathlib import Path

from gdn_jax.gpu_compile import sass as machine_code

_TENSOR_CORE = re.compile(r"\b(?:wgmma\.mma_async|mma\.sync)\b")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One Pallas kernel of a program: its backend, ptxas's registers (per thread) and spill
    bytes, its shared memory per block, its threads per block, and its tensor-core
    instructions. ``problem`` says why a block cannot launch (None: it can)."""

    name: str
    backend: str
    registers: int | None
    spill_stores: int | None
    spill_loads: int | None
    shared_memory: int | None
    threads: int | None
    tensor_core_instructions: int | None
    problem: str | None = None
    grid: tuple[int, int, int] | None = None
    unfenced_stores: int | None = None
    stall_cycles: int | None = None
    ctas_per_sm: int | None = None
    waves: float | None = None
    stall_path: int | None = None
    issue_count: int | None = None
    modelled_us: float | None = None
    model_problem: str | None = None

    @property
    def launchable(self) -> bool:
        return self.problem is None


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one block may use on the target (its ``gpu_device_info``)."""

    shared_memory: int
    registers: int
    shared_memory_per_sm: int = 0
    registers_per_sm: int = 0
    sms: int = 0
    grid: tuple[int, int, int] = (2**31 - 1, 65_535, 65_535)
    clock_ghz: float = 0.0

    @classmethod
    def of(cls, target_config: str) -> Limits:
        def field(name):
            return int(re.search(rf"\b{name}: (\d+)", target_config)[1])

        return cls(
            field("shared_memory_per_block_optin"),
            field("registers_per_block_limit"),
            field("shared_memory_per_core"),
            field("registers_per_core_limit"),
            field("core_count"),
            tuple(field(f"block_dim_limit_{axis}") for axis in "xyz"),
            float(re.search(r"\bclock_rate_ghz: ([\d.]+)", target_config)[1]),
        )

    def occupancy(self, shared_memory, registers, threads, grid) -> tuple[int | None, float | None]:
        """``(ctas_per_sm, waves)``: the programs one SM holds at once (by shared memory and
        registers; a block reserves 1 KiB of shared memory beside its own) and the grid's
        programs over all SMs at that many each."""
        if None in (shared_memory, registers, threads) or not self.sms:
            return None, None
        by_smem = self.shared_memory_per_sm // (shared_memory + 1024)
        by_registers = self.registers_per_sm // max(registers * threads, 1)
        ctas = min(by_smem, by_registers, 32)
        if grid is None or ctas == 0:
            return ctas, None
        return ctas, _product(grid) / (ctas * self.sms)

    def modelled_us(self, floor: machine_code.Floor, ctas: int | None, grid) -> float | None:
        """The kernel's time by the model: its programs in waves of ``ctas`` a streaming
        multiprocessor (fewer where the grid leaves an SM fewer), each wave at its floor."""
        if None in (ctas, grid) or not (self.sms and self.clock_ghz) or ctas == 0:
            return None
        per_sm = math.ceil(_product(grid) / self.sms)
        together = min(ctas, per_sm)
        cycles = math.ceil(per_sm / together) * floor.of_wave(together)
        return cycles / (self.clock_ghz * 1e3)

    def grid_problem(self, grid) -> str | None:
        if grid is None or all(g <= most for g, most in zip(grid, self.grid, strict=True)):
            return None
        return f"grid {grid} over CUDA's launch limits {self.grid} (x, y, z)"

    def problem(self, shared_memory, registers, threads) -> str | None:
        if shared_memory is not None and shared_memory > self.shared_memory:
            return (
                f"{shared_memory} B of shared memory, over the {self.shared_memory} B a block has"
            )
        if None not in (registers, threads) and registers * threads > self.registers:
            return (
                f"{registers} registers x {threads} threads, over the {self.registers} a block has"
            )
        return None


def ptxas_report(text: str) -> dict[str, dict[str, int]]:
    """Per entry function of a ``ptxas -v`` report: registers, spill stores and loads, static
    shared memory."""
    entries, name = {}, None
    for line in text.splitlines():
        if found := re.search(r"Compiling entry function '([^']+)'", line):
            name = found[1]
            entries[name] = {"registers": 0, "spill_stores": 0, "spill_loads": 0, "smem": 0}
        elif name is None:
            continue
        elif found := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
            entries[name].update(spill_stores=int(found[1]), spill_loads=int(found[2]))
        elif found := re.search(r"Used (\d+) registers", line):
            entries[name]["registers"] = int(found[1])
            smem = re.search(r"(\d+) bytes smem", line)
            entries[name]["smem"] = int(smem[1]) if smem else 0
    return entries


def mosaic_kernels(
    folder: Path, limits: Limits, open_trips: Mapping[str, tuple[int, ...]] | None = None
) -> list[Kernel]:
    """The Mosaic GPU kernels dumped into ``folder`` (``MOSAIC_GPU_DUMP_TO``).
    ``open_trips``: by kernel name, the trips of the loops whose bounds it reads at run time
    (``sass.floor``); without them such a kernel's model says so (``model_problem``)."""
    kernels = []
    for report in sorted(Path(folder).glob("*.ptxas")):
        stem = report.name.removesuffix(".ptxas")
        entries = ptxas_report(report.read_text())
        if not entries:
            continue
        used = next(iter(entries.values()))
        ptx = _text(folder / f"{stem}.ptx")
        dynamic = _dynamic_shared_memory(folder, stem)
        shared = used["smem"] + (dynamic or 0)
        threads = re.search(r"\.maxntid (\d+), (\d+), (\d+)", ptx)
        threads = int(threads[1]) * int(threads[2]) * int(threads[3]) if threads else None
        grid = _launch_grid(folder, stem)
        sass = folder / f"{stem}.sass_ctrl"
        sass = sass.read_text() if sass.exists() else None
        ctas, waves = limits.occupancy(shared, used["registers"], threads, grid)
        problem = limits.problem(shared, used["registers"], threads) or limits.grid_problem(grid)
        floor, model_problem = None, "no SASS dumped"
        if sass is not None:
            trips = (open_trips or {}).get(re.sub(r"_\d+$", "", stem), ())
            try:
                floor, model_problem = machine_code.floor(sass, tuple(trips)), None
            except machine_code.OpenLoops as error:
                model_problem = str(error)
        kernels.append(
            Kernel(
                name=stem,
                backend="mosaic_gpu",
                registers=used["registers"],
                spill_stores=used["spill_stores"],
                spill_loads=used["spill_loads"],
                shared_memory=shared,
                threads=threads,
                tensor_core_instructions=len(_TENSOR_CORE.findall(ptx)),
                problem=problem,
                grid=grid,
                unfenced_stores=None if sass is None else len(unfenced_stores(sass)),
                stall_cycles=None if sass is None else stall_cycles(sass),
                ctas_per_sm=ctas,
                waves=waves,
                stall_path=None if floor is None else floor.stall_path,
                issue_count=None if floor is None else floor.issue_count,
                modelled_us=None if floor is None else limits.modelled_us(floor, ctas, grid),
                model_problem=model_problem,
            )
        )
    return kernels


_LAUNCH = re.compile(r"gpu\.launch_func .* blocks in \((%[\w.]+), (%[\w.]+), (%[\w.]+)\)")
_CONSTANT = re.compile(r"(%[\w.]+) = arith\.constant (\d+) : (?:index|i32|i64)")
# A store to shared memory from registers, and what reads shared memory through the async
# proxy: a wgmma group (its WARPGROUP.ARRIVE) and a TMA store.
_SMEM_STORE = re.compile(r"\s(?:STS|STSM)[.\s]")
_ASYNC_READ = re.compile(r"\s(?:WARPGROUP\.ARRIVE|UTMASTG)\b")
_SASS_LINE = re.compile(r"^\s*[0-9a-fx-]+:[0-9-]+:[0-9-]+:[Y-]:(\d+)\s+/\*[0-9a-f]+\*/\s+\S")


def unfenced_stores(sass: str) -> list[int]:
    """The lines of a kernel's SASS where the async proxy reads shared memory (a wgmma, a TMA
    store) with a store from registers since the last ``FENCE.VIEW.ASYNC.S``, in
    straight-line order: the hardware may then read the tile as it was before the store.
    Straight-line order sees a store in one branch and a read after a join as adjacent, so
    it errs towards reporting."""
    found, stored = [], False
    for number, line in enumerate(sass.splitlines(), 1):
        if "FENCE.VIEW.ASYNC.S" in line:
            stored = False
        elif _SMEM_STORE.search(line):
            stored = True
        elif _ASYNC_READ.search(line) and stored:
            found.append(number)
    return found


def stall_cycles(sass: str) -> int:
    """The sum of the control codes' stall counts over the kernel's instructions, each once
    (loops not unrolled): a floor on one warp's issue cycles for one pass over its code."""
    return sum(int(found[1]) for line in sass.splitlines() if (found := _SASS_LINE.match(line)))


def _launch_grid(folder: Path, stem: str) -> tuple[int, int, int] | None:
    """The ``(x, y, z)`` grid a Mosaic GPU kernel launches, from its MLIR's ``launch_func``:
    its operands are constants defined before it (the latest definition of each name)."""
    for name in (f"{stem}.mlir-passes.log", f"{stem}.before_layout_inference.txt"):
        path = Path(folder) / name
        if not path.exists():
            continue
        constants = {}
        with path.open() as lines:
            for line in lines:
                if "arith.constant" in line and (found := _CONSTANT.search(line)):
                    constants[found[1]] = int(found[2])
                elif "gpu.launch_func" in line and (found := _LAUNCH.search(line)):
                    grid = tuple(constants.get(found[i]) for i in (1, 2, 3))
                    if None not in grid:
                        return grid
    return None


def _dynamic_shared_memory(folder: Path, stem: str) -> int | None:
    """The dynamic shared memory of a Mosaic GPU kernel's launch, from its MLIR dumps (the
    first that holds the launch: jax 0.10 dumps only the passes' log)."""
    pattern = re.compile(r"dynamic_shared_memory_size %c(\d+)_i32")
    for name in (f"{stem}.before_layout_inference.txt", f"{stem}.mlir-passes.log"):
        path = Path(folder) / name
        if not path.exists():
            continue
        with path.open() as lines:
            for line in lines:
                if found := pattern.search(line):
                    return int(found[1])
    return None


# How Mosaic GPU refuses a kernel over a block's shared memory.
_REFUSALS = (
    ("mosaic_gpu", r"exceeds available shared memory: smem_bytes=(\d+) > max_smem_bytes=(\d+)"),
)


def over_shared_memory(message: str) -> Kernel | None:
    """The kernel the compiler refused to build for asking more shared memory than a block
    has, from its error message (which names no kernel); None for another error."""
    matches = ((backend, re.search(pattern, message)) for backend, pattern in _REFUSALS)
    backend, found = next(((b, m) for b, m in matches if m), (None, None))
    if found is None:
        return None
    requested, available = int(found[1]), int(found[2])
    return Kernel(
        name=f"(refused by {backend})",
        backend=backend,
        registers=None,
        spill_stores=None,
        spill_loads=None,
        shared_memory=requested,
        threads=None,
        tensor_core_instructions=None,
        problem=f"{requested} B of shared memory, over the {available} B a block has",
    )


def _product(values) -> int:
    total = 1
    for value in values:
        total *= value
    return total


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""
