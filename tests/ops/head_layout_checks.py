"""Every public batched op over the head layouts, as a user's process compiles it: run by
test_head_layouts.py in a child process, so that a compiler or runtime crash fails the named
case instead of killing a test worker.

For each op, head layout (H, HV) and form (recurrent, chunked in_scan, chunked hoisted), one
jitted program returns the outputs, the final states and the gradients of a loss with respect
to every input (initial state included, q and k L2-normalised in the op) at a length off the
chunk grid; it runs on several random draws. Each chunked case must agree with the recurrent
one of the same layout on every value, and everything must be finite.

Usage: ``head_layout_checks.py [OP ...] [--from N]``. Prints ``start CASE`` before a case and
``ok CASE`` or ``FAIL CASE: why`` after it (one line each, flushed), after a first line
``cases N``, and ends with ``done``.
"""

import os
import sys

# The support modules (process_setup, tolerance) live in tests/, one level up.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import process_setup  # noqa: E402

process_setup.set_up()  # as in conftest.py

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from tolerance import assert_close  # noqa: E402

import gdn_jax  # noqa: E402
from gdn_jax.ops.rules import RULES  # noqa: E402

LAYOUTS = [(1, 1), (1, 2), (2, 2), (2, 4), (3, 6)]
# The rules that share q and k over a value-head group (``Rule.shares_qk``) run one layout of
# each kind, one head and grouped heads: the per-channel rules, whose products carry a value
# head's own decays, run them all (their layouts are where XLA:CPU crashed).
SHARED_QK_LAYOUTS = [(1, 1), (2, 4)]
FORMS = [
    ("recurrent", dict(impl="recurrent")),
    ("in_scan", dict(impl="chunked", schedule="in_scan")),
    ("hoisted", dict(impl="chunked", schedule="hoisted")),
]
# The crash's own shape: T = 70 leaves a tail of 6 tokens in the last chunk of 64.
BATCH, SEQ_LEN, KEY_DIM, VALUE_DIM = 1, 70, 32, 48
DRAWS = (0, 1)

# Every rule of the registry, by its batched op's name.
OPS = {name: (getattr(gdn_jax, name), rule.gates) for name, rule in RULES.items()}


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


def program(op, options):
    def loss(*args):
        o, final = op(*args[:-1], initial_state=args[-1], use_qk_l2norm=True, **options)
        return jnp.sum(jnp.sin(o)) + jnp.sum(final**2) / 100, (o, final)

    def run(*args):
        return jax.grad(loss, argnums=tuple(range(len(args))), has_aux=True)(*args)

    return jax.jit(run)


def results(run, seed, heads, v_heads, gates):
    """The outputs, final states and gradients of ``run`` (a ``program``) on one draw, each
    checked finite, by name."""
    grads, values = run(*inputs(seed, heads, v_heads, gates))
    names = ["o", "final", "dq", "dk", "dv", *(f"d{g.name}" for g in gates), "dstate"]
    out = dict(zip(names, (np.asarray(x) for x in (*values, *grads)), strict=True))
    for what, x in out.items():
        assert np.isfinite(x).all(), f"draw {seed}: {what} is not finite"
    return out


def one_line(error):
    return " | ".join(line.strip() for line in str(error).splitlines() if line.strip())[:600]


def main():
    """Run the cases of ``sys.argv[1:]`` (op names, all when none), from case number
    ``--from N`` on."""
    args = sys.argv[1:]
    first = 0
    if "--from" in args:
        at = args.index("--from")
        first = int(args[at + 1])
        del args[at : at + 2]
    names = args or list(OPS)
    cases = [
        (n, layout, form)
        for n in names
        for layout in (SHARED_QK_LAYOUTS if RULES[n].shares_qk else LAYOUTS)
        for form in FORMS
    ]
    print(f"cases {len(cases)}", flush=True)
    reference = {}
    for index, (name, (heads, v_heads), (form, options)) in enumerate(cases):
        if index < first:
            continue
        op, gates = OPS[name]
        case = f"{name} H={heads} HV={v_heads} {form}"
        print(f"start {index} {case}", flush=True)
        run = program(op, options)
        try:
            for seed in DRAWS:
                got = results(run, seed, heads, v_heads, gates)
                key = (name, heads, v_heads, seed)
                if form == "recurrent":
                    reference[key] = got
                    continue
                if key not in reference:  # a restart after a crash skipped the recurrent case
                    recurrent = program(op, FORMS[0][1])
                    reference[key] = results(recurrent, seed, heads, v_heads, gates)
                for what, a in got.items():
                    e = reference[key][what]
                    assert_close(a, e, jnp.float32, f"draw {seed}: {what} against recurrent")
        except AssertionError as error:
            print(f"FAIL {index} {case}: {one_line(error)}", flush=True)
            continue
        print(f"ok {index} {case}", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
