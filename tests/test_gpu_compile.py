"""Programs compiled for an H200 by XLA:GPU on this CPU host, and what the report reads of
them (``gdn_jax.gpu_compile``): launches per call with loop trips counted, memory, and each
Pallas kernel's registers, spills, shared memory and tensor-core instructions.

Each program is tiny, so that its launches can be counted by hand: a gemm, an elementwise
fusion, a loop of a known trip count. The thunk-sequence parser is also checked on a written
sequence with every kind of nesting it meets.
"""

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip(
    "jax_plugins.xla_cuda13",
    reason='compiling for a GPU needs the CUDA plugin: pip install -e ".[test]"',
)

from gdn_jax import gpu_compile  # noqa: E402
from gdn_jax.gpu_compile import thunks  # noqa: E402
from gdn_jax.gpu_compile.kernels import Limits, unfenced_stores  # noqa: E402

pl = pytest.importorskip("jax.experimental.pallas")
plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

MATRIX = jax.ShapeDtypeStruct((256, 256), jnp.float32)


def test_targets_are_the_vendors_hopper_limits():
    for name in gpu_compile.TARGETS:
        limits = Limits.of(gpu_compile.target_config(name))
        assert (limits.shared_memory, limits.registers) == (232448, 65536)
    assert gpu_compile.target_device("h200").device_kind == "NVIDIA H200"
    assert gpu_compile.target_device("h100").device_kind == "NVIDIA H100 80GB HBM3"
    assert len(gpu_compile.target_devices("h200:8")) == 8
    assert gpu_compile.parse_target("h200:8").hbm_bytes == 150011101184


def test_a_gemm_and_a_fusion_are_two_launches_with_their_memory():
    report = gpu_compile.report(lambda a, b: jnp.tanh(a @ b) + 1, MATRIX, MATRIX)
    assert report.error is None and report.launchable
    assert (report.launches.total, report.launches.top_level, report.launches.loops) == (2, 2, ())
    assert (report.argument_bytes, report.output_bytes) == (2 * 256 * 256 * 4, 256 * 256 * 4)
    assert report.peak_bytes >= 3 * 256 * 256 * 4
    assert not report.tuned
    assert any("not tuned" in line for line in report.lines())


def test_a_loop_launches_its_body_once_a_trip():
    def looped(a, b):
        def body(c, _):
            return jnp.tanh(c @ b), None

        return jax.lax.scan(body, a, None, length=7)[0]

    report = gpu_compile.report(looped, MATRIX, MATRIX)
    (loop,) = report.launches.loops
    assert loop.trips == 7 and loop.launches_per_trip >= 2
    assert report.launches.total == report.launches.top_level + 7 * loop.launches_per_trip


def _wgmma_kernel():
    """One 64 x 64 x 64 bf16 product on the tensor cores, through shared memory."""
    tile = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def body(a_gmem, b_gmem, o_gmem, a_smem, b_smem, o_smem, barrier):
        plgpu.copy_gmem_to_smem(a_gmem, a_smem, barrier)
        plgpu.copy_gmem_to_smem(b_gmem, b_smem, barrier)
        plgpu.barrier_wait(barrier)

        def product(acc):
            plgpu.wgmma(acc, a_smem, b_smem)
            plgpu.wgmma_wait(0)
            o_smem[...] = acc[...].astype(o_smem.dtype)

        _product_out(product, o_smem, o_gmem)

    smem = [plgpu.SMEM((64, 64), jnp.bfloat16, transforms=tile) for _ in range(3)]
    out = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
    return plgpu.kernel(body, out_type=out, scratch_types=[*smem, plgpu.Barrier(num_arrivals=2)])


def _staged_kernel(rows):
    """``x [rows, 128]`` doubled through ``rows x 512`` B of shared memory."""

    def body(x_gmem, o_gmem, x_smem, barrier):
        plgpu.copy_gmem_to_smem(x_gmem, x_smem, barrier)
        plgpu.barrier_wait(barrier)
        x_smem[...] = x_smem[...] * 2
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(x_smem, o_gmem)
        plgpu.wait_smem_to_gmem(0)

    out = jax.ShapeDtypeStruct((rows, 128), jnp.float32)
    scratch = [plgpu.SMEM((rows, 128), jnp.float32), plgpu.Barrier(num_arrivals=1)]
    return plgpu.kernel(body, out_type=out, scratch_types=scratch)


def test_a_mosaic_kernel_reports_its_registers_shared_memory_and_tensor_cores():
    tile = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
    report = gpu_compile.report(_wgmma_kernel(), tile, tile)
    (kernel,) = report.kernels
    assert kernel.backend == "mosaic_gpu" and kernel.launchable
    assert 0 < kernel.registers <= 255 and (kernel.spill_stores, kernel.spill_loads) == (0, 0)
    assert kernel.shared_memory >= 3 * 64 * 64 * 2
    assert kernel.threads == 128
    assert kernel.tensor_core_instructions >= 4  # K = 64 in steps of 16
    assert report.launches.total == 1


def test_a_kernel_over_a_hopper_block_s_shared_memory_is_not_launchable():
    fits = gpu_compile.report(_staged_kernel(64), jax.ShapeDtypeStruct((64, 128), jnp.float32))
    assert fits.launchable and fits.kernels[0].shared_memory >= 64 * 512
    assert fits.kernels[0].tensor_core_instructions == 0
    over = gpu_compile.report(_staged_kernel(512), jax.ShapeDtypeStruct((512, 128), jnp.float32))
    assert over.error is not None and not over.launchable
    (kernel,) = over.kernels
    assert kernel.shared_memory >= 512 * 512 > 232448
    assert "over the 232448 B a block has" in kernel.problem
    assert any("NOT launchable" in line for line in over.lines())


def _stored_then_read(*, fenced: bool, by: str):
    """A tile stored from registers, then read through the async proxy, ``by`` a wgmma or a
    TMA store, with ``commit_smem`` between them or not: the positive control of the fence
    scan (the second, without it, is the bug the scan is for)."""

    def body(x_gmem, o_gmem, a_smem, b_smem, o_smem):
        del x_gmem  # an argument to place on the GPU
        a_smem[...] = jnp.ones((64, 64), jnp.bfloat16)
        b_smem[...] = jnp.ones((64, 64), jnp.bfloat16)
        if fenced:
            plgpu.commit_smem()
        if by == "tma":
            plgpu.copy_smem_to_gmem(a_smem, o_gmem)
            plgpu.wait_smem_to_gmem(0)
            return

        def product(acc):
            plgpu.wgmma(acc, a_smem, b_smem)
            plgpu.wgmma_wait(0)
            o_smem[...] = acc[...].astype(o_smem.dtype)

        _product_out(product, o_smem, o_gmem)

    return _tile_kernel(body)


def _tile_kernel(body):
    """``body(x_gmem, o_gmem, a_smem, b_smem, o_smem)`` as a kernel (named as ``body``) of
    three swizzled bf16 ``[64, 64]`` tiles, with a ``[64, 64]`` bf16 output."""
    tile = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    smem = [plgpu.SMEM((64, 64), jnp.bfloat16, transforms=tile) for _ in range(3)]
    out = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
    return plgpu.kernel(body, out_type=out, scratch_types=smem)


def _product_out(product, o_smem, o_gmem):
    """``product(acc)`` on a float32 accumulator (it leaves its tile in ``o_smem``), then
    that tile out to ``o_gmem``, fenced and awaited."""
    pl.run_scoped(product, plgpu.ACC((64, 64), jnp.float32))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem)
    plgpu.wait_smem_to_gmem(0)


@pytest.mark.skipif(
    not hasattr(plgpu, "InterpretGPUParams"),
    reason="a register tile of one value stored to shared memory needs jax >= 0.11's Mosaic "
    "GPU (as the project's kernels do, whose SASS the scan is for)",
)
@pytest.mark.parametrize("by", ["wgmma", "tma"])
def test_a_store_read_through_the_async_proxy_without_a_fence_is_reported(by):
    x = jax.ShapeDtypeStruct((8,), jnp.float32)
    (unfenced,) = gpu_compile.report(_stored_then_read(fenced=False, by=by), x).kernels
    (fenced,) = gpu_compile.report(_stored_then_read(fenced=True, by=by), x).kernels
    assert unfenced.unfenced_stores >= 1, by
    assert fenced.unfenced_stores == 0, by
    assert fenced.stall_cycles > 0


def _looped(trips, *, bound_in_hbm=False):
    """``trips`` wgmmas in a loop: ``fori_loop`` to a constant, or to a bound read from HBM
    (``x_gmem[0]``, 0, plus ``trips``), which the machine code cannot show."""

    def looped(x_gmem, o_gmem, a_smem, b_smem, o_smem):  # the kernel's name
        a_smem[...] = jnp.ones((64, 64), jnp.bfloat16)
        b_smem[...] = jnp.ones((64, 64), jnp.bfloat16)
        plgpu.commit_smem()
        # int32, as the project's kernels count (the tests run with x64 on).
        bound = x_gmem[0] + jnp.int32(trips) if bound_in_hbm else jnp.int32(trips)

        def product(acc):
            def step(i, carry):
                plgpu.wgmma(acc, a_smem, b_smem)
                plgpu.wgmma_wait(0)
                # Work enough that LLVM keeps one trip a loop trip rather than unrolling.
                acc[...] = jnp.tanh(acc[...])
                return carry

            jax.lax.fori_loop(jnp.int32(0), bound, step, 0)
            o_smem[...] = acc[...].astype(o_smem.dtype)

        _product_out(product, o_smem, o_gmem)

    return _tile_kernel(looped)


@pytest.mark.skipif(
    not hasattr(plgpu, "InterpretGPUParams"), reason="the model is of jax >= 0.11's kernels"
)
def test_the_model_reads_a_compiled_loops_trips_or_asks_for_them():
    x = jax.ShapeDtypeStruct((8,), jnp.int32)
    (once,) = gpu_compile.report(_looped(1000), x).kernels
    (twice,) = gpu_compile.report(_looped(2000), x).kernels
    assert once.model_problem is None, once
    assert twice.model_problem is None, twice
    # Each loop's body weighs its trips: twice the products, about twice the floor.
    assert 1.9 < twice.stall_path / once.stall_path < 2.1
    assert once.stall_path > once.stall_cycles  # the body counted more than once
    assert once.modelled_us > 0
    (unknown,) = gpu_compile.report(_looped(1000, bound_in_hbm=True), x).kernels
    assert unknown.modelled_us is None and "read their bounds at run time" in unknown.model_problem
    trips = {"looped": (1000,)}  # the kernel's name, without its dump's number
    (given,) = gpu_compile.report(_looped(1000, bound_in_hbm=True), x, open_trips=trips).kernels
    assert given.model_problem is None
    assert 0.8 < given.stall_path / once.stall_path < 1.25


def test_the_fence_scan_reads_straight_line_order():
    def sass(*ops):
        return "\n".join(f"  -:-:-:Y:01  /*{i:04x}*/  {op} ;" for i, op in enumerate(ops))

    assert unfenced_stores(sass("STSM.16.M88.4 [R9], R24", "WARPGROUP.ARRIVE")) == [2]
    assert unfenced_stores(sass("STS.64 [R2], R4", "UTMASTG [UR4], [UR8]")) == [2]
    fenced = sass("STSM.16.M88.4 [R9], R24", "FENCE.VIEW.ASYNC.S", "WARPGROUP.ARRIVE")
    assert unfenced_stores(fenced) == []
    assert unfenced_stores(sass("LDS.64 R2, [R4]", "WARPGROUP.ARRIVE")) == []


def _gridded(rows: int):
    """A kernel over ``(rows, 2)`` programs: Pallas puts the last axis on CUDA's x."""

    def body(x_gmem, o_gmem):
        del x_gmem, o_gmem

    out = jax.ShapeDtypeStruct((8,), jnp.float32)
    return plgpu.kernel(body, out_type=out, grid=(rows, 2), grid_names=("row", "col"))


def test_a_grid_over_cudas_launch_limits_is_not_launchable():
    x = jax.ShapeDtypeStruct((8,), jnp.float32)
    (fits,) = gpu_compile.report(_gridded(65_535), x).kernels
    assert fits.grid == (2, 65_535, 1) and fits.launchable
    assert fits.ctas_per_sm >= 1 and fits.waves > 0
    (over,) = gpu_compile.report(_gridded(65_536), x).kernels
    assert over.grid == (2, 65_536, 1) and not over.launchable
    assert "over CUDA's launch limits" in over.problem


def test_bad_targets_and_arguments_are_named():
    with pytest.raises(ValueError, match="GPU target 'a100' must be one of h100, h200"):
        gpu_compile.target_device("a100")
    with pytest.raises(ValueError, match="device must be a GPU device"):
        gpu_compile.compile_for(jnp.sin, MATRIX, device=jax.devices("cpu")[0])
    with pytest.raises(TypeError, match="args\\[0\\] must be an array or a jax.ShapeDtypeStruct"):
        gpu_compile.report(jnp.sin, "matrix")
    with pytest.raises(ValueError, match=r"^GPU target 'h200:0': the GPU count must be at least"):
        gpu_compile.target_devices("h200:0")
    # JAX's own "Expected a callable value" named neither the function nor fn.
    with pytest.raises(TypeError, match=r"^report: fn='gated_delta_rule' must be a function"):
        gpu_compile.report("gated_delta_rule", MATRIX)
    # A count, as target_devices and --topology take it (it was "must be one of h100, h200").
    assert gpu_compile.report(jnp.sin, MATRIX, target="h200:2").target == "h200:2"
    with pytest.raises(ValueError, match="autotune_results '/nonexistent' is not a file"):
        gpu_compile.report(jnp.sin, MATRIX, autotune_results="/nonexistent")


# A thunk sequence as XLA:GPU prints it: a loop of a known trip count whose body holds an
# async start with a dynamic-slice fusion (one launch, its copy nested), a loop of unknown
# trips, and a command buffer.
SEQUENCE = """\
001: kCustomKernel [source | next=002 (1) ] loop_fusion grid: [4, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
002: kWhile        [prev=001 (1) | next=012 (1) ]
condition:
    003: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    004: kAsyncStart   [source       | next=008 (1)] stream=computation_stream[1], async_id=4
        006: kDynamicSliceFusion [source | sink] params=1, results=1
            005: kCopy [source | sink] kCopy
    007: kCustomKernel [source       | next=008 (1)] gemm_fusion_dot grid: [16, 1, 1] threads: [128, 1, 1]  shared_memory: 4096 bytes
    008: kAsyncDone    [source       | sink        ] async_id=4
    009: kCustomKernel [source       | sink        ] loop_add_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
012: kWhile        [prev=002 (1) | next=016 (1) ]
condition:
    013: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]  shared_memory: 0 bytes
  body:
    014: kCopy [source | sink] kCopy
016: kCommandBuffer [source | sink]
    017: kCustomKernel [source | next=018 (1) ] a_fusion grid: [2, 1, 1] threads: [64, 1, 1]  shared_memory: 128 bytes
    018: kCustomCall   [prev=017 (1) | sink ] kCustomCall
"""


def test_the_parser_counts_nested_launches_and_both_kinds_of_loop():
    parsed = thunks.parse_sequence(SEQUENCE)
    assert [t.kind for t in parsed] == ["kCustomKernel", "kWhile", "kWhile", "kCommandBuffer"]
    assert parsed[0].grid == (4, 1, 1) and parsed[0].threads == (128, 1, 1)
    launches = thunks.count_launches(parsed, {2: "while.1", 12: "while.2"}, {"while.1": 5})
    known, unknown = launches.loops
    # Known trips: the body's DSF, gemm and add, never the condition.
    assert (known.name, known.trips, known.launches_per_trip) == ("while.1", 5, 3)
    # Unknown trips: a copy and the condition a trip, and the condition once more.
    assert (unknown.trips, unknown.launches_per_trip) == (None, 2)
    assert launches.top_level == 1 + 2  # outside the loops: the first kernel, the buffer's two
    assert launches.total == 1 + 5 * 3 + (1 + 2 * 1) + 2
    gemm = next(k for k in launches.kernels if k.name == "gemm_fusion_dot")
    assert gemm.shared_memory == 4096


def test_trip_counts_and_thunk_names_are_read_from_the_dump_texts():
    hlo = (
        "%while.7 = (s32[], f32[2]{0}) while(%tuple), condition=%c, body=%b, "
        'backend_config={"known_trip_count":{"n":"64"},"known_init_step":{"init":"0"}}\n'
        "%while.8 = (s32[]) while(%t2), condition=%c2, body=%b2\n"
    )
    assert thunks.trip_counts(hlo) == {"while.7": 64}
    metadata = (
        'thunk_metadata {\n  thunk_info {\n    profile_annotation: "while.7"\n    thunk_id: 47\n'
        '  }\n  thunk_kind: "kWhile"\n}\n'
    )
    assert thunks.thunk_names(metadata) == {47: "while.7"}
