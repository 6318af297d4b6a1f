"""What the op tests share: one jitted program per form of a rule's single-head op, recurrent
or chunked (in the CPU schedule unless named), that returns the outputs, the final state and
the gradient of every input for given cotangents (so values and gradients compile together,
and tests of one shape reuse one program: test_gradients.py, test_schedules.py, test_kda.py,
test_gdn2.py), the same for the batched op on packed sequences (test_varlen.py and
test_schedules.py), the batched ops jitted, the checks that the channel-gated rules'
tests (test_kda.py, test_gdn2.py) share, and a rule's public step token by token against
its recurrent form (test_simple_gla.py, test_gated_delta_product.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import gdn_jax
from gdn_jax.ops.rules import RULES
from support import cpu_schedule as on_cpu
from support.reference import random_state
from support.tolerance import assert_close


@functools.cache
def batched(rule):
    """``rule``'s batched op in the CPU schedule, jitted with its options static: one function
    per rule, so that the tests of different files that call it at one shape share a program
    (test_kda.py's and test_gdn2.py's comparisons with KDA and the gated delta rule)."""
    options = ("impl", "chunk_size", "schedule", "use_qk_l2norm", "scale")
    return jax.jit(getattr(on_cpu, rule), static_argnames=options)


def outputs_and_grads(rule, form, **options):
    """``run(*inputs, state, ct_y, ct_s) -> (y, final, grads of the inputs and the state)``
    of ``rule``'s single-head op in ``form`` ("recurrent" or "chunked"), one per rule, form
    and options whatever the order the options are named in."""
    return _outputs_and_grads(rule, form, tuple(sorted(options.items())))


@functools.cache
def _outputs_and_grads(rule, form, options):
    options = dict(options)
    chunked = getattr(on_cpu, f"{rule}_chunked")
    fn = getattr(gdn_jax, f"{rule}_recurrent") if form == "recurrent" else chunked
    num_inputs = 3 + len(RULES[rule].gates)

    def run(*args):
        *inputs, state, ct_y, ct_s = args

        def loss(*args):
            y, s = fn(*args[:num_inputs], initial_state=args[num_inputs], **options)
            return jnp.sum(y * ct_y) + jnp.sum(s * ct_s), (y, s)

        argnums = range(num_inputs + 1)
        grads, (y, s) = jax.grad(loss, argnums=argnums, has_aux=True)(*inputs, state)
        return y, s, grads

    return jax.jit(run)


def packed_outputs_and_grads(rule, **options):
    """``run(cu_seqlens, *inputs, state, ct_out, ct_final) -> (out, final, grads of the inputs
    and the state)`` of ``rule``'s batched op (CPU schedule unless named) on the packed
    sequences of a traced ``cu_seqlens``, one per rule and options as above."""
    return _packed_outputs_and_grads(rule, tuple(sorted(options.items())))


@functools.cache
def _packed_outputs_and_grads(rule, options):
    options = dict(options)
    op, num_inputs = getattr(on_cpu, rule), 3 + len(RULES[rule].gates)

    def run(cu_seqlens, *args):
        *inputs, state, ct_out, ct_final = args

        def loss(*args):
            out, final = op(
                *args[:num_inputs], initial_state=args[num_inputs], cu_seqlens=cu_seqlens,
                **options,
            )  # fmt: skip
            return jnp.sum(out * ct_out) + jnp.sum(final * ct_final), (out, final)

        argnums = range(num_inputs + 1)
        grads, (out, final) = jax.grad(loss, argnums=argnums, has_aux=True)(*inputs, state)
        return out, final, grads

    return jax.jit(run)


def with_state_and_cotangents(inputs, seed, seq_len, key_dim, value_dim, dtype):
    """``inputs`` followed by a random initial state and the cotangents of y and the final
    state, the arguments of an ``outputs_and_grads`` program."""
    state = random_state(seed + 1, value_dim, key_dim, dtype=dtype)
    cotangents = (
        random_state(seed + 2, seq_len, value_dim, dtype=dtype),
        random_state(seed + 3, value_dim, key_dim, dtype=dtype),
    )
    return (*inputs, state, *cotangents)


def assert_forms_agree(rule, args, dtype, chunked_options, label="", *, shared=True):
    """The chunked form with ``chunked_options`` equals the recurrent one on ``args``: y,
    the final state and every gradient, each finite, to ``dtype``'s tolerance. With
    ``shared=False`` the chunked form is traced anew rather than taken from the programs the
    tests share (a test that has patched what it calls)."""
    expected = outputs_and_grads(rule, "recurrent")(*args)
    options = tuple(sorted(chunked_options.items()))
    make = _outputs_and_grads if shared else _outputs_and_grads.__wrapped__
    actual = make(rule, "chunked", options)(*args)
    assert_close(actual[0], expected[0], dtype, f"{label} y")
    assert_close(actual[1], expected[1], dtype, f"{label} final state")
    names = ("q", "k", "v", *RULES[rule].gate_names, "initial_state")
    for name, a, e in zip(names, actual[2], expected[2], strict=True):
        assert np.isfinite(a).all(), f"{label} d{name}"
        assert_close(a, e, dtype, f"{label} d{name}")


def as_on_an_nvidia_gpu(*args, **branches):
    """``jax.lax.platform_dependent`` choosing as it does where it lowers for an NVIDIA GPU
    (its ``cuda`` branch, else its ``default``): patched in, a test runs a GPU's branches of
    an op on this CPU."""
    return (branches.get("cuda") or branches["default"])(*args)


def assert_residuals_are_inputs_and_one_state_per_chunk(rule, args_of_length, chunk):
    """What the backward of ``rule``'s chunked form keeps grows with ``T`` by the inputs and
    one ``[V, K]`` state per chunk, in both schedules: measured at two lengths (256 and
    512, by ``args_of_length(T) -> (*inputs, state)``), so that the constant masks the
    recomputation needs cancel out. Shapes only: the pullback's leaves are what it keeps."""
    chunked = getattr(on_cpu, f"{rule}_chunked")
    for schedule in ("in_scan", "hoisted"):
        sizes = []
        for seq_len in (256, 512):
            args = args_of_length(seq_len)

            def run(*a, schedule=schedule):
                return chunked(*a[:-1], initial_state=a[-1], chunk_size=chunk, schedule=schedule)

            vjp_fn = jax.eval_shape(lambda *a, run=run: jax.vjp(run, *a)[1], *args)
            saved = sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(vjp_fn))
            sizes.append((saved, sum(x.size for x in args)))
        (saved_1, inputs_1), (saved_2, inputs_2) = sizes
        states = (256 // chunk) * args[-1].size
        assert saved_2 - saved_1 <= inputs_2 - inputs_1 + states, schedule


def assert_packed_equals_separate(rule, inputs, state, ct_out, cu, loop_per_head):
    """``rule``'s batched op on packed sequences (``cu``, traced): each sequence's outputs
    and final state equal the float64 loop on it alone (``loop_per_head(*inputs, state, n,
    i)`` for sequence ``n`` and value head ``i``; an empty sequence keeps its initial state),
    and the chunked form's gradients equal the packed recurrent form's, whose resets
    blocks.scan_blocks shares with it but whose per-token steps share nothing."""
    op, num_inputs = getattr(on_cpu, rule), len(inputs)
    cu_seqlens = jnp.asarray(cu, jnp.int32)

    @functools.partial(jax.jit, static_argnames="impl")
    def run(*args, impl):
        def loss(*args):
            options = dict(initial_state=args[num_inputs], chunk_size=16, cu_seqlens=cu_seqlens)
            o, f = op(*args[:num_inputs], impl=impl, **options)
            return jnp.sum(o * ct_out) + jnp.sum(f**2), (o, f)

        return jax.grad(loss, argnums=range(num_inputs + 1), has_aux=True)(*args)

    grads, (out, final) = run(*inputs, state, impl="chunked")
    # Sliced in NumPy: eager slices of JAX arrays would compile a program per shape.
    *arrays, state, out, final = (np.asarray(x) for x in (*inputs, state, out, final))
    for n, (lo, hi) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        piece = tuple(x[:, lo:hi] for x in arrays)
        for i in range(out.shape[2]):
            if hi == lo:  # an empty sequence returns its initial state
                assert_close(final[n, i], state[n, i], jnp.float32, f"sequence {n}")
                continue
            y, s = loop_per_head(*piece, state[n : n + 1], 0, i)
            assert_close(out[0, lo:hi, i], y, jnp.float32, f"sequence {n}, head {i}")
            assert_close(final[n, i], s, jnp.float32, f"sequence {n}, head {i}")
    grads_recurrent, _ = run(*inputs, state, impl="recurrent")
    names = ("q", "k", "v", *RULES[rule].gate_names, "initial_state")
    for name, a, e in zip(names, grads, grads_recurrent, strict=True):
        assert_close(a, e, jnp.float32, f"packed d{name}")


def assert_steps_equal_recurrent(rule, inputs, state, dtype, **options):
    """``rule``'s public step (``<rule>_step``), called token by token, equals its recurrent
    form on ``inputs`` (one head, one sequence) from ``state``: the outputs, the final state
    and the gradients of every input and the state. ``options`` are the rule's own
    (``Rule.steps``); a token's per-step arguments reach the step together, ``[n, ...]``."""
    spec = RULES[rule]
    steps = spec.steps_per_token(options)
    step, recurrent = getattr(gdn_jax, f"{rule}_step"), getattr(gdn_jax, f"{rule}_recurrent")
    per_step = [arg.per_step for arg in spec.arguments]

    def by_steps(*args):
        *inputs, s = args
        ys = []
        for t in range(inputs[0].shape[0]):
            token = [
                x[t * steps : (t + 1) * steps] if p else x[t]
                for x, p in zip(inputs, per_step, strict=True)
            ]
            s, y = step(s, *token, **options)
            ys.append(y)
        return jnp.stack(ys), s

    def by_recurrent(*args):
        *inputs, s = args
        return recurrent(*inputs, initial_state=s, **options)

    ct_y = random_state(11, inputs[0].shape[0], inputs[2].shape[-1], dtype=dtype)
    results = []
    for form in (by_steps, by_recurrent):

        def loss(*args, form=form):
            y, s = form(*args)
            return jnp.sum(y * ct_y) + jnp.sum(s**2), (y, s)

        run = jax.jit(jax.grad(loss, argnums=range(len(inputs) + 1), has_aux=True))
        results.append(run(*inputs, state))
    (grads, (y, s)), (want_grads, (want_y, want_s)) = results
    assert_close(y, want_y, dtype, "y")
    assert_close(s, want_s, dtype, "final state")
    names = ("q", "k", "v", *spec.gate_names, "initial_state")
    for name, a, e in zip(names, grads, want_grads, strict=True):
        assert_close(a, e, dtype, f"d{name}")
