"""KDA and GDN-2 as Mosaic GPU kernels (``ops/mosaic/channel/op.py``), run here in Mosaic GPU's
interpret mode: the in-chunk scores and decays against ``chunked/channel_decays.py``, and the public
ops against their XLA chunked form on outputs, final states and the gradient of every input.

As ``test_chunked_mosaic.py``: skipped at collection on a JAX without Mosaic GPU's interpret
mode (before 0.11); float32 inputs are two bf16 pieces an operand, which interpret mode
multiplies as the tensor cores do, so the float32 row of the tolerance table holds.
"""

import functools

import jax
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

if not hasattr(plgpu, "InterpretGPUParams") or not hasattr(plgpu, "force_gpu_interpret_mode"):
    pytest.skip(
        f"jax {jax.__version__} has no Mosaic GPU interpret mode (plgpu.InterpretGPUParams, "
        "jax >= 0.11)",
        allow_module_level=True,
    )

import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from support.races import detecting_races  # noqa: F401 (the fixture)
from support.reference import as_array, random_inputs, random_state
from support.tolerance import assert_close

import gdn_jax
from gdn_jax.ops.chunked.channel_decays import channel_scores
from gdn_jax.ops.mosaic import tiles
from gdn_jax.ops.mosaic.channel import chunk as in_chunk
from gdn_jax.ops.mosaic.limits import CHUNK
from gdn_jax.ops.mosaic.tiles import F32

OPS = {"kda": gdn_jax.kda, "gdn2": gdn_jax.gdn2}


# Every kernel of these tests runs under the interpreter's race detector, which must stay
# silent (support/races.py).
pytestmark = pytest.mark.usefixtures("detecting_races")


def _scores_kernel(count: int, key_dim: int):
    """A kernel of one chunk on the factors kernel's two warpgroups: the scores of q
    (diagonal kept) and of e (strictly lower) against k, each side making the levels'
    operands over its key channels, and the decays from the start and to the end, all
    float32."""
    main, second = tiles.key_shares(key_dim)

    def body(q_hbm, e_hbm, k_hbm, g_hbm, m_out, a_out, start_out, end_out, **s):
        sync = in_chunk.Sync(s["mask_ready"], (s["operands_0"], s["operands_1"]), s["read"])
        xs, flags = (s["q"], s["e"]), (True, False)

        def main_side():
            dsts = (*s["q"].refs, *s["e"].refs, *s["k"].refs)
            for src, dst in zip((*q_hbm, *e_hbm, *k_hbm), dsts, strict=True):
                plgpu.copy_gmem_to_smem(src, dst, s["loaded"])
            in_chunk.load_gates(g_hbm, s["g"])
            plgpu.barrier_wait(s["loaded"])
            m_out[...] = in_chunk.channel_scores(
                s, xs, s["k"], s["g"], diagonal=flags, side=0, keys=main, sync=sync
            )
            in_chunk.write_chunk_masks(s["masks"])  # the levels' mask is read by now

            def block(first, carry):
                from_start, to_end = in_chunk.chunk_decays(
                    s["masks"], s["g"].at(*in_chunk.key_block(first))
                )
                start_out.at[:, pl.ds(first, CHUNK)][...] = from_start
                end_out.at[:, pl.ds(first, CHUNK)][...] = to_end
                return carry

            tiles.over_blocks(key_dim, block, 0)

        def second_side():
            plgpu.barrier_wait(s["loaded"])
            a_out[...] = in_chunk.channel_scores(
                s, xs, s["k"], s["g"], diagonal=flags, side=1, keys=second, sync=sync
            )

        side = jax.lax.axis_index(tiles.WARPGROUP)
        pl.when(side == 0)(main_side)
        pl.when(side == 1)(second_side)
        tiles.finish_together(s["done"])

    tile = (CHUNK, key_dim)
    scratch = dict(
        q=tiles.pieces(count, tile),
        e=tiles.pieces(count, tile),
        k=tiles.pieces(count, tile),
        g=tiles.pieces(tiles.SEGMENT_PIECES, tile),
        masks=(tiles.pieces(1, in_chunk.SQUARE), tiles.pieces(1, in_chunk.SQUARE)),
        rows=(tiles.pieces(count, tile), tiles.pieces(count, tile)),
        cols=tiles.pieces(count, tile),
        loaded=plgpu.Barrier(num_arrivals=3 * count),
        **{name: plgpu.Barrier() for name in ("mask_ready", "operands_0", "operands_1", "read")},
        done=plgpu.Barrier(num_arrivals=2),
    )
    shapes = (in_chunk.SQUARE, in_chunk.SQUARE, tile, tile)
    return tiles.kernel_call(
        body,
        name="channel_scores_test",
        out_type=tuple(jax.ShapeDtypeStruct(x, F32) for x in shapes),
        scratch=scratch,
        grid=dict(one=1),
        interpret=True,
        warpgroups=2,
    )


@pytest.mark.parametrize("lowest", [-0.1, -5.0])
def test_scores_and_decays_of_a_chunk_equal_channel_decays(lowest):
    """Gates down to -5 a token decay a chunk by up to e^-320, past float32's e^-88, and a
    -1e4 reset sits inside it: every level's factor is the exp of a sum of gates, so the
    kernel's scores and decays stay finite and equal the XLA form's. K = 128: two blocks of
    key channels; float32 operands (two pieces) for float32's tolerance."""
    rng = np.random.default_rng(0)
    q, e, k = (rng.standard_normal((CHUNK, 128)) for _ in range(3))
    g = rng.uniform(lowest, 0.0, (CHUNK, 128))
    g[5, 3] = -1e4
    q, e, k, g = (as_array(x, F32) for x in (q, e, k, g))
    kernel = _scores_kernel(2, 128)
    got = kernel(tiles.operand(q, 2), tiles.operand(e, 2), tiles.operand(k, 2), g)
    (scores, erase_scores), decays = channel_scores((q, e), k, g)
    expected = (scores, jnp.tril(erase_scores, -1), decays.from_start, decays.to_end)
    for name, a, b in zip(("M", "A", "from_start", "to_end"), got, expected, strict=True):
        assert np.isfinite(np.asarray(a)).all(), name
        assert_close(a, b, F32, err_msg=name)


def _gates(rule, seed, shape, value_dim, log_alpha_range):
    """``log_alpha [*shape, K]`` and KDA's ``beta [*shape]`` or GDN-2's ``b [*shape, K]``
    and ``w [*shape, V]``."""
    rng = np.random.default_rng(seed)
    log_alpha = rng.uniform(*log_alpha_range, shape)
    if rule == "kda":
        gates = (log_alpha, rng.uniform(0.0, 1.0, shape[:-1]))
    else:
        write = rng.uniform(0.0, 1.0, (*shape[:-1], value_dim))
        gates = (log_alpha, rng.uniform(0.0, 1.0, shape), write)
    return tuple(as_array(x, F32) for x in gates)


def rule_inputs(rule, seed, seq_len, key_dim, value_dim, *, batch, heads, lowest=-0.05):
    """q, k, v and the rule's gates, mild decays by default (about exp(-1.6) a chunk), so
    that what crosses chunks weighs in the outputs as much as the work inside one."""
    q, k, v, _, _ = random_inputs(seed, seq_len, key_dim, value_dim, lead=(batch,), heads=heads)
    shape = (batch, seq_len, heads[1], key_dim)
    return (q, k, v, *_gates(rule, seed + 1, shape, value_dim, (lowest, 0.0)))


@functools.cache
def outputs_and_grads(rule, impl, packed: bool, norm: bool):
    """``run(inputs, state, ct_y, ct_s[, cu]) -> (y, final, grads)``, one jitted program a
    case; ``grads`` of every input, the initial state last."""

    def run(inputs, state, ct_y, ct_s, cu=None):
        def loss(inputs, state):
            y, s = OPS[rule](
                *inputs, initial_state=state, cu_seqlens=cu, use_qk_l2norm=norm, impl=impl,
                schedule="in_scan",  # the XLA form's on CPU; one traced, not three
            )  # fmt: skip
            ct = jnp.sum(y.astype(F32) * ct_y.astype(F32))
            return ct + jnp.sum(s * ct_s), (y, s)

        grads, (y, s) = jax.grad(loss, argnums=(0, 1), has_aux=True)(inputs, state)
        return y, s, (*grads[0], grads[1])

    return jax.jit(run)


def assert_same(rule, inputs, dtype, cu=None, *, norm=False):
    """The kernels' outputs, final states and every gradient within ``dtype``'s tolerance of
    the XLA chunked form's, each in its input's dtype."""
    q, v = inputs[0], inputs[2]
    num_states = q.shape[0] if cu is None else cu.shape[0] - 1
    state = random_state(7, num_states, v.shape[2], v.shape[3], q.shape[3])
    ct_y = random_state(8, *v.shape).astype(v.dtype)
    ct_s = random_state(9, *state.shape)
    args = (inputs, state, ct_y, ct_s) + (() if cu is None else (cu,))
    kernel = outputs_and_grads(rule, "mosaic_gpu", cu is not None, norm)(*args)
    xla = outputs_and_grads(rule, "chunked", cu is not None, norm)(*args)
    names = ("y", "final", *(f"d{i}" for i in range(len(inputs))), "d_initial_state")
    for name, a, e in zip(names, (*kernel[:2], *kernel[2]), (*xla[:2], *xla[2]), strict=True):
        assert a.dtype == e.dtype, (rule, name, a.dtype, e.dtype)
        assert_close(a.astype(F32), e.astype(F32), dtype, err_msg=f"{rule} {name}")


def test_grouped_heads_a_tail_chunk_and_strong_decays():
    """KDA: two value heads read one key head; T = 150 is two chunks and a tail of 22; V =
    72 pads to two blocks of value channels (two programs of the state pass a value head).
    In one key channel the gates go down to -5 a token (a chunk decays past float32's
    e^-88) with a -inf gate (a reset) in it: all finite, all equal."""
    q, k, v, log_alpha, beta = rule_inputs("kda", 0, 150, 16, 72, batch=1, heads=(1, 2))
    log_alpha = np.asarray(log_alpha).copy()
    log_alpha[0, :, 1, 3] = np.random.default_rng(3).uniform(-5.0, 0.0, 150)
    log_alpha[0, 20, 1, 3] = -np.inf
    assert_same("kda", (q, k, v, as_array(log_alpha, F32), beta), F32)


def test_packed_sequences_with_an_empty_one():
    """GDN-2 (its own erase and write gates) over packed sequences, grouped value heads."""
    inputs = rule_inputs("gdn2", 1, 100, 16, 24, batch=1, heads=(1, 2))
    cu = jnp.array([0, 7, 7, 100], jnp.int32)  # the second sequence has no tokens
    assert_same("gdn2", inputs, F32, cu=cu)


def test_bf16_inputs_with_the_norm_inside_the_op():
    """bf16 q, k and v (one bf16 piece an operand) over two key heads of two value heads
    each; K = 80 pads to two blocks of 64 key channels, the widest the kernels take."""
    q, k, v, *gates = rule_inputs("kda", 2, 70, 80, 40, batch=1, heads=(2, 4))
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    assert_same("kda", (q, k, v, *gates), jnp.bfloat16, norm=True)


def test_no_sequences_give_empty_outputs_and_no_tokens_the_ops_own_error():
    q, k, v, *gates = rule_inputs("kda", 4, 20, 16, 16, batch=0, heads=(1, 2))
    state = random_state(5, 0, 2, 16, 16)

    def loss(state):
        y, final = gdn_jax.kda(q, k, v, *gates, initial_state=state, impl="mosaic_gpu")
        return jnp.sum(y) + jnp.sum(final), (y, final)

    d_state, (y, final) = jax.grad(loss, has_aux=True)(state)
    assert y.shape == v.shape and final.shape == state.shape
    np.testing.assert_array_equal(d_state, np.ones(state.shape))
    empty = rule_inputs("kda", 4, 0, 16, 16, batch=2, heads=(1, 2))
    with pytest.raises(ValueError, match=r"kda: need at least one token"):
        gdn_jax.kda(*empty, impl="mosaic_gpu")


def test_second_order_through_the_kernels_is_one_named_error():
    q, k, v, *gates = rule_inputs("gdn2", 11, 20, 16, 16, batch=1, heads=(1, 1))

    def loss(v, q):
        return jnp.sum(gdn_jax.gdn2(q, k, v, *gates, impl="mosaic_gpu")[0] ** 2)

    message = r"gdn2: impl='mosaic_gpu' differentiates once, in reverse mode.*'chunked'"
    with pytest.raises(ValueError, match=message):
        jax.jvp(lambda q: jax.grad(loss)(v, q), (q,), (q,))
    with pytest.raises(ValueError, match=message):
        jax.hessian(loss)(v, q)
