"""What the Mosaic GPU kernels (``impl="mosaic_gpu"``) become on an H200, read without one: the
forward and forward+backward programs compiled here for an H200 (XLA's target config of the
card, ``/work/shared/gpu/h200.txtpb``), with each Mosaic kernel's registers, spills and
shared memory from ptxas and the wgmma instructions in its PTX.

    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python benchmarks/mosaic_sm90.py [--dtype float32]

Needs jax >= 0.11 with jax-cuda13-plugin/pjrt and nvidia-cuda-nvcc (ptxas) installed; no GPU.
The shape is the report's, B=4, T=4096, H=HV=16, K=V=128 (``--dims KxV`` for others), with
q and k normalised inside the op (the GPU check's call).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TARGET = Path(os.environ.get("GDN_H200_TARGET", "/work/shared/gpu/h200.txtpb"))
_PTXAS = re.compile(
    r"(\d+) bytes spill stores, (\d+) bytes spill loads.*?Used (\d+) registers", re.S
)
_SMEM = re.compile(r"smem_scratch_bytes=(\d+)")


def kernel_figures(dump: Path) -> dict[str, dict]:
    """Per Mosaic kernel in ``dump`` (``MOSAIC_GPU_DUMP_TO``): registers, spill bytes,
    shared memory and the wgmma shapes of its PTX. A kernel's shared memory is the largest
    that a kernel of its name asked for: jax 0.12 numbers the resource dumps (one a
    lowering) apart from the PTX dumps (one a compile), so the suffixes do not pair."""
    smem = {}
    for resources in dump.glob("*.resources.txt"):
        kernel = resources.name.removesuffix(".resources.txt").rsplit("_", 1)[0]
        found = _SMEM.search(resources.read_text())
        smem[kernel] = max(smem.get(kernel, 0), int(found.group(1)) if found else 0)
    figures = {}
    for ptxas in sorted(dump.glob("*.ptxas")):
        name = ptxas.stem
        spill_stores, spill_loads, registers = map(int, _PTXAS.search(ptxas.read_text()).groups())
        ptx = ptxas.with_suffix(".ptx")
        shapes = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\w+)\.f32\.(\w+)", ptx.read_text())
        figures[name] = dict(
            registers=registers,
            spill_bytes=spill_stores + spill_loads,
            smem_bytes=smem.get(name.rsplit("_", 1)[0]),
            wgmma=sorted({f"{m}.{t}" for m, t in shapes}),
            wgmma_count=len(shapes),
        )
    return figures


def compile_programs(dtype_name: str, dims: tuple, dump: Path, backward=True) -> dict:
    """Compile the forward and the forward+backward at the report shape (``dims = (K,
    V)``) for the H200, the Mosaic kernels dumping into ``dump``; return each program's XLA
    memory analysis."""
    os.environ.update(
        MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_TO=str(dump)
    )
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies

    import gdn_jax

    topo = topologies.get_topology_desc(
        platform="cuda", target_config=TARGET.read_text(), topology="1x1x1"
    )
    sharding = jax.sharding.SingleDeviceSharding(topo.devices[0])
    dtype = jnp.dtype(dtype_name)
    batch, seq_len, heads = 4, 4096, 16
    key_dim, value_dim = dims

    def spec(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

    qkv = [spec((batch, seq_len, heads, d), dtype) for d in (key_dim, key_dim, value_dim)]
    gates = [spec((batch, seq_len, heads), jnp.float32) for _ in range(2)]

    def forward(q, k, v, log_alpha, beta):
        # Traced here and lowered for the H200 the arguments sit on: the kernels compile.
        return gdn_jax.gated_delta_rule(
            q, k, v, log_alpha, beta, use_qk_l2norm=True, impl="mosaic_gpu", chunk_size=64
        )

    def loss(*args):
        y, final = forward(*args)
        return jnp.sum(y.astype(jnp.float32)) + jnp.sum(final)

    programs = {"forward": jax.jit(forward)}
    if backward:
        programs["forward+backward"] = jax.jit(jax.grad(loss, (0, 1, 2, 3, 4)))
    memory = {}
    for name, program in programs.items():
        compiled = program.trace(*qkv, *gates).lower().compile()
        memory[name] = compiled.memory_analysis()
    return memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--dims", default="128x128", help="KxV (default 128x128)")
    parser.add_argument("--forward-only", action="store_true")
    args = parser.parse_args()
    dims = tuple(int(d) for d in args.dims.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        memory = compile_programs(args.dtype, dims, Path(tmp), backward=not args.forward_only)
        figures = kernel_figures(Path(tmp))
    print(f"H200 (sm_90a), B=4 T=4096 H=HV=16 K={dims[0]} V={dims[1]} {args.dtype}")
    for name, f in figures.items():
        print(
            f"  {name}: {f['registers']} registers, {f['spill_bytes']} bytes spilled, "
            f"{f['smem_bytes']} bytes shared memory, {f['wgmma_count']} wgmma "
            f"({', '.join(f['wgmma']) or 'none'})"
        )
    for name, m in memory.items():
        total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
        print(f"  {name}: peak (arguments + outputs + temporaries) {total / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
