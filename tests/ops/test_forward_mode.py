"""Forward-mode autodiff through the chunked forms is one named ``ValueError`` on every route,
for every rule, and never for forward over reverse (test_second_order.py runs that, the
mixed derivatives included).

It was an ``isinstance(x, JVPTracer)`` test at trace time: under ``jax.jit``, ``nnx.jit`` or
``jax.linearize`` JAX differentiates the program after tracing it, so those routes ended in
JAX's raw ``TypeError`` (``can't apply forward-mode autodiff (jvp) to a custom_vjp
function``); and ``jax.jvp`` of ``jax.grad`` with respect to another input (a mixed second
derivative) was refused, though it runs. Each route here raises before anything is compiled
(the traced ones when the program is lowered), at sizes that trace quickly.
"""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from support import cpu_schedule
from support.reference import as_array

import gdn_jax
from gdn_jax.ops.rule import LOG_DECAY, shape_of
from gdn_jax.ops.rules import RULES

# Each way forward mode reaches the op, as ``route(f, x)`` with ``f`` a function of v.
ROUTES = {
    "jvp": lambda f, x: jax.jvp(f, (x,), (x,)),
    "jacfwd": lambda f, x: jax.jacfwd(f)(x),
    "jit of jvp": lambda f, x: jax.jit(lambda x: jax.jvp(f, (x,), (x,)))(x),
    "jvp of jit": lambda f, x: jax.jvp(jax.jit(f), (x,), (x,)),
    "jvp of nnx.jit": lambda f, x: jax.jvp(nnx.jit(f), (x,), (x,)),
    "linearize": lambda f, x: jax.jit(lambda x: jax.linearize(f, x)[1](x))(x),
}
# Where the traced routes trace every form of every rule, the rest run the eager ones.
TRACED = ("jit of jvp", "jvp of jit", "jvp of nnx.jit", "linearize")
T, K, V, CHUNK = 20, 4, 3, 16


def inputs(rule, form):
    """q, k, v and the gates of ``rule`` in ``form``'s layout, float32, and its options."""
    steps = 2 if rule.steps else 1
    sizes = dict(B=1, T=T // steps, H=1, HV=1, K=K, V=V, n=steps)
    rng = np.random.default_rng(0)
    drawn = [rng.uniform(0.1, 0.9, shape_of(rule.layout(s, form), sizes)) for s in rule.arguments]
    for i, spec in enumerate(rule.arguments):
        drawn[i] *= -1 if spec.name == LOG_DECAY else 1  # decays in log space are <= 0
    options = {rule.steps: steps} if rule.steps else {}
    return [as_array(x, np.float32) for x in drawn], options


def op_of_v(name, form):
    """``(f, v)``: ``f(v)`` the output of ``name``'s op in ``form`` with the other inputs
    fixed (``"batched"``, ``"one_head"`` or ``"seq_parallel"``)."""
    rule = RULES[name]
    layout = "one_head" if form == "one_head" else "batched"
    (q, k, v, *gates), options = inputs(rule, layout)
    options.update(chunk_size=CHUNK, schedule=cpu_schedule.SCHEDULE)
    if form == "one_head":
        op = getattr(gdn_jax, f"{name}_chunked")
    elif form == "batched":
        op = getattr(gdn_jax, name)
    else:
        op = getattr(gdn_jax, f"{name}_seq_parallel")
        options["mesh"] = Mesh(np.asarray(jax.devices()[:1]), ("seq",))
    return (lambda v: op(q, k, v, *gates, **options)[0]), v


def expected(name, form):
    fn = {"one_head": f"{name}_chunked", "seq_parallel": f"{name}_seq_parallel"}.get(form, name)
    return rf"^{fn}: forward-mode autodiff \(jax.jvp, jax.jacfwd, jax.linearize\) reaches v, "


@pytest.mark.parametrize("name", list(RULES))
@pytest.mark.parametrize("route", list(ROUTES))
def test_forward_mode_is_one_named_error_on_every_route(name, route):
    forms = ["one_head"] if route in TRACED else ["one_head", "batched", "seq_parallel"]
    for form in forms:
        f, v = op_of_v(name, form)
        with pytest.raises(ValueError, match=expected(name, form)):
            ROUTES[route](f, v)


@pytest.mark.parametrize("name", list(RULES))
def test_the_batched_op_traced_forward_says_what_to_use(name):
    f, v = op_of_v(name, "batched")
    with pytest.raises(ValueError, match=r'for forward mode use impl="recurrent" \(jax.grad, '):
        ROUTES["jvp of jit"](f, v)


def test_the_one_head_and_sequence_parallel_forms_say_what_to_use():
    for form, instead in (
        ("one_head", "gated_delta_rule_recurrent"),
        ("seq_parallel", 'the one-device op with impl="recurrent"'),
    ):
        f, v = op_of_v("gated_delta_rule", form)
        with pytest.raises(ValueError, match=rf"for forward mode use {instead} "):
            ROUTES["jvp"](f, v)


def test_linearize_raises_when_it_is_called_not_when_its_linear_function_runs():
    """``jax.linearize`` returned, and its linear function raised at its first call: a
    program that linearizes once and pushes tangents later failed far from the cause. (JAX's
    vjp linearizes too, to transpose: test_gradients.py runs it.)"""
    for form in ("one_head", "batched"):
        f, v = op_of_v("gated_delta_rule", form)
        with pytest.raises(ValueError, match=expected("gated_delta_rule", form)):
            jax.linearize(f, v)


def test_the_mosaic_gpu_kernel_refuses_forward_mode_too():
    f, v = op_of_v("gated_delta_rule", "batched")
    (q, k, _, *gates), _ = inputs(RULES["gated_delta_rule"], "batched")

    def kernel(v):
        return gdn_jax.gated_delta_rule(q, k, v, *gates, impl="mosaic_gpu", chunk_size=64)[0]

    with pytest.raises(ValueError, match=expected("gated_delta_rule", "batched")):
        ROUTES["jvp"](kernel, v)


def test_forward_mode_runs_through_the_recurrent_form():
    (q, k, v, *gates), _ = inputs(RULES["gated_delta_rule"], "batched")

    def recurrent(v):
        return gdn_jax.gated_delta_rule(q, k, v, *gates, impl="recurrent")[0]

    out, tangent = ROUTES["jit of jvp"](recurrent, v)
    assert tangent.shape == out.shape and np.isfinite(tangent).all()
