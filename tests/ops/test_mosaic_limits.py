"""What the Mosaic GPU kernels cannot take (``ops/mosaic/limits.py``), named before any work:
every rule with kernels, through its public op, traced on abstract shapes (``jax.eval_shape``:
nothing is computed or allocated), with the calling op's name in one message form. The
backward's limits are the forward's, so a call it could not differentiate is refused before
its forward runs.

No kernel runs here: these tests hold on every JAX the project supports (on one before 0.11
the refusal names that too).
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from support.abstract import abstract_args

import gdn_jax
from gdn_jax.ops import dispatch
from gdn_jax.ops.mosaic import limits
from gdn_jax.ops.rules import RULES

KERNEL_RULES = [name for name, rule in RULES.items() if rule.kernels]


def abstract_call(name, *, seq_len=128, key_dim=64, value_dim=64, dtype=jnp.bfloat16,
                  gate_dtype=jnp.float32, heads=(1, 2), batch=1, **options):  # fmt: skip
    """``gdn_jax.<name>`` with ``impl="mosaic_gpu"`` traced on abstract inputs of these
    sizes (``Rule.layout``), nothing computed."""
    rule = RULES[name]
    args = abstract_args(name, seq_len=seq_len, key_dim=key_dim, value_dim=value_dim,
                         dtype=dtype, gate_dtype=gate_dtype, heads=heads, batch=batch)  # fmt: skip
    if rule.steps is not None:
        options.setdefault(rule.steps, 2)
    op = functools.partial(getattr(gdn_jax, name), impl="mosaic_gpu", **options)
    return jax.eval_shape(op, *args)


def refused(name, reason, **sizes):
    message = rf"^{name}: impl='mosaic_gpu' cannot take these inputs: .*{reason}"
    with pytest.raises(ValueError, match=message):
        abstract_call(name, **sizes)


@pytest.mark.parametrize("name", KERNEL_RULES)
def test_chunks_other_than_a_wgmmas_rows(name):
    refused(name, r"runs chunks of 64 tokens .*got chunk_size=32", chunk_size=32)


@pytest.mark.parametrize("name", KERNEL_RULES)
def test_a_compute_dtype_other_than_float32(name):
    refused(name, r"computes in float32, .*float64", gate_dtype=jnp.float64)


@pytest.mark.parametrize("name", KERNEL_RULES)
def test_float32_keys_past_64_channels_forward_and_backward_alike(name):
    """Two bf16 pieces an operand leave the grads kernel no room past K = 64: refused before
    the forward, not when the backward is traced."""
    refused(name, r"key dims up to 64 and value dims up to 128 .*got K=128", key_dim=128,
            dtype=jnp.float32)  # fmt: skip


@pytest.mark.parametrize("name", KERNEL_RULES)
def test_bf16_widths_past_a_hopper_blocks_shared_memory(name):
    refused(name, r"key dims up to 128 .*got K=130, V=64", key_dim=130)
    refused(name, r"value dims up to 256 .*got K=64, V=320", value_dim=320)


@pytest.mark.parametrize("name", KERNEL_RULES)
def test_tokens_past_int32_offsets(name):
    """2^31 tokens laid out: the kernels' token offsets are int32 (every grid launches past
    it: ``test_gpu_compile``'s T = 2^23)."""
    refused(name, r"indexes tokens in int32", seq_len=2**30, batch=2)


def test_every_reason_is_named_at_once():
    with pytest.raises(ValueError) as error:
        abstract_call("kda", chunk_size=32, key_dim=130)
    assert "chunk_size=32" in str(error.value) and "K=130" in str(error.value)


def test_the_laid_out_tokens_count_each_sequences_tail_chunk():
    q = jax.ShapeDtypeStruct((2, 100, 1, 64), jnp.bfloat16)
    inputs = dispatch.kernel_inputs(q, q, q, jnp.float32, 64, None)
    assert inputs.tokens == 2 * 128
    packed = jax.ShapeDtypeStruct((1, 100, 1, 64), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((4,), jnp.int32)  # three packed sequences: each may add a chunk
    inputs = dispatch.kernel_inputs(packed, packed, packed, jnp.float32, 64, cu)
    assert inputs.tokens == 100 + 3 * 64


def test_the_limits_are_launchable_grids():
    """What grows with the input runs on the grid's x (up to 2^31 - 1 programs): chunks and
    sequences; the token limit keeps them under it."""
    assert limits.MOST_TOKENS // limits.CHUNK <= limits.GRID_X
