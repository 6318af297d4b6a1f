"""How a rule's form is chosen (``ops/dispatch.py``): ``impl`` checked against the rule where an
op, a layer or a model is built, ``"auto"`` resolved for the platform compiled for, and a
kernel compiled on its own platform and interpreted on any other.

The kernels here are stand-ins registered on a copy of a rule: each returns a constant that
says which path ran, so that the choice is read from the outputs.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from support.reference import random_inputs

import gdn_jax
from gdn_jax.ops import api, dispatch
from gdn_jax.ops.rule import Kernel
from gdn_jax.ops.rules import RULES


def test_a_kernel_that_cannot_take_the_inputs_says_why_before_any_work():
    q, k, v, la, b = random_inputs(0, 8, 4, 4, lead=(1,), heads=(1, 1))
    with pytest.raises(
        ValueError,
        match=r"gated_delta_rule: impl='mosaic_gpu' (runs chunks of 64 tokens.*got chunk_size=32|needs jax >= 0.11)",
    ):
        gdn_jax.gated_delta_rule(q, k, v, la, b, impl="mosaic_gpu", chunk_size=32)


def test_auto_runs_the_chunked_form_where_a_marked_kernel_refuses_the_inputs():
    rule = RULES["gated_delta_rule"]
    refusing = constant_kernel(5.0, platform="cpu", auto=True)._replace(refuses=lambda *d: "no")
    out = run_rule(dataclasses.replace(rule, kernels=(refusing,)), "auto")
    assert jnp.array_equal(out, run_rule(rule, "chunked"))


def test_a_rule_without_the_kernel_asked_for_is_refused_where_it_is_built():
    message = (
        r"impl='mosaic_gpu' is a kernel simple_gla does not have \(its kernels: "
        r"none\)"
    )
    q, k, v, la, b = random_inputs(0, 8, 4, 4, lead=(1,), heads=(1, 1))
    with pytest.raises(ValueError, match="simple_gla: " + message):
        gdn_jax.simple_gla(q, k, v, la, b, impl="mosaic_gpu")
    with pytest.raises(ValueError, match="SimpleGatedLinearAttention: " + message):
        gdn_jax.SimpleGatedLinearAttention(
            16, num_heads=2, head_dim=8, impl="mosaic_gpu", rngs=nnx.Rngs(0)
        )
    config = gdn_jax.ModelConfig(
        vocab_size=32, d_model=16, mixers=("simple_gla",), impl="mosaic_gpu"
    )
    with pytest.raises(ValueError, match=message):
        nnx.eval_shape(lambda: gdn_jax.LanguageModel(config, rngs=nnx.Rngs(0)))


def constant_kernel(value, **fields):
    """A stand-in kernel: outputs ``value`` where it is compiled, ``-value`` interpreted."""

    def run(q, k, v, gates, initial_states, cu_seqlens, *, chunk_size, interpret):
        del k, gates, cu_seqlens, chunk_size
        sign = -1.0 if interpret else 1.0
        out = jnp.full((*q.shape[:3], v.shape[-1]), sign * value, initial_states.dtype)
        return out.repeat(v.shape[2] // q.shape[2], axis=2), initial_states

    return Kernel("mosaic_gpu", run, lambda *dims: None, **fields)


def run_rule(rule, impl):
    q, k, v, la, b = random_inputs(1, 20, 4, 4, lead=(1,), heads=(1, 1))
    scale = q.shape[-1] ** -0.5
    options = dict(scale=1.0, initial_state=None, chunk_size=16, schedule="in_scan",
                   cu_seqlens=None, use_qk_l2norm=False)  # fmt: skip
    run = jax.jit(lambda *a: api.batched(rule, *a[:3], a[3:], impl=impl, **options)[0])
    return run(q * scale / scale, k, v, la, b)


def test_a_kernel_runs_compiled_on_its_platform_and_interpreted_elsewhere():
    here = dataclasses.replace(
        RULES["gated_delta_rule"], kernels=(constant_kernel(3.0, platform="cpu"),)
    )
    elsewhere = dataclasses.replace(here, kernels=(constant_kernel(3.0, platform="cuda"),))
    assert float(run_rule(here, "mosaic_gpu")[0, 0, 0, 0]) == 3.0
    assert float(run_rule(elsewhere, "mosaic_gpu")[0, 0, 0, 0]) == -3.0


def test_auto_takes_a_kernel_only_where_it_is_marked_so():
    rule = RULES["gated_delta_rule"]
    chunked = run_rule(rule, "chunked")
    for kernel, expected in [
        (constant_kernel(5.0, platform="cpu", auto=True), 5.0),  # its platform, marked
        (constant_kernel(5.0, platform="cpu"), None),  # its platform, not marked
        (constant_kernel(5.0, platform="cuda", auto=True), None),  # marked, another platform
    ]:
        out = run_rule(dataclasses.replace(rule, kernels=(kernel,)), "auto")
        if expected is None:
            assert jnp.array_equal(out, chunked), kernel
        else:
            assert float(out[0, 0, 0, 0]) == expected


def test_sequence_parallelism_takes_the_impls_whose_shards_run_the_chunked_form():
    assert [
        dispatch.splits_sequence(i) for i in ("auto", "chunked", "recurrent", "mosaic_gpu")
    ] == [
        True,
        True,
        False,
        False,
    ]
