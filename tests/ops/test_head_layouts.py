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
from gdn_jax.ops.rule import shape_of
from gdn_jax.ops.rules import RULES

# KDA, where XLA:CPU crashed, runs every layout; the other ops grouped value heads, the
# layout that crashed (one head per layout is every other op test's, under the suite's
# flags): GDN-2 runs KDA's engine (ops/chunked/channel.py) with the same per value head q and
# k (``Rule.shares_qk``), the scalar-decay rules (Gated DeltaProduct among them: the gated
# delta rule over each token's n steps) share q and k over a group.
LAYOUTS = [(1, 1), (1, 2), (2, 4), (3, 6)]  # one head, and groups of 2 in three spreads
EVERY_LAYOUT = ("kda",)
GROUPED = [(2, 4)]
FORMS = {
    "recurrent": dict(impl="recurrent"),
    "in_scan": dict(impl="chunked", schedule="in_scan"),
    "hoisted": dict(impl="chunked", schedule="hoisted"),
    "associative": dict(impl="chunked", schedule="associative"),
}
# The crash's own shape: T = 70 leaves a tail of 6 tokens in the last chunk of 64.
BATCH, SEQ_LEN, KEY_DIM, VALUE_DIM = 1, 70, 32, 48
DRAWS = (0, 1)
STEPS = 2  # the steps a token of a rule that takes several (``Rule.steps``)
CASES = [
    pytest.param(name, heads, v_heads, form, id=f"{name}-H{heads}-HV{v_heads}-{form}")
    for name in RULES
    for heads, v_heads in (LAYOUTS if name in EVERY_LAYOUT else GROUPED)
    for form in ("in_scan", "hoisted")
] + [
    # The associative scan over chunks (the GPUs' schedule) in the grouped layout of each rule.
    pytest.param(name, *GROUPED[0], "associative", id=f"{name}-H2-HV4-associative")
    for name in RULES
]


def rule_options(name):
    """The options of ``name``'s public forms: ``STEPS`` steps a token where it takes
    several."""
    rule = RULES[name]
    return {} if rule.steps is None else {rule.steps: STEPS}


def inputs(seed, name, heads, v_heads):
    """q, k, v, the op's gates in their layouts (``log_alpha = -softplus(N(0, 1))``, the
    others sigmoids of normals times the steps a token: beta in (0, 2) with two) and an
    initial state."""
    rng = np.random.default_rng(seed)
    rule = RULES[name]
    steps = rule.steps_per_token(rule_options(name))
    sizes = dict(B=BATCH, T=SEQ_LEN, H=heads, HV=v_heads, K=KEY_DIM, V=VALUE_DIM, n=steps)
    drawn = []
    for spec in rule.arguments:
        shape = shape_of(rule.layout(spec, "batched"), sizes)
        x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        if spec.name in rule.gate_names:
            x = -jax.nn.softplus(x) if spec.name == "log_alpha" else jax.nn.sigmoid(x) * steps
        drawn.append(x)
    state = jnp.asarray(rng.standard_normal((BATCH, v_heads, VALUE_DIM, KEY_DIM)), jnp.float32)
    return *drawn, state


@functools.cache
def results(name, heads, v_heads, form):
    """The outputs, final states and gradients of ``name``'s op in ``form`` on each draw, by
    what they are, each checked finite."""
    op, gates = getattr(gdn_jax, name), RULES[name].gate_names
    options = dict(use_qk_l2norm=True, **rule_options(name), **FORMS[form])

    def loss(*args):
        o, final = op(*args[:-1], initial_state=args[-1], **options)
        return jnp.sum(jnp.sin(o)) + jnp.sum(final**2) / 100, (o, final)

    run = jax.jit(jax.grad(loss, argnums=tuple(range(4 + len(gates))), has_aux=True))
    names = ["o", "final", "dq", "dk", "dv", *(f"d{gate}" for gate in gates), "dstate"]
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
