"""Second order through the chunked forms: ``jax.hessian``, Hessian-vector products
(``jax.jvp`` of ``jax.grad``, forward over reverse) and mixed products (forward mode along
one input of the gradient of the others) against the recurrent form's, in float64,
with respect to every input of every rule, and through a batched op on packed sequences. Forward over reverse differentiates the hand-written backward forward, and with it
the triangular inverse that the forward and backward call (``chunked/triangular.py``)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.reference import as_array
from support.tolerance import assert_close

import gdn_jax
from gdn_jax.ops.rule import shape_of
from gdn_jax.ops.rules import RULES

F64 = jnp.float64
# 20 steps in chunks of 16: a full chunk and a tail of 4.
SEQ_STEPS, CHUNK, KEY_DIM, VALUE_DIM = 20, 16, 4, 3
STEPS = 2  # the steps a token of a rule that takes several (``Rule.steps``)


def rule_options(name):
    rule = RULES[name]
    return {} if rule.steps is None else {rule.steps: STEPS}


def draw(rng, rule, form, sizes):
    """q, k, v and the gates of ``rule`` in ``form``'s layout (keys of about unit norm,
    ``log_alpha = -softplus(N(0, 1))``, the other gates sigmoids of normals), in float64."""
    drawn = []
    for spec in rule.arguments:
        x = rng.standard_normal(shape_of(rule.layout(spec, form), sizes))
        if spec.name == "k":
            x /= np.sqrt(KEY_DIM)
        elif spec.name == "log_alpha":
            x = -np.logaddexp(0, x)
        elif spec.name in rule.gate_names:
            x = 1 / (1 + np.exp(-x))
        drawn.append(x)
    return drawn


def inputs_and_tangents(name, form, **sizes):
    """The inputs (q, k, v, the gates and the initial state) and one tangent of each."""
    rule = RULES[name]
    steps = rule.steps_per_token(rule_options(name))
    sizes = dict(T=SEQ_STEPS // steps, K=KEY_DIM, V=VALUE_DIM, n=steps, **sizes)
    rng = np.random.default_rng(len(name))
    lead = (sizes["B"], sizes["HV"]) if form == "batched" else ()
    inputs = [*draw(rng, rule, form, sizes), rng.standard_normal((*lead, VALUE_DIM, KEY_DIM))]
    tangents = [rng.standard_normal(x.shape) for x in inputs]
    return [as_array(x, F64) for x in inputs], [as_array(x, F64) for x in tangents]


def hessian_and_hvp(fn):
    """``run(inputs, tangents) -> (the Hessian's blocks [i][j], the Hessian-vector product
    of every input, the mixed product)`` of a loss of ``fn(*inputs) -> (y, final)``, jitted.
    The mixed product is ``jax.jvp`` along q's tangent of the gradient of the other inputs:
    forward mode reaches q, which reverse mode does not differentiate (it was refused)."""

    def loss(*inputs):
        y, final = fn(*inputs)
        return jnp.sum(jnp.sin(y)) + jnp.sum(final**2) / 2

    def run(inputs, tangents):
        argnums = tuple(range(len(inputs)))
        hessian = jax.hessian(loss, argnums=argnums)(*inputs)
        hvp = jax.jvp(jax.grad(loss, argnums=argnums), inputs, tangents)[1]
        others = jax.grad(loss, argnums=argnums[1:])
        mixed = jax.jvp(lambda q: others(q, *inputs[1:]), inputs[:1], tangents[:1])[1]
        return hessian, hvp, mixed

    return jax.jit(run)


@functools.cache
def one_head_results(name, impl, schedule=None):
    options = rule_options(name)
    if impl == "chunked":
        options.update(chunk_size=CHUNK, schedule=schedule)
    fn = getattr(gdn_jax, f"{name}_{impl}")
    run = hessian_and_hvp(lambda *a: fn(*a[:-1], initial_state=a[-1], **options))
    return run(*inputs_and_tangents(name, "one_head"))


def assert_second_order_equal(name, got, want, label):
    (hessian, hvp, mixed), (want_hessian, want_hvp, want_mixed) = got, want
    names = ("q", "k", "v", *RULES[name].gate_names, "initial_state")
    for i, a in enumerate(names):
        assert np.any(np.asarray(want_hvp[i]) != 0), f"{label}: the HVP of {a} is zero"
        assert_close(hvp[i], want_hvp[i], F64, f"{label}: HVP, {a}")
        if i > 0:
            assert_close(mixed[i - 1], want_mixed[i - 1], F64, f"{label}: along q, {a}")
        for j, b in enumerate(names):
            assert_close(hessian[i][j], want_hessian[i][j], F64, f"{label}: Hessian, {a}, {b}")


# Every rule in the CPU schedule, and the accelerators' (hoisted on TPU, associative on
# NVIDIA GPUs) of each chunked module: chunked.py's (the gated delta rule's) and
# channel_chunked.py's (KDA's).
CASES = [(name, "in_scan") for name in RULES] + [
    (name, schedule)
    for name in ("gated_delta_rule", "kda")
    for schedule in ("hoisted", "associative")
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "schedule"), CASES)
def test_hessian_and_hvp_of_the_chunked_form_equal_the_recurrent_forms(name, schedule):
    assert_second_order_equal(
        name,
        one_head_results(name, "chunked", schedule),
        one_head_results(name, "recurrent"),
        f"{name}, {schedule}",
    )


@functools.cache
def packed_results(name, impl):
    options = dict(rule_options(name), impl=impl, use_qk_l2norm=True)
    if impl == "chunked":
        options.update(chunk_size=CHUNK, schedule="in_scan")
    cu_seqlens = as_array(np.array([0, 7, 20]), jnp.int32)  # two sequences, each under a chunk
    op = getattr(gdn_jax, name)
    run = hessian_and_hvp(
        lambda *a: op(*a[:-1], initial_state=a[-1], cu_seqlens=cu_seqlens, **options)
    )
    inputs, tangents = inputs_and_tangents(name, "batched", B=1, H=1, HV=2)
    state, state_tangent = (jnp.concatenate([x, x[:, ::-1]]) for x in (inputs[-1], tangents[-1]))
    return run([*inputs[:-1], state], [*tangents[:-1], state_tangent])


def test_hessian_and_hvp_of_the_batched_op_on_packed_sequences():
    """Through the batched layout, grouped value heads and the packed layout's resets."""
    name = "gated_delta_rule"
    assert_second_order_equal(
        name, packed_results(name, "chunked"), packed_results(name, "recurrent"), "packed"
    )
