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

GDN-2, with a decay a key channel and erase and write gates, has the same two state passes and
one loop more: its hoisted backward forms the chunks' gradients ``GRADS_GROUP`` chunks at a
time (``ops/channel_chunked.py``), whose body holds the ``[C, C]`` work the state passes do
not. Its forward+backward temp is at most 1.2x Gated DeltaNet's in the same compiler
(measured 1353 MiB against 1264, 1.07x, with libtpu 0.0.52; 1673 MiB, 1.32x, when the groups
were stacked before their loop). KDA runs the same engine without the write
gate (1350 MiB); its program at this size is not compiled here, since each of these two
compiles costs 70-90 s of CPU (the suite's budget is 6 minutes on 2 cores), and GDN-2's holds
every stage KDA's does. Both ops' loops are also read at a small size in
``test_tpu_compile.py``.
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


@pytest.mark.costly(60)
def test_gdn2_is_lean_on_tpu_v5e():
    both = program("gdn2")
    temp, gdn_temp = (p.memory.temp_size_in_bytes for p in (both, program("gated_delta_rule")))
    assert temp <= 1.2 * gdn_temp, (temp / 2**20, gdn_temp / 2**20)
    assert both.whiles == 3  # the two state passes and the grouped chunks' gradients
    passes = [
        (body, n)
        for body, n in zip(both.bodies, fusions_per_body(both.hlo), strict=True)
        if not has_square(body, CHUNK)
    ]
    # The state passes, forward and reverse, as Gated DeltaNet's: two and four products.
    assert sorted(len(dots(body)) for body, _ in passes) == [2, 4], [dots(b) for b, _ in passes]
    assert all(1 <= n <= MAX_FUSIONS for _, n in passes), [n for _, n in passes]
