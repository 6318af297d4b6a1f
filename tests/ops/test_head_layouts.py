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

# KDA, where XLA:CPU crashed, runs every layout; the other rules one of each kind, one head
# and grouped heads: GDN-2 runs KDA's engine (ops/channel_chunked.py) with the same per value
# head q and k (``Rule.shares_qk``), and the scalar-decay rules share q and k over a group.
LAYOUTS = [(1, 1), (1, 2), (2, 2), (2, 4), (3, 6)]
EVERY_LAYOUT = ("kda",)
ONE_OF_EACH = [(1, 1), (2, 4)]
FORMS = {
    "recurrent": dict(impl="recurrent"),
    "in_scan": dict(impl="chunked", schedule="in_scan"),
    "hoisted": dict(impl="chunked", schedule="hoisted"),
}
# The crash's own shape: T = 70 leaves a tail of 6 tokens in the last chunk of 64.
BATCH, SEQ_LEN, KEY_DIM, VALUE_DIM = 1, 70, 32, 48
DRAWS = (0, 1)
CASES = [
    pytest.param(name, heads, v_heads, form, id=f"{name}-H{heads}-HV{v_heads}-{form}")
    for name in RULES
    for heads, v_heads in (LAYOUTS if name in EVERY_LAYOUT else ONE_OF_EACH)
    for form in ("in_scan", "hoisted")
]


def inputs(seed, heads, v_heads, gates):
    """q, k, v, the rule's gates (``log_alpha = -softplus(N(0, 1))``, the others sigmoids of
    normals, each with its channel axis) and an initial state."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    q = normal(BATCH, SEQ_LEN, heads, KEY_DIM)
    k = normal(BATCH, SEQ_LEN, heads, KEY_DIM)
    v = normal(BATCH, SEQ_LEN, v_heads, VALUE_DIM)
    channels = {None: (), "K": (KEY_DIM,), "V": (VALUE_DIM,)}
    drawn = []
    for spec in gates:
        x = normal(BATCH, SEQ_LEN, v_heads, *channels[spec.channels])
        drawn.append(-jax.nn.softplus(x) if spec.name == "log_alpha" else jax.nn.sigmoid(x))
    state = normal(BATCH, v_heads, VALUE_DIM, KEY_DIM)
    return q, k, v, *drawn, state


@functools.cache
def results(name, heads, v_heads, form):
    """The outputs, final states and gradients of ``name``'s op in ``form`` on each draw, by
    what they are, each checked finite."""
    op, gates = getattr(gdn_jax, name), RULES[name].gates

    def loss(*args):
        o, final = op(*args[:-1], initial_state=args[-1], use_qk_l2norm=True, **FORMS[form])
        return jnp.sum(jnp.sin(o)) + jnp.sum(final**2) / 100, (o, final)

    run = jax.jit(jax.grad(loss, argnums=tuple(range(4 + len(gates))), has_aux=True))
    names = ["o", "final", "dq", "dk", "dv", *(f"d{g.name}" for g in gates), "dstate"]
    draws = []
    for seed in DRAWS:
        grads, values = run(*inputs(seed, heads, v_heads, gates))
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
