"""The chunked op's compiled shape: only state-sized work inside its sequential loops.

On a GPU every op inside a loop body is a kernel launch per chunk and on a TPU small matmuls
idle the MXU, so in the ``"hoisted"`` schedule (the default off CPU) the intra-chunk
``[C, C]`` work must sit outside the scans. This reads the optimised HLO that XLA:CPU
compiles; no accelerator is needed to check the structure, and on a GPU host (the suite run
with ``GDN_TEST_PLATFORMS=cuda``) the programs are compiled for its CPU all the same: XLA:GPU
fuses and counts its loops' bodies differently.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from support.hlo import dots, has_square, loop_bodies
from support.reference import random_inputs, random_state

import gdn_jax
from gdn_jax.ops.chunked.channel_backward import CPU_GRADS_GROUP

# Distinct sizes, so that a [C, C] array cannot be mistaken for anything else.
SEQ, CHUNK, KEY, VALUE = 96, 16, 24, 40


@pytest.fixture(autouse=True)
def compiled_for_the_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def has_chunk_square(lines):
    return has_square(lines, CHUNK)


def inputs():
    return (*random_inputs(0, SEQ, KEY, VALUE), random_state(1, VALUE, KEY))


def forward(q, k, v, la, b, state):
    return gdn_jax.gated_delta_rule_chunked(
        q, k, v, la, b, initial_state=state, chunk_size=CHUNK, schedule="hoisted"
    )


def loss(*args):
    y, s = forward(*args)
    return jnp.sum(y**2) + jnp.sum(s**2)


def test_in_scan_schedule_keeps_chunk_work_in_the_loop():
    # The CPU schedule is the contrast: the [C, C] work sits inside its scan, so the checks
    # below would fail on it (and the helpers demonstrably see what is in a loop).
    def in_scan(*args):
        return gdn_jax.gated_delta_rule_chunked(
            *args[:5], initial_state=args[5], chunk_size=CHUNK, schedule="in_scan"
        )

    (body,) = loop_bodies(jax.jit(in_scan).lower(*inputs()).compile().as_text())
    assert len(dots(body)) > 3 and has_chunk_square(body)


def test_helpers_see_the_recurrent_forms_loop():
    # The recurrent form reads the state twice per token: the parser must find those dots.
    def recurrent(q, k, v, la, b, state):
        return gdn_jax.gated_delta_rule_recurrent(q, k, v, la, b, initial_state=state)

    (body,) = loop_bodies(jax.jit(recurrent).lower(*inputs()).compile().as_text())
    assert len(dots(body)) >= 2


def test_forward_loop_holds_only_state_sized_work():
    (body,) = loop_bodies(jax.jit(forward).lower(*inputs()).compile().as_text())
    assert 1 <= len(dots(body)) <= 3, dots(body)
    assert not has_chunk_square(body)


def test_backward_loops_hold_only_state_sized_work():
    grad = jax.jit(jax.grad(loss, argnums=range(6)))
    bodies = loop_bodies(grad.lower(*inputs()).compile().as_text())
    assert len(bodies) == 2  # the forward's state pass and the backward's reverse pass
    for body in bodies:
        assert 1 <= len(dots(body)) <= 6, dots(body)
        assert not has_chunk_square(body)


@pytest.mark.parametrize("impl_fn", ["gated_delta_rule", "simple_gla"])
def test_batched_grouped_heads_keep_the_structure(impl_fn):
    q, k, v, la, b = random_inputs(2, SEQ, KEY, VALUE, lead=(2,), heads=(2, 4))

    def batched_loss(*args):
        y, s = getattr(gdn_jax, impl_fn)(*args, chunk_size=CHUNK, schedule="hoisted")
        return jnp.sum(y**2) + jnp.sum(s**2)

    hlo = jax.jit(jax.grad(batched_loss, argnums=range(5))).lower(q, k, v, la, b)
    for body in loop_bodies(hlo.compile().as_text()):
        assert 1 <= len(dots(body)) <= 6
        assert not has_chunk_square(body)


@pytest.mark.parametrize("op", ["kda_chunked", "gdn2_chunked"])
def test_channel_gated_hoisted_loops(op):
    """KDA's and GDN-2's hoisted forward+backward: the forward's and the reverse state pass
    hold only state-sized work (two and four products), and the chunks' gradients, with
    the ``[C, C]`` work, run after them in a loop over groups of ``CPU_GRADS_GROUP`` chunks
    on this CPU (``chunked/channel_backward.py``'s ``grads_in_groups``): 9 chunks are two
    groups of 4 in the loop and one chunk after it."""
    chunks = 9
    q, k, v, la, b = random_inputs(3, chunks * CHUNK, KEY, VALUE, per_channel=True)
    gates = (la, b) if op == "kda_chunked" else (la, jax.nn.sigmoid(k), jax.nn.sigmoid(v))
    state = random_state(4, VALUE, KEY)

    def op_loss(*args):
        options = dict(initial_state=args[-1], chunk_size=CHUNK, schedule="hoisted")
        y, s = getattr(gdn_jax, op)(*args[:-1], **options)
        return jnp.sum(y**2) + jnp.sum(s**2)

    args = (q, k, v, *gates, state)
    hlo = jax.jit(jax.grad(op_loss, argnums=range(len(args)))).lower(*args).compile().as_text()
    bodies = loop_bodies(hlo)
    passes = [body for body in bodies if not has_chunk_square(body)]
    assert sorted(len(dots(body)) for body in passes) == [2, 4], [dots(b) for b in passes]
    assert len(bodies) == 3, len(bodies)
    trips = sorted(int(n) for n in re.findall(r'known_trip_count":\{"n":"(\d+)"', hlo))
    assert trips == [chunks // CPU_GRADS_GROUP, chunks, chunks], trips
