"""The Pallas kernels of a program compiled for a GPU: registers, spills, shared memory and
tensor-core instructions, and whether one block of each can launch.

Mosaic GPU kernels are compiled to machine code when JAX lowers them; with
``MOSAIC_GPU_DUMP_TO`` and ``MOSAIC_GPU_DUMP_PTXAS`` set at that moment, each kernel leaves its
PTX, ptxas's report and its MLIR (whose launch states the dynamic shared memory) in the
folder. Triton kernels (Pallas's Triton backend) are compiled by XLA with the rest of the
program: their shared memory is in the thunk sequence, their PTX in the dump when
``xla_dump_emitter_re`` asks for it, and ptxas (from ``nvidia-cuda-nvcc``) reads registers and
spills from it. The tensor-core count is of the PTX's ``wgmma.mma_async`` and ``mma.sync``
instructions, as written, not as executed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

TRITON_TARGET = "__gpu$xla.gpu.triton"
_TENSOR_CORE = re.compile(r"\b(?:wgmma\.mma_async|mma\.sync)\b")
_PTXAS_TIMEOUT_S = 600


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

    @property
    def launchable(self) -> bool:
        return self.problem is None


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one block may use on the target (its ``gpu_device_info``)."""

    shared_memory: int
    registers: int

    @classmethod
    def of(cls, target_config: str) -> Limits:
        def field(name):
            return int(re.search(rf"\b{name}: (\d+)", target_config)[1])

        return cls(field("shared_memory_per_block_optin"), field("registers_per_block_limit"))

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


def mosaic_kernels(folder: Path, limits: Limits) -> list[Kernel]:
    """The Mosaic GPU kernels dumped into ``folder`` (``MOSAIC_GPU_DUMP_TO``)."""
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
                problem=limits.problem(shared, used["registers"], threads),
            )
        )
    return kernels


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


def triton_names(hlo: str) -> set[str]:
    """The Pallas Triton kernels that an optimised HLO module calls, by kernel name."""
    names = set()
    for line in hlo.splitlines():
        if f'custom_call_target="{TRITON_TARGET}"' in line:
            found = re.search(r'\bname = "([^"]+)"', line)
            if found:
                names.add(found[1])
    return names


def triton_kernels(folder: Path, thunks, limits: Limits) -> list[Kernel]:
    """The Triton kernels among ``thunks`` (launching thunks of the program dumped in
    ``folder``), with ptxas's figures for those whose PTX is in the dump."""
    hlo = "\n".join(p.read_text() for p in Path(folder).glob("*gpu_after_optimizations.txt"))
    names = triton_names(hlo)
    found = {t.name: t for t in thunks if t.name in names}
    if not found:
        return []
    resources = {}
    for ptx in Path(folder).glob("*.ptx"):
        text = ptx.read_text()
        if any(f".entry {name}(" in text for name in found):
            for name, used in _ptxas(ptx).items():
                resources.setdefault(name, {}).update(used)
            for name, used in _tensor_cores(text).items():
                resources.setdefault(name, {}).update(used)
    kernels = []
    for name, thunk in sorted(found.items()):
        used = resources.get(name, {})
        threads = None if thunk.threads is None else _product(thunk.threads)
        kernels.append(
            Kernel(
                name=name,
                backend="triton",
                registers=used.get("registers"),
                spill_stores=used.get("spill_stores"),
                spill_loads=used.get("spill_loads"),
                shared_memory=thunk.shared_memory,
                threads=threads,
                tensor_core_instructions=used.get("tensor_cores"),
                problem=limits.problem(thunk.shared_memory, used.get("registers"), threads),
            )
        )
    return kernels


# How XLA (for a Triton kernel) and Mosaic GPU refuse a kernel over a block's shared memory.
_REFUSALS = (
    ("triton", r"Shared memory size limit exceeded: requested (\d+), available: (\d+)"),
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


def ptxas_path() -> str | None:
    """ptxas from the ``nvidia-cuda-nvcc`` wheel, else from the PATH."""
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec else ():
        for found in sorted(Path(root).glob("cu*/bin/ptxas")):
            return str(found)
    return shutil.which("ptxas")


def _ptxas(ptx: Path) -> dict[str, dict[str, int]]:
    ptxas = ptxas_path()
    if ptxas is None:
        return {}
    result = subprocess.run(
        [ptxas, "-arch=sm_90a", "-v", str(ptx), "-o", str(ptx.with_suffix(".cubin"))],
        capture_output=True,
        text=True,
        timeout=_PTXAS_TIMEOUT_S,
    )
    return ptxas_report(result.stderr + result.stdout)


def _tensor_cores(ptx: str) -> dict[str, dict[str, int]]:
    """Tensor-core instructions per entry function of a PTX module."""
    counts = {}
    for chunk in re.split(r"(?=\.visible \.entry |\.entry )", ptx):
        name = re.match(r"(?:\.visible )?\.entry (\w+)", chunk)
        if name:
            counts[name[1]] = {"tensor_cores": len(_TENSOR_CORE.findall(chunk))}
    return counts


def _product(values) -> int:
    total = 1
    for value in values:
        total *= value
    return total


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""
