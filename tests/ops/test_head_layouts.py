"""Every public batched op over the head layouts (H, HV), recurrent and chunked in both
schedules, forward and gradients, compiled as a user's process compiles them.

These run in the child session of kind ``user_xla`` (support/child_session.py): with XLA:CPU's
default library fusions, not the ``CPU_FLAGS`` of train.py and this suite. With those defaults
jaxlib 0.10.2 segfaulted, or returned wrong gradients, on KDA's grouped heads, and the suite's
own flags hid it; in the child a crash fails its named case.

Each case is one jitted program that returns the outputs, the final states and the gradients
of a loss with respect to every input (initial state included, q and k L2-normalised in the
op) at a length off the chunk grid, run on two random draws: everything finite, and each
chunked case equal to the recurrent one of its layout.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.tolerance import assert_close

import gdn_jax
from gdn_jax.ops.rules import RULES

# KDA, where XLA:CPU crashed, runs every layout; the other ops grouped value heads, the
# layout that crashed (one head per layout is every other op test's, under the suite's
# flags): GDN-2 runs KDA's engine (ops/channel_chunked.py) with the same per value head q and
# k (``Rule.shares_qk``), the scalar-decay rules and Gated DeltaProduct (the gated delta rule
# over each token's n steps) share q and k over a group.
LAYOUTS = [(1, 1), (1, 2), (2, 4), (3, 6)]  # one head, and groups of 2 in three spreads
EVERY_LAYOUT = ("kda",)
GROUPED = [(2, 4)]
PRODUCT = "gated_delta_product"  # n = 2 steps a token, not in RULES (its own gates' lengths)
FORMS = {
    "recurrent": dict(impl="recurrent"),
    "in_scan": dict(impl="chunked", schedule="in_scan"),
    "hoisted": dict(impl="chunked", schedule="hoisted"),
}
# The crash's own shape: T = 70 leaves a tail of 6 tokens in the last chunk of 64.
BATCH, SEQ_LEN, KEY_DIM, VALUE_DIM = 1, 70, 32, 48
DRAWS = (0, 1)
STEPS = 2  # Gated DeltaProduct's Householder steps a token
CASES = [
    pytest.param(name, heads, v_heads, form, id=f"{name}-H{heads}-HV{v_heads}-{form}")
    for name in (*RULES, PRODUCT)
    for heads, v_heads in (LAYOUTS if name in EVERY_LAYOUT else GROUPED)
    for form in ("in_scan", "hoisted")
]


def op_and_gates(name):
    """The batched op and its gates ``(name, channel axis, steps a token)``."""
    if name == PRODUCT:
        op = functools.partial(gdn_jax.gated_delta_product, num_householder=STEPS)
        return op, (("log_alpha", None, 1), ("beta", None, STEPS))
    return getattr(gdn_jax, name), tuple((g.name, g.channels, 1) for g in RULES[name].gates)


def inputs(seed, name, heads, v_heads):
    """q, k, v, the op's gates (``log_alpha = -softplus(N(0, 1))``, the others sigmoids of
    normals, each with its channel axis; Gated DeltaProduct's beta in (0, 2) and its k, v and
    beta one per step) and an initial state."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    steps = STEPS if name == PRODUCT else 1
    q = normal(BATCH, SEQ_LEN, heads, KEY_DIM)
    k = normal(BATCH, SEQ_LEN * steps, heads, KEY_DIM)
    v = normal(BATCH, SEQ_LEN * steps, v_heads, VALUE_DIM)
    channels = {None: (), "K": (KEY_DIM,), "V": (VALUE_DIM,)}
    drawn = []
    for gate, axis, per_token in op_and_gates(name)[1]:
        x = normal(BATCH, SEQ_LEN * per_token, v_heads, *channels[axis])
        drawn.append(-jax.nn.softplus(x) if gate == "log_alpha" else jax.nn.sigmoid(x) * steps)
    state = normal(BATCH, v_heads, VALUE_DIM, KEY_DIM)
    return q, k, v, *drawn, state


@functools.cache
def results(name, heads, v_heads, form):
    """The outputs, final states and gradients of ``name``'s op in ``form`` on each draw, by
    what they are, each checked finite."""
    op, gates = op_and_gates(name)

    def loss(*args):
        o, final = op(*args[:-1], initial_state=args[-1], use_qk_l2norm=True, **FORMS[form])
        return jnp.sum(jnp.sin(o)) + jnp.sum(final**2) / 100, (o, final)

    run = jax.jit(jax.grad(loss, argnums=tuple(range(4 + len(gates))), has_aux=True))
    names = ["o", "final", "dq", "dk", "dv", *(f"d{gate[0]}" for gate in gates), "dstate"]
    draws = []
    for seed in DRAWS:
        grads, values = run(*inputs(seed, name, heads, v_heads))
        out = dict(zip(names, (np.asarray(x) for x in (*values, *grads)), strict=True))
        for what, x in out.items():
            assert np.isfinite(x).all(), f"{form}, draw {seed}: {what} is not finite"
        draws.append(out)
    return draws


@pytest.mark.child(user_xla=True)
@pytest.mark.parametrize("name, heads, v_heads, form", CASES)
def test_chunked_runs_finite_and_equals_recurrent(name, heads, v_heads, form):
    chunked = results(name, heads, v_heads, form)
    recurrent = results(name, heads, v_heads, "recurrent")
    for seed, got, want in zip(DRAWS, chunked, recurrent, strict=True):
        for what, value in got.items():
            assert_close(value, want[what], jnp.float32, f"draw {seed}: {what} against recurrent")
