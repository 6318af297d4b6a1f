"""The channel-gated backward kernels (``ops/mosaic/channel/reverse.py``), run in Mosaic GPU's
interpret mode, against the XLA form of the same math (``ops/chunked/channel.py``): the reverse
state pass against ``chunked.state_pass_bwd`` chunk by chunk over the forward's factors, the
grads kernel against ``jax.vjp`` of a chunk's outputs and end state.

The kernels' products are wgmma's with bf16 operands, float32 operands as two bf16 pieces,
which interpret mode computes as the tensor cores do.
"""

import jax
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

if not hasattr(plgpu, "InterpretGPUParams"):
    pytest.skip(
        f"jax {jax.__version__} has no Mosaic GPU interpret mode (plgpu.InterpretGPUParams, "
        "jax >= 0.11)",
        allow_module_level=True,
    )

import jax.numpy as jnp
import numpy as np
from support.races import detecting_races  # noqa: F401 (the fixture)
from support.tolerance import assert_close

from gdn_jax.ops.chunked.channel_decays import channel_scores
from gdn_jax.ops.chunked.scalar import state_pass_bwd
from gdn_jax.ops.chunked.wy import two_products
from gdn_jax.ops.mosaic import tiles
from gdn_jax.ops.mosaic.channel import grads, reverse
from gdn_jax.ops.mosaic.limits import CHUNK

# Chunks a sequence: three sequences, the second empty (its state's cotangent passes through).
COUNTS = (2, 0, 1)


# Every kernel of these tests runs under the interpreter's race detector, which must stay
# silent (support/races.py).
pytestmark = pytest.mark.usefixtures("detecting_races")


def table_of(counts):
    counts = np.asarray(counts, np.int32)
    return jnp.asarray(np.stack([np.cumsum(counts) - counts, counts], 1), jnp.int32)


def contract_inputs(seed, chunks, heads, key_dim, value_dim):
    """Random inputs of the kernel contract on the token layout: q, k ``[tokens, H, K]``,
    e = b * k and x ``[tokens, HV, K or V]``, log-decays g ``[tokens, HV, K]`` (mild: the
    state crosses chunks), float32."""
    rng = np.random.default_rng(seed)
    tokens = chunks * CHUNK
    h, hv = heads
    q = rng.standard_normal((tokens, h, key_dim))
    k = rng.standard_normal((tokens, h, key_dim))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    b = rng.uniform(0.0, 1.0, (tokens, hv, key_dim))
    x = rng.standard_normal((tokens, hv, value_dim))
    g = rng.uniform(-0.05, 0.0, (tokens, hv, key_dim))
    k_v = np.repeat(k, hv // h, axis=1)
    return tuple(jnp.asarray(a, jnp.float32) for a in (q, k, b * k_v, x, g))


def by_value_head(x, heads):
    """``[tokens, H, D]`` to each value head's ``[tokens, HV, D]``."""
    return jnp.repeat(x, heads[1] // heads[0], axis=1)


def chunk_factors(q, k, e, x, g):
    """Stage 1 of one chunk in XLA (``chunked/channel.py``'s ``chunk_factors`` with ``e`` and ``x``
    given): ``(M, decays, w, u, T)``."""
    (scores, erase_scores), decays = channel_scores((q, e), k, g)
    w, u, inverse = two_products(jnp.tril(erase_scores, -1), e * decays.from_start, x)
    return scores, decays, w, u, inverse


def chunk_outputs(q, k, e, x, g, start):
    """One chunk's outputs and end state from its start state, in XLA."""
    scores, decays, w, u, _ = chunk_factors(q, k, e, x, g)
    corrections = u - w @ start.T
    y = (q * decays.from_start) @ start.T + scores @ corrections
    return y, start * decays.whole[None, :] + corrections.T @ (k * decays.to_end)


def xla_factors(q, k, e, x, g, heads):
    """The forward's factors per chunk and value head from the XLA form
    (``chunked/channel.py``'s ``chunk_factors``): ``q_start``, ``k_end``, ``w``, ``u`` ``[tokens, HV,
    D]``, the scores ``M`` and the inverse ``T [tokens, HV, C]`` and ``whole [chunks, HV,
    K]``."""
    q, k = by_value_head(q, heads), by_value_head(k, heads)
    tokens, hv = q.shape[:2]

    def per_chunk(q, k, e, x, g):
        scores, decays, w, u, inverse = chunk_factors(q, k, e, x, g)
        return (q * decays.from_start, k * decays.to_end, w, u, scores, inverse, decays.whole)

    def chunked(a):  # [tokens, HV, D] -> [chunks, HV, C, D]
        return a.reshape(tokens // CHUNK, CHUNK, hv, -1).transpose(0, 2, 1, 3)

    out = jax.vmap(jax.vmap(per_chunk))(*(chunked(a) for a in (q, k, e, x, g)))
    *factor_tiles, whole = out

    def unchunked(a):
        return a.transpose(0, 2, 1, 3).reshape(tokens, hv, -1)

    return (*(unchunked(a) for a in factor_tiles), whole)


def xla_reverse(table, q_start, k_end, w, scores, whole, d_y, d_finals):
    """``(d_initial, d_ends)`` by ``chunked.state_pass_bwd`` chunk by chunk, last to first."""
    d_ends = np.zeros((q_start.shape[0] // CHUNK, *d_finals.shape[1:]), np.float32)
    d_initial = []
    bwd = jax.jit(jax.vmap(state_pass_bwd, in_axes=(0, None, 1, None, 1, 1, 0, 0, 1)))
    for seq, (first, count) in enumerate(np.asarray(table)):
        d = d_finals[seq]
        for chunk in reversed(range(first, first + count)):
            d_ends[chunk] = d
            rows = slice(chunk * CHUNK, (chunk + 1) * CHUNK)
            m, dy = scores[rows], d_y[rows]
            d_u_intra = jnp.einsum("thi,thv->hiv", m, dy)
            start, u = jnp.zeros(d.shape[1:], d.dtype), jnp.zeros((CHUNK, d.shape[1]), d.dtype)
            d = bwd(d, start, w[rows], u, k_end[rows], q_start[rows], whole[chunk],
                    d_u_intra, dy)[0]  # fmt: skip
        d_initial.append(d)
    return jnp.stack(d_initial), d_ends


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reverse_pass_equals_the_xla_state_pass_backward(dtype):
    """Several sequences (one empty), grouped value heads, two value blocks: the initial
    states' cotangents and every chunk's end cotangent."""
    heads, key_dim, value_dim = (1, 2), 64, 128
    table = table_of(COUNTS)
    inputs = contract_inputs(0, sum(COUNTS), heads, key_dim, value_dim)
    q_start, k_end, w, _, scores, _, whole = xla_factors(*inputs, heads)
    rng = np.random.default_rng(1)
    d_y = jnp.asarray(rng.standard_normal((sum(COUNTS) * CHUNK, heads[1], value_dim)))
    d_finals = jnp.asarray(rng.standard_normal((len(COUNTS), heads[1], value_dim, key_dim)))
    d_y, d_finals = d_y.astype(jnp.float32), d_finals.astype(jnp.float32)
    count = 1 if dtype == jnp.bfloat16 else 2
    operands = [tiles.operand(a, count) for a in (q_start, k_end, w, scores, d_y)]
    # The reference reads what the kernel reads: the operands as the sums of their pieces.
    exact = [sum(p.astype(jnp.float32) for p in pieces) for pieces in operands]
    d_initial, d_ends = reverse.reverse(
        table, *operands[:4], whole, operands[4], d_finals, interpret=True
    )
    expected_initial, expected_ends = xla_reverse(table, *exact[:4], whole, exact[4], d_finals)
    assert d_initial.dtype == jnp.float32 and len(d_ends) == count
    assert_close(d_initial, expected_initial, dtype, err_msg="d_initial")
    d_ends = sum(p.astype(jnp.float32) for p in d_ends)
    assert_close(d_ends, expected_ends, dtype, err_msg="d_ends")


def by_chunk(a):
    """``[tokens, HV, D]`` to ``[chunks, HV, C, D]``."""
    return a.reshape(a.shape[0] // CHUNK, CHUNK, *a.shape[1:]).swapaxes(1, 2)


def by_token(a):
    return a.swapaxes(1, 2).reshape(-1, *a.shape[1:2], a.shape[-1])


def xla_grads(q, k, e, x, g, d_y, starts, d_ends, heads):
    """Every chunk's gradients by ``jax.vjp`` of ``chunk_outputs``: ``(d_q, d_k, d_e, d_x,
    d_g)`` on the token layout, those of q and k summed over a key head's value heads."""

    def chunk_grads(q, k, e, x, g, start, d_y, d_end):
        _, pullback = jax.vjp(chunk_outputs, q, k, e, x, g, start)
        return pullback((d_y, d_end))[:5]

    inputs = (by_value_head(q, heads), by_value_head(k, heads), e, x, g, d_y)
    inputs = [by_chunk(a) for a in inputs]
    grads = jax.vmap(jax.vmap(chunk_grads))(*inputs[:5], starts, inputs[5], d_ends)
    d_q, d_k, d_e, d_x, d_g = (by_token(a) for a in grads)
    group = heads[1] // heads[0]

    def key_heads(a):
        return a.reshape(a.shape[0], heads[0], group, -1).sum(2)

    return key_heads(d_q), key_heads(d_k), d_e, d_x, d_g


@pytest.mark.parametrize(
    "dtype, key_dim, value_dim", [(jnp.float32, 64, 128), (jnp.bfloat16, 128, 128)]
)
def test_grads_kernel_equals_the_vjp_of_each_chunk(dtype, key_dim, value_dim):
    """Grouped value heads, two chunks, two blocks of value channels (the kernel's loop over
    them, dX leaving by TMA in bf16); float32 (two bf16 pieces an operand) at K = 64, bf16
    over two blocks of key channels. Each chunk's start state and end cotangent are its own
    (the kernel needs nothing carried)."""
    heads, chunks = (1, 2), 2
    q, k, e, x, g = contract_inputs(2, chunks, heads, key_dim, value_dim)
    rng = np.random.default_rng(3)
    state_shape = (chunks, heads[1], value_dim, key_dim)
    d_y, starts, d_ends = (
        jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for shape in (x.shape, state_shape, state_shape)
    )
    count = 1 if dtype == jnp.bfloat16 else 2
    pieces = [tiles.operand(a, count) for a in (q, k, e, x, d_y, starts, d_ends)]
    q, k, e, x, d_y, starts, d_ends = (sum(p.astype(jnp.float32) for p in a) for a in pieces)
    scores, inverse = (tiles.operand(a, count) for a in xla_factors(q, k, e, x, g, heads)[4:6])
    actual = grads.chunk_grads(*pieces[:4], g, scores, inverse, *pieces[4:], interpret=True)
    expected = xla_grads(q, k, e, x, g, d_y, starts, d_ends, heads)
    for name, a, b in zip(("q", "k", "e", "x", "g"), actual, expected, strict=True):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert_close(a, b, dtype, err_msg=f"d_{name}")
