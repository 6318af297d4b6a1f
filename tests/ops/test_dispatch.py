"""How a rule's form is chosen (``ops/dispatch.py``): ``impl`` checked against the rule where an
op, a layer or a model is built, ``"auto"`` the chunked form, and a kernel compiled on its own
platform and interpreted on any other (or left to the lowering where tracing cannot tell).

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
        match=r"gated_delta_rule: impl='mosaic_gpu' cannot take these inputs: .*runs chunks of "
        r"64 tokens.*got chunk_size=32",
    ):
        gdn_jax.gated_delta_rule(q, k, v, la, b, impl="mosaic_gpu", chunk_size=32)


def test_auto_takes_no_kernel_until_a_gpu_has_timed_it():
    rule = RULES["gated_delta_rule"]
    for platform in ("cpu", "cuda"):
        kernel = constant_kernel(5.0, platform=platform)
        out = run_rule(dataclasses.replace(rule, kernels=(kernel,)), "auto")
        assert jnp.array_equal(out, run_rule(rule, "chunked")), platform


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
    """A stand-in kernel: outputs ``value`` where it is compiled, ``-value`` where it is not
    (interpreted, or left to the lowering)."""

    def run(q, k, v, gates, initial_states, cu_seqlens, *, chunk_size, op, interpret):
        del k, gates, cu_seqlens, chunk_size
        assert op == "gated_delta_rule"
        sign = 1.0 if interpret is False else -1.0
        out = jnp.full((*q.shape[:3], v.shape[-1]), sign * value, initial_states.dtype)
        return out.repeat(v.shape[2] // q.shape[2], axis=2), initial_states

    return Kernel("mosaic_gpu", run, lambda inputs: (), **fields)


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


def test_a_kernel_left_to_the_lowering_here_is_decided_by_an_abstract_mesh():
    """On this CPU host a CUDA kernel's form waits for the lowering (None); under an abstract
    mesh of a GPU, as ``gpu_compile`` traces, it is compiled; of a CPU, interpreted."""
    kernel = constant_kernel(1.0)
    assert dispatch.kernel_interpret(kernel) is None
    for platform, kind, expected in (("gpu", "NVIDIA H200", False), ("cpu", "cpu", True)):
        device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform=platform)
        mesh = jax.sharding.AbstractMesh(
            (1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=device
        )
        with jax.sharding.use_abstract_mesh(mesh):
            assert dispatch.kernel_interpret(kernel) is expected, platform


def test_sequence_parallelism_takes_the_impls_whose_shards_run_the_chunked_form():
    assert [
        dispatch.splits_sequence(i) for i in ("auto", "chunked", "recurrent", "mosaic_gpu")
    ] == [
        True,
        True,
        False,
        False,
    ]
