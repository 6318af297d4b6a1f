"""Kimi Delta Attention (per-channel gates): the step, the recurrent and chunked forms and the
batched entry point against the float64 loop, each other and the gated delta rule."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from support import cpu_schedule as on_cpu
from support import forms
from support.forms import with_state_and_cotangents
from support.hlo import dots
from support.reference import gated_delta_reference, random_inputs, random_state
from support.tolerance import assert_close

import gdn_jax
from gdn_jax.ops.chunked.blocks import add_groups, map_groups
from gdn_jax.ops.chunked.channel_backward import CPU_GRADS_GROUP, GRADS_GROUP, LEVELS_GROUP
from gdn_jax.ops.chunked.channel_decays import (
    channel_scores,
    channel_scores_bwd,
    halving_sizes,
    level_sums,
)
from gdn_jax.ops.chunked.channel_levels import (
    all_levels,
    all_levels_bwd,
    halving_levels_bwd,
    levels_bwd,
    summed,
    tables,
)

HEADS, V_HEADS, KEY, VALUE = 2, 4, 12, 10

kda = forms.batched("kda")
kda_recurrent = jax.jit(gdn_jax.kda_recurrent, static_argnames="scale")
kda_chunked = jax.jit(on_cpu.kda_chunked, static_argnames=("scale", "chunk_size", "schedule"))
# Jitted: eagerly each call would compile a program per operation.
kda_step = jax.jit(gdn_jax.kda_step, static_argnames="scale")


def batched_inputs(seed, seq_len, batch=1, **kw):
    return random_inputs(
        seed, seq_len, KEY, VALUE, lead=(batch,), heads=(HEADS, V_HEADS), per_channel=True, **kw
    )


def loop_per_head(q, k, v, la, b, state, n, i):
    """The float64 loop for sequence ``n`` and value head ``i`` of the batched layout."""
    h = i // (V_HEADS // HEADS)
    return gated_delta_reference(
        q[n, :, h], k[n, :, h], v[n, :, i], la[n, :, i], b[n, :, i], scale=KEY**-0.5,
        initial_state=None if state is None else state[n, i],
    )  # fmt: skip


def single_head_args(seed, seq_len, key_dim, value_dim, dtype=jnp.float32, **kw):
    inputs = random_inputs(seed, seq_len, key_dim, value_dim, dtype=dtype, per_channel=True, **kw)
    return with_state_and_cotangents(inputs, seed, seq_len, key_dim, value_dim, dtype)


def assert_forms_agree(args, dtype, chunked_options, label="", **kw):
    forms.assert_forms_agree("kda", args, dtype, chunked_options, label, **kw)


def outputs_and_grads(form, **options):
    return forms.outputs_and_grads("kda", form, **options)


# --- the step and the recurrent form against the float64 loop --------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_step_and_recurrent_match_the_float64_loop(dtype):
    # In NumPy: eager slices of JAX arrays would compile a program each.
    inputs = random_inputs(0, 40, KEY, VALUE, dtype=dtype, per_channel=True)
    q, k, v, la, b = (np.asarray(x) for x in inputs)
    state = random_state(1, VALUE, KEY, dtype=dtype)
    y_ref, s_ref = gated_delta_reference(q, k, v, la, b, scale=0.3, initial_state=state)
    y, s = kda_recurrent(q, k, v, la, b, scale=0.3, initial_state=state)
    assert y.dtype == dtype and s.dtype == dtype
    assert_close(y, y_ref, dtype)
    assert_close(s, s_ref, dtype)
    s1, y1 = kda_step(state, q[0], k[0], v[0], la[0], b[0], scale=0.3)
    y1_ref, s1_ref = gated_delta_reference(
        q[:1], k[:1], v[:1], la[:1], b[:1], scale=0.3, initial_state=state
    )
    assert_close(y1, y1_ref[0], dtype)
    assert_close(s1, s1_ref, dtype)


def test_channels_decay_separately():
    # One token, no write: column c of the state is scaled by exp(log_alpha[c]) alone.
    state = random_state(2, 3, 4, dtype=jnp.float64)
    la = jnp.log(jnp.asarray([1.0, 0.5, 0.25, 0.0], jnp.float64))
    zeros = jnp.zeros(4, jnp.float64)
    new, _ = kda_step(state, zeros, zeros, jnp.zeros(3, jnp.float64), la, 0.0)
    np.testing.assert_allclose(new, np.asarray(state) * [1.0, 0.5, 0.25, 0.0], rtol=1e-15)


# --- the chunked form against the recurrent one ------------------------------------------------


def test_channel_decays_and_scores_are_exact_segment_sums():
    """A chunk's decays and decayed scores in float32, with a -1e4 reset in one channel and
    -0.01 steps after it, against float64 sums: differences of running sums would lose those
    steps, and a split exp(G_t) exp(-G_i) would overflow."""
    rng = np.random.default_rng(3)
    g = rng.uniform(-1.0, 0.0, (64, 5))
    g[20, 1], g[21:, 1] = -1e4, -0.01
    x, k = rng.standard_normal((2, 64, 5)), rng.standard_normal((64, 5))
    _, decays = jax.jit(level_sums)(jnp.asarray(g, jnp.float32))
    cum = np.cumsum(g, 0)
    assert_close(decays.from_start, np.exp(cum), jnp.float32)
    assert_close(decays.to_end, np.exp(cum[-1] - cum), jnp.float32)
    assert_close(decays.whole, np.exp(cum[-1]), jnp.float32)
    t, i = np.arange(64)[:, None], np.arange(64)[None, :]
    segment = np.where((i <= t)[..., None], cum[:, None] - cum[None, :], -np.inf)
    after = (i <= t) & (i >= 21)
    segment[..., 1] = np.where(after, -0.01 * (t - i), segment[..., 1])  # not rounded sums
    expected = np.einsum("ptk,ik,tik->pti", x, k, np.exp(segment))
    xs = tuple(jnp.asarray(x_i, jnp.float32) for x_i in x)
    scores, from_scores = jax.jit(channel_scores)(
        xs, jnp.asarray(k, jnp.float32), jnp.asarray(g, jnp.float32)
    )
    assert_close(jnp.stack(scores), expected, jnp.float32)
    for made, alone in zip(from_scores, decays, strict=True):
        assert_close(made, alone, jnp.float32)


def test_channel_decays_need_no_products():
    """The scores and their pullback make one product per halving level and score (and per
    side in the pullback), nothing more: every sum of gates is elementwise work. A sum as a
    product with a triangle of ones came out of XLA:CPU with the tokens minor, and every use
    read it transposed (KDA's forward+backward 1.19x slower, docs/benchmarks.md)."""
    chunk, key_dim = 16, 8
    levels_of_products = len(halving_sizes(chunk))  # 4 (the finest is elementwise here)
    x = np.ones((chunk, key_dim), np.float32)
    gates = np.full((chunk, key_dim), -0.1, np.float32)

    def pullback(xs, k, log_alpha, d_scores):
        levels, decays = level_sums(log_alpha)
        d_decays = (k, k, k[0])
        return channel_scores_bwd(xs, k, levels, decays, d_scores, d_decays)

    d_scores = (np.ones((chunk, chunk), np.float32),) * 2
    forward = jax.jit(channel_scores).lower((x, x), x, gates).compile().as_text()
    backward = jax.jit(pullback).lower((x, x), x, gates, d_scores).compile().as_text()
    assert len(dots(forward.splitlines())) <= 2 * levels_of_products
    assert len(dots(backward.splitlines())) <= 2 * 2 * levels_of_products


def halving_pullback(xs, k, log_alpha, d_scores, d_decays):
    levels, decays = level_sums(log_alpha)
    return (*channel_scores_bwd(xs, k, levels, decays, d_scores, d_decays), decays)


@pytest.mark.parametrize("chunk", [16, 64])
def test_every_level_at_once_equals_the_halving(chunk):
    """The scores a GPU makes (``all_levels``: every level's products in one, every sum of
    gates one product with a matrix of ones) and their pullback equal the halving's, in
    float32 with a -1e4 reset in one channel and -0.01 steps after it, the decays and every
    cotangent included; so do the scores' pullback alone (``levels_bwd``, the associative
    backward's loop) and the halving's."""
    rng = np.random.default_rng(chunk)
    g = rng.uniform(-1.0, 0.0, (chunk, 5))
    g[chunk // 3, 1], g[chunk // 3 + 1 :, 1] = -1e4, -0.01
    xs = tuple(rng.standard_normal((2, chunk, 5)).astype(np.float32))
    k, g = rng.standard_normal((chunk, 5)).astype(np.float32), g.astype(np.float32)
    d_scores = tuple(rng.standard_normal((2, chunk, chunk)).astype(np.float32))
    d_decays = (*rng.standard_normal((2, chunk, 5)).astype(np.float32), k[0])
    want, got = jax.jit(channel_scores)(xs, k, g), jax.jit(all_levels)(xs, k, g)
    want_d = jax.jit(halving_pullback)(xs, k, g, d_scores, d_decays)
    got_d = jax.jit(all_levels_bwd)(xs, k, g, d_scores, d_decays)
    want_levels = jax.jit(halving_levels_bwd)(xs, k, g, d_scores)
    got_levels = jax.jit(levels_bwd)(xs, k, g, d_scores)
    cases = [("scores", got, want), ("pullback", got_d, want_d)]
    for name, a, e in [*cases, ("the scores' pullback", got_levels, want_levels)]:
        for i, (a_i, e_i) in enumerate(zip(jax.tree.leaves(a), jax.tree.leaves(e), strict=True)):
            assert_close(a_i, e_i, jnp.float32, f"{name} {i}")


def test_the_gpu_sums_of_gates_lose_no_bit():
    """The GPU multiplies the sums' matrix of ones by three bfloat16 parts of each gate
    (``channel_levels.summed``, ``BF16_BF16_F32_X6``): the parts hold every float32 gate
    exactly, a -1e4 reset and the -0.01 steps after it too, so each sum is float32's. XLA:CPU,
    which runs these tests, multiplies in float32 whatever the algorithm, so the split is
    checked here, and that the compiled sums ask for it."""
    rng = np.random.default_rng(5)
    g = np.concatenate([rng.uniform(-1.0, 0.0, 4096), [-1e4, -0.01, -3e-30, -0.0]])
    g = g.astype(np.float32)
    parts, rest = [], g
    for _ in range(3):
        parts.append(rest.astype(jnp.bfloat16).astype(np.float32))
        rest = rest - parts[-1]
    np.testing.assert_array_equal(parts[0] + parts[1] + parts[2], g)
    ones = tables(16).sums
    program = jax.jit(functools.partial(summed, ones)).lower(g[:16, None]).compile().as_text()
    assert "dot_bf16_bf16_f32_x6" in program


def test_every_level_at_once_makes_as_many_products_at_every_chunk_size():
    """What the GPU's scores are for: as many products for 16 tokens (4 levels) as for 64
    (6), and no loop, where the halving makes one a level and side: the levels' products,
    the sums of gates (one product with ones for every level), the decays' and, in the
    pullback, the sums' pullback."""

    def products(chunk):
        x = np.ones((chunk, 8), np.float32)
        d_scores = (np.ones((chunk, chunk), np.float32),) * 2
        forward = jax.jit(all_levels).lower((x, x), x, x).compile().as_text()
        backward = jax.jit(all_levels_bwd).lower((x, x), x, x, d_scores, (x, x, x[0])).compile()
        backward = backward.as_text()
        assert " while(" not in forward + backward
        return len(dots(forward.splitlines())), len(dots(backward.splitlines()))

    assert products(16) == products(64)


def test_chunked_with_the_gpu_scores_equals_recurrent(monkeypatch):
    """The whole op as it runs on a GPU (every platform choice takes its GPU branch: the
    scores of every level at once, the barriers, ``LEVELS_GROUP`` chunks a group), on this
    CPU: values and every gradient against the recurrent form, with more chunks than a
    group, the last group shorter, off the chunk grid."""
    monkeypatch.setattr(jax.lax, "platform_dependent", forms.as_on_an_nvidia_gpu)
    args = single_head_args(60, 16 * (LEVELS_GROUP + 3) - 5, 8, 6)
    options = dict(chunk_size=16, schedule="associative")
    assert_forms_agree(args, jnp.float32, options, "GPU branches", shared=False)


CHUNKED_CASES = [
    # (T, K, V, chunk_size, schedule): T not a multiple of C; the default and the largest
    # chunks (the smallest is in the batched tests); K and V odd sizes; every schedule.
    (130, 16, 24, 64, "in_scan"),
    (150, 20, 12, 128, "hoisted"),
    (150, 20, 12, 16, "associative"),
    # More chunks than the hoisted backward takes at a time (GRADS_GROUP, CPU_GRADS_GROUP
    # here), and a shorter last group.
    (16 * (GRADS_GROUP + 3) - 5, 8, 6, 16, "hoisted"),
]
assert (GRADS_GROUP + 3) % CPU_GRADS_GROUP, "the CPU's last group of chunks is a short one"


@pytest.mark.parametrize("total", [7, 16, 37])
def test_map_groups_equals_mapping_every_entry(total):
    """In groups of 16, fewer, exactly one group, and two with a shorter third: the same as
    mapping each entry, with a gate an op lacks (None) passing through; and ``add_groups``
    the same added to totals."""
    rng = np.random.default_rng(total)
    a, b = (jnp.asarray(rng.standard_normal((total, 3, *tail))) for tail in ((), (2,)))

    def fn(a, missing, b):
        assert missing is None
        return a.sum() * b, None, jnp.sin(a)

    got = map_groups(fn, (a, None, b), 16)
    want = jax.vmap(fn)(a, None, b)
    assert got[1] is None
    totals = (jnp.asarray(rng.standard_normal(want[0].shape)), None, jnp.cos(a))
    added = add_groups(fn, (a, None, b), totals, 16)
    assert added[1] is None
    # Within float64's rounding, not to the bit: XLA:GPU sums a group in another order.
    for g, w in ((got[0], want[0]), (got[2], want[2])):
        assert_close(g, w, jnp.float64)
    for g, w, t in ((added[0], want[0], totals[0]), (added[2], want[2], totals[2])):
        assert_close(g, w + t, jnp.float64)


@pytest.mark.parametrize(("seq_len", "key_dim", "value_dim", "chunk", "schedule"), CHUNKED_CASES)
def test_chunked_equals_recurrent_values_and_gradients(
    seq_len, key_dim, value_dim, chunk, schedule
):
    args = single_head_args(seq_len, seq_len, key_dim, value_dim)
    options = dict(chunk_size=chunk, schedule=schedule)
    assert_forms_agree(args, jnp.float32, options, f"T={seq_len} C={chunk} {schedule}")


def test_chunked_equals_recurrent_in_float64():
    """The acceptance check: exact to float64 tolerance on values and every gradient, with
    strong decays and a padded tail."""
    args = single_head_args(40, 300, 8, 6, dtype=jnp.float64, log_alpha_range=(-3.0, 0.0))
    assert_forms_agree(args, jnp.float64, dict(chunk_size=64, schedule="in_scan"))


def test_chunked_finite_differences_float64():
    q, k, v, la, b = random_inputs(50, 37, 4, 3, dtype=jnp.float64, per_channel=True)
    state = random_state(51, 3, 4, dtype=jnp.float64)
    run = jax.jit(lambda *a: on_cpu.kda_chunked(*a[:5], initial_state=a[5], chunk_size=32))
    check_grads(run, (q, k, v, la, b, state), order=1, modes=["rev"], eps=1e-6)


GATE_EDGES = ["no decay", "channels reset", "mixed"]


def edge_gates(edge, la):
    """``la`` with its edges set, in NumPy: eager updates of JAX arrays would compile a
    program each."""
    la = np.array(la)
    if edge == "no decay":
        la[:] = 0.0
    elif edge == "channels reset":  # -inf in a few (token, channel) places, others random
        la[[0, 17, 40, 41, 99], [0, 3, 3, 5, 1]] = -np.inf
    else:
        # Mixed: channel 0 never decays, channel 1 always resets, channel 2 resets every 16
        # tokens and decays by -0.01 between, the rest random.
        la[:, 0], la[:, 1] = 0.0, -np.inf
        la[:, 2] = np.where(np.arange(la.shape[0]) % 16 == 3, -1e4, -0.01)
    return la


@pytest.mark.parametrize("edge", GATE_EDGES)
def test_gate_edges_are_finite_and_exact(edge):
    # The shapes and options of a case above: the same compiled programs.
    q, k, v, la, b, state, ct_y, ct_s = single_head_args(60, 130, 16, 24)
    la = edge_gates(edge, la)
    b = np.array(b)
    b[::5], b[1::5] = 0.0, 2.0  # no write and reflection too
    args = (q, k, v, la, b, state, ct_y, ct_s)
    y_ref, s_ref = gated_delta_reference(q, k, v, la, b, scale=16**-0.5, initial_state=state)
    y, s, _ = outputs_and_grads("chunked", chunk_size=64, schedule="in_scan")(*args)
    assert np.isfinite(y).all() and np.isfinite(s).all()
    assert_close(y, y_ref, jnp.float32, edge)
    assert_close(s, s_ref, jnp.float32, edge)
    assert_forms_agree(args, jnp.float32, dict(chunk_size=64, schedule="in_scan"), edge)


def test_extent_of_a_nan_at_one_token():
    """The documented extent (kda_chunkwise.py): a NaN at token t in q reaches y_t alone, in
    k, v, log_alpha or beta the outputs from the start of t's chunk on."""
    inputs = random_inputs(20, 40, 4, 3, per_channel=True)
    t, chunk_start = 20, 16
    for i, name in enumerate(["q", "k", "v", "log_alpha", "beta"]):
        poisoned = [np.array(x) for x in inputs]  # set in NumPy: eager updates compile
        poisoned[i][t] = np.nan
        y, _ = kda_chunked(*poisoned, chunk_size=16)
        nan_rows = np.flatnonzero(~np.isfinite(np.asarray(y)).all(1))
        expected = [t] if name == "q" else list(range(chunk_start, 40))
        assert nan_rows.tolist() == expected, name


def test_residuals_are_the_inputs_and_one_state_per_chunk():
    """What the backward keeps grows with T by the inputs and one [V, K] state per chunk
    (two lengths, so the constant masks the recomputation needs cancel out)."""
    forms.assert_residuals_are_inputs_and_one_state_per_chunk(
        "kda", lambda seq_len: single_head_args(70, seq_len, 8, 8)[:6], chunk=64
    )


# --- the batched entry point -------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["chunked", "recurrent"])
def test_batched_grouped_heads_match_the_loop_per_head(impl):
    q, k, v, la, b = batched_inputs(3, 33, batch=2)
    state = random_state(4, 2, V_HEADS, VALUE, KEY)
    out, final = kda(q, k, v, la, b, initial_state=state, impl=impl, chunk_size=16)
    assert out.shape == (2, 33, V_HEADS, VALUE) and final.shape == (2, V_HEADS, VALUE, KEY)
    # Sliced in NumPy: eager slices of JAX arrays would compile a program per shape.
    q, k, v, la, b, state, out, final = (np.asarray(x) for x in (q, k, v, la, b, state, out, final))
    for n in range(2):
        for i in range(V_HEADS):
            y, s = loop_per_head(q, k, v, la, b, state, n, i)
            assert_close(out[n, :, i], y, jnp.float32, f"sequence {n}, value head {i}")
            assert_close(final[n, i], s, jnp.float32, f"sequence {n}, value head {i}")


gdn = forms.batched("gated_delta_rule")


@pytest.mark.parametrize("impl", ["chunked", "recurrent"])
def test_equal_channels_are_the_gated_delta_rule(impl):
    q, k, v, la, b = random_inputs(5, 45, KEY, VALUE, lead=(1,), heads=(HEADS, V_HEADS))
    state = random_state(6, 1, V_HEADS, VALUE, KEY)
    la_channels = jnp.broadcast_to(la[..., None], (*la.shape, KEY))
    out, final = kda(q, k, v, la_channels, b, initial_state=state, impl=impl, chunk_size=32)
    out_gdn, final_gdn = gdn(q, k, v, la, b, initial_state=state, impl=impl, chunk_size=32)
    assert_close(out, out_gdn, jnp.float32)
    assert_close(final, final_gdn, jnp.float32)


def test_packed_sequences_equal_separate_runs():
    cu = [0, 5, 5, 70, 100]  # an empty sequence, and sequences across chunk boundaries
    inputs = batched_inputs(7, 100)
    state = random_state(8, len(cu) - 1, V_HEADS, VALUE, KEY)
    ct_out = random_state(9, 1, 100, V_HEADS, VALUE)
    forms.assert_packed_equals_separate("kda", inputs, state, ct_out, cu, loop_per_head)


def test_bfloat16_inputs_keep_a_float32_state():
    inputs = batched_inputs(10, 45)
    state = random_state(11, 1, V_HEADS, VALUE, KEY)
    low = tuple(x.astype(jnp.bfloat16) for x in inputs)
    run = functools.partial(kda, initial_state=state, impl="chunked", chunk_size=32)
    out, final = run(*low)
    assert out.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    # The same op on the bf16 values held in float32 (the program of the test above).
    out_ref, final_ref = run(*(x.astype(jnp.float32) for x in low))
    assert_close(out, out_ref, jnp.bfloat16)
    assert_close(final, final_ref, jnp.float32)


def test_long_sequence_is_finite_and_matches_recurrent():
    """The acceptance length, T = 16384, at small dims in one forward of each form."""
    q, k, v, la, b = random_inputs(13, 16384, 8, 8, per_channel=True, log_alpha_range=(-0.1, 0))
    y_chk, s_chk = kda_chunked(q, k, v, la, b, chunk_size=64)
    assert np.isfinite(y_chk).all() and np.isfinite(s_chk).all()
    y_rec, s_rec = kda_recurrent(q, k, v, la, b)
    assert_close(y_chk, y_rec, jnp.float32)
    assert_close(s_chk, s_rec, jnp.float32)


# --- bad inputs --------------------------------------------------------------------------------


def test_a_per_head_log_alpha_is_refused_naming_the_argument():
    q, k, v, la, b = random_inputs(14, 8, KEY, VALUE, lead=(1,), heads=(HEADS, V_HEADS))
    with pytest.raises(
        ValueError,
        match=r"kda: log_alpha must have shape \[B, T, HV, K\] \(one gate per key channel\) = "
        r"\(1, 8, 4, 12\), got \(1, 8, 4\)",
    ):
        gdn_jax.kda(q, k, v, la, b)
    q1, k1, v1, la1, b1 = random_inputs(14, 8, KEY, VALUE)
    for fn in (gdn_jax.kda_recurrent, gdn_jax.kda_chunked):
        with pytest.raises(ValueError, match=rf"{fn.__name__}: log_alpha must have shape \[T, K\]"):
            fn(q1, k1, v1, la1, b1)
    with pytest.raises(ValueError, match=r"kda_step: log_alpha must have shape \[K\]"):
        gdn_jax.kda_step(jnp.zeros((VALUE, KEY)), q1[0], k1[0], v1[0], la1[0], b1[0])
    per_channel = batched_inputs(14, 8)
    with pytest.raises(ValueError, match=r"kda: chunk_size=48 must be one of"):
        gdn_jax.kda(*per_channel, chunk_size=48)
    with pytest.raises(ValueError, match=r"kda: impl='fast' must be one of"):
        gdn_jax.kda(*per_channel, impl="fast")
