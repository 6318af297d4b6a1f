"""What the Pallas kernels become on a Hopper GPU, read without one: each launch's Triton
module, as JAX lowers it for an H200, compiled here for sm_90a by the ``triton`` package and
``ptxas``, with the registers, spills, stack and shared memory of each kernel and the
instructions its products became (wgmma on the tensor cores, or scalar FMAs).

    pip install triton==3.6.0      # the H200 image's (torch 2.11's); no GPU needed
    python benchmarks/triton_sm90.py --launch 64x4x0x4:ieee --launch 64x4x0x4:tf32x3

A launch is ``chunked_pallas.Launch``'s fields: ``FBVxFWxBBVxBW[:PRODUCTS]``, the forward's
value block and warps, the backward's (0: a whole value head) and the products' precision.
The kernels are lowered at K = V = 128, chunks of 64, bf16 q, k and v (the GPU check's
shapes: the code does not depend on B, T or H). The Triton that JAX's jaxlib embeds may
differ from the package's version in its passes, so the figures say what the code costs in
kind (spills or none, tensor cores or not), not to the register.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DEFAULT_LAUNCHES = ["64x4x0x4:tf32x3", "64x4x64x4:tf32x3"]
# ptxas of the IEEE-product backward (tens of thousands of scalar FMAs, spilled) ran past 10
# minutes on 2 cores: a kernel that takes longer is reported as such.
PTXAS_LIMIT_S = 240
_LAUNCH = re.compile(r"([1-9]\d*)x([1-9]\d*)x(\d+)x([1-9]\d*)(?::(ieee|tf32x3))?")
LAUNCH_FORM = (
    "FBVxFWxBBVxBW[:ieee|:tf32x3] (each kernel's value block, 0 for a whole value head in "
    "the backward, and warps, then the products' precision), e.g. 64x8x64x8:tf32x3"
)


def parse_launch(spec: str):
    """A ``chunked_pallas.Launch`` written ``FBVxFWxBBVxBW[:PRODUCTS]`` (this script's and
    ``gpu_check.py --pallas-launch``'s form; the products default to the kernel's)."""
    from gdn_jax.ops import chunked_pallas

    match = _LAUNCH.fullmatch(spec)
    if match is None:
        raise ValueError(f"{spec!r}: give {LAUNCH_FORM}")
    block_v, forward, backward_block_v, backward, products = match.groups()
    return chunked_pallas.Launch(
        block_v=int(block_v), forward_warps=int(forward),
        backward_block_v=int(backward_block_v) or None, backward_warps=int(backward),
        products=products or chunked_pallas.Launch.products,
    )  # fmt: skip


def triton_modules(launch) -> dict[str, str]:
    """Each kernel's Triton module (MLIR text) as JAX lowers ``launch`` for an H200."""
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import lowering

    import gdn_jax
    from gdn_jax.ops import chunked_pallas

    modules = {}
    lower = lowering.lower_jaxpr_to_triton_module

    def keep(*args, **kwargs):
        result = lower(*args, **kwargs)
        text = result.module.operation.get_asm(enable_debug_info=False)
        name = re.search(r"tt\.func public @(\w+)", text).group(1)
        modules[name] = text
        return result

    shape, heads = (1, 256), 2
    q, k = (jnp.zeros((*shape, heads, 128), jnp.bfloat16) for _ in range(2))
    v = jnp.zeros((*shape, heads, 128), jnp.bfloat16)
    gates = [jnp.zeros((*shape, heads), jnp.float32) for _ in range(2)]

    def loss(*args):
        y, _ = gdn_jax.gated_delta_rule(*args, impl="pallas", chunk_size=64)
        return jnp.sum(y.astype(jnp.float32))

    h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    target = jax.sharding.AbstractMesh(
        (1,), ("x",), jax.sharding.AxisType.Auto, abstract_device=h200
    )
    before = (chunked_pallas.LAUNCH, chunked_pallas._on_gpu, lowering.lower_jaxpr_to_triton_module)
    chunked_pallas.LAUNCH, chunked_pallas._on_gpu = launch, lambda: True
    lowering.lower_jaxpr_to_triton_module = keep
    try:
        with jax.sharding.use_abstract_mesh(target):
            grad = jax.jit(jax.grad(loss, argnums=range(5)))
            grad.trace(q, k, v, *gates).lower(lowering_platforms=("cuda",))
    finally:
        chunked_pallas.LAUNCH, chunked_pallas._on_gpu, lowering.lower_jaxpr_to_triton_module = (
            before
        )
    return modules


def sm90_resources(module: str, num_warps: int, folder: Path) -> dict:
    """``module`` compiled for sm_90a: ptxas's registers, spills and stack, Triton's shared
    memory, and the PTX instructions of the products."""
    import triton
    from triton.backends.compiler import GPUTarget

    path = folder / "kernel.ttir"
    path.write_text(module)
    options = dict(num_warps=num_warps, num_stages=1)
    compiled = triton.compile(str(path), target=GPUTarget("cuda", 90, 32), options=options)
    ptx = compiled.asm["ptx"]
    (folder / "kernel.ptx").write_text(ptx)
    ptxas = Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    report = subprocess.run(
        [str(ptxas), "-arch=sm_90a", "-v", str(folder / "kernel.ptx"), "-o", str(folder / "k.o")],
        capture_output=True, text=True, check=True, timeout=PTXAS_LIMIT_S,
    ).stderr  # fmt: skip

    def number(pattern):
        found = re.search(pattern, report)
        return int(found.group(1)) if found else 0

    return dict(
        registers=number(r"Used (\d+) registers"),
        spill_stores=number(r"(\d+) bytes spill stores"),
        spill_loads=number(r"(\d+) bytes spill loads"),
        stack=number(r"(\d+) bytes stack frame"),
        shared=compiled.metadata.shared,
        wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
        fma=len(re.findall(r"\bfma\.rn\.f32", ptx)),
    )


def main(argv=None):
    parser = argparse.ArgumentParser(prog="triton_sm90.py", description=__doc__.splitlines()[0])
    parser.add_argument("--launch", action="append", default=[], metavar="FBVxFWxBBVxBW[:P]")
    args = parser.parse_args(argv)
    try:
        launches = [(spec, parse_launch(spec)) for spec in args.launch or DEFAULT_LAUNCHES]
    except ValueError as error:
        parser.error(f"--launch {error}")
    print("| launch | kernel | warps | registers | spill stores B | spill loads B | stack B "
          "| shared B | wgmma | fma.f32 |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for spec, launch in launches:
        modules = triton_modules(launch)
        for name, module in sorted(modules.items()):
            backward = name.endswith("_bwd")
            warps = launch.backward_warps if backward else launch.forward_warps
            kernel = "backward" if backward else "forward"
            with tempfile.TemporaryDirectory() as folder:
                try:
                    r = sm90_resources(module, warps, Path(folder))
                except subprocess.TimeoutExpired:
                    print(f"| {spec} | {kernel} | {warps} | ptxas ran past {PTXAS_LIMIT_S} s |")
                    continue
            print(f"| {spec} | {kernel} | {warps} | {r['registers']} | {r['spill_stores']} | "
                  f"{r['spill_loads']} | {r['stack']} | {r['shared']} | {r['wgmma']} | "
                  f"{r['fma']} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
