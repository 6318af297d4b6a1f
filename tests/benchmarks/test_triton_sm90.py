"""``benchmarks/triton_sm90.py``'s first half, which needs no triton package: the Triton
modules JAX lowers for an H200 carry the launch's product precision into every product but
the decays' segment sums (the package and ptxas, which compile them for sm_90a, are not in
the test requirements)."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sm90():
    spec = importlib.util.spec_from_file_location("triton_sm90", REPO / "benchmarks/triton_sm90.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["triton_sm90"] = module
    spec.loader.exec_module(module)
    return module


def test_the_launch_s_precision_reaches_every_product_but_the_decays(sm90):
    """Three TF32 passes in every product but the segment sums of the decays, which stay
    IEEE (``_precision``'s choice of IEEE for a launch is tested in test_chunked_pallas)."""
    modules = sm90.triton_modules(sm90.parse_launch("64x8x64x8:tf32x3"))
    # The forward's segment sums, and the backward's and their pullback's, stay IEEE.
    decays = {"gated_delta_rule_chunked_pallas": 1, "gated_delta_rule_chunked_pallas_bwd": 2}
    assert sorted(modules) == sorted(decays)
    for name, module in modules.items():
        dots = [line for line in module.splitlines() if "tt.dot " in line]
        passes = sum("inputPrecision = tf32x3" in line for line in dots)
        assert passes == len(dots) - decays[name], (name, len(dots), passes)
    # The launch is undone: the suite's other tests interpret the kernels on this CPU.
    from gdn_jax.ops import chunked_pallas

    assert chunked_pallas.LAUNCH == chunked_pallas.Launch()
    assert not chunked_pallas._on_gpu()


def test_a_bad_launch_is_named(sm90):
    with pytest.raises(ValueError, match=re.escape("'64x8x64:ieee': give FBVxFWxBBVxBW[:ieee")):
        sm90.parse_launch("64x8x64:ieee")
    launch = sm90.parse_launch("32x4x0x8")  # 0: a whole value head; the kernel's products
    assert (launch.block_v, launch.backward_block_v, launch.backward_warps) == (32, None, 8)
    assert launch.products == "tf32x3"
