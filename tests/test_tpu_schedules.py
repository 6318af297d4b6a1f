"""The hoisted schedule at a size that matters, compiled for one TPU v5e chip by libtpu on
this CPU (``tpu_programs``): docs/benchmarks.md's B=2, T=8192, H=16, K=V=128, C=64 with bfloat16 q, k
and v, the forward and the gradient of every input.

Forward+backward is two while loops: the forward's state pass and the reverse pass (the
forward alone, one loop, is compiled at a small size in ``test_tpu_compile.py``; at this size
it costs 15 s of CPU and adds nothing the forward+backward program does not show, since that
program holds the forward's loop). Each loop body holds only the state-sized products of a chunk and their elementwise
work: no ``[C, C]`` array, two products in the forward pass (the reads ``[w; Q] S^T`` and
the update) and four in the reverse one, and a handful of fusions (slices of the chunk's
inputs, the decayed keys and queries, the products with their epilogues: measured 8 in the
forward and 8 and 12 in forward+backward, where the in-scan schedule's bodies launch 48 to
75; ``benchmarks/bench_tpu_op.py``). The forward+backward program fits in 1.4 GiB of temp
memory (1264 MiB measured with libtpu 0.0.52; MaxText's pure-JAX chunked rule takes 2101 MiB
at this size, docs/benchmarks.md).

GDN-2 and KDA run the same two state passes, and GDN-2's hoisted backward one loop more
(the chunks' gradients in groups, ``ops/chunked/channel_backward.py``); their loops are read at a
small size in ``test_tpu_compile.py``. Their temp memory at this size is a figure of
``benchmarks/bench_tpu_op.py --ops gdn kda gdn2`` in docs/benchmarks.md, not a test here:
compiling GDN-2's program at this size costs more CPU than the rest of this module.
"""

import re

import pytest
from support.hlo import computations, dots, has_square
from support.tpu_programs import op_program

pytest.importorskip("libtpu", reason='compiling for TPU needs libtpu: pip install -e ".[test]"')

SHAPE, CHUNK = (2, 8192, 16, 128, 128), 64
TEMP_BOUND = 1.4 * 2**30
MAX_FUSIONS = 16
BODY = re.compile(r"body=%?([\w.-]+)")


def fusions_per_body(hlo):
    """How many fusions each while loop's body launches (its own fusion instructions, not
    those nested in them)."""
    blocks = computations(hlo)
    return [sum(" fusion(" in line for line in blocks[name]) for name in BODY.findall(hlo)]


def program(op):
    return op_program("v5e:2x2", "hoisted", "bfloat16", SHAPE, CHUNK, grad=True, op=op)


@pytest.mark.slow
@pytest.mark.costly(20)
def test_hoisted_schedule_is_lean_on_tpu_v5e():
    both = program("gated_delta_rule")
    assert both.whiles == 2
    assert both.memory.temp_size_in_bytes <= TEMP_BOUND, both.memory.temp_size_in_bytes / 2**20
    # The forward pass's body holds two products (the reads [w; Q] S^T and the update), the
    # reverse pass's at most four.
    assert sorted(len(dots(body)) for body in both.bodies) == [2, 4], [dots(b) for b in both.bodies]
    for body in both.bodies:
        assert not has_square(body, CHUNK)
    fusions = fusions_per_body(both.hlo)
    assert all(1 <= n <= MAX_FUSIONS for n in fusions), fusions
