"""Programs compiled for TPU by libtpu on this host (``gdn_jax.tpu_compile``), each once per
test process, and what a test reads of them: memory, while loops and their bodies."""

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp

import gdn_jax
from gdn_jax import tpu_compile
from gdn_jax.ops.rules import RULES
from support.hlo import count, loop_bodies


@dataclasses.dataclass(frozen=True)
class Program:
    """A compiled TPU program: its optimised HLO, its memory for one device, and how long
    the compile took here (wall seconds)."""

    hlo: str
    memory: object  # jax's CompiledMemoryStats
    seconds: float

    @property
    def whiles(self) -> int:
        return count(self.hlo, "while")

    @property
    def bodies(self) -> list[list[str]]:
        return loop_bodies(self.hlo)


@functools.cache
def devices(topology: str) -> list[jax.Device]:
    return tpu_compile.topology_devices(topology)


def compile_program(fn, *args, device=None) -> Program:
    """``tpu_compile.compile_for(fn, *args, device=device)`` as a ``Program``, traced as
    users trace it: without the test session's float64 (which a TPU would emulate, at twice
    the compile time) and with NumPy's promotion (optax mixes float and int32 in Adam)."""
    start = time.perf_counter()
    with jax.enable_x64(False), jax.numpy_dtype_promotion("standard"):
        compiled = tpu_compile.compile_for(fn, *args, device=device)
    return Program(compiled.as_text(), compiled.memory_analysis(), time.perf_counter() - start)


@functools.cache
def op_program(
    topology: str,
    schedule: str,
    dtype: str,
    shape: tuple[int, int, int, int, int],
    chunk_size: int,
    *,
    grad: bool,
    op: str = "gated_delta_rule",
) -> Program:
    """``gdn_jax.<op>`` (a rule of ``RULES``, gates as it declares them) for one chip of
    ``topology``: q, k ``[B, T, H, K]`` and v
    ``[B, T, H, V]`` in ``dtype``, ``shape = (B, T, H, K, V)``; a gate a head and token
    ``[B, T, H]`` in float32, a gate a channel ``[B, T, H, K or V]`` in ``dtype`` (token-sized,
    as q, k and v are); its forward, or with ``grad`` the gradient of every input of
    ``sum(y)`` (forward and backward)."""
    batch, seq_len, heads, key_dim, value_dim = shape
    dtype = jnp.dtype(dtype)
    tokens = (batch, seq_len, heads)
    args = [jax.ShapeDtypeStruct((*tokens, dim), dtype) for dim in (key_dim, key_dim, value_dim)]
    tails = {"K": (key_dim,), "V": (value_dim,)}
    args += [
        jax.ShapeDtypeStruct((*tokens, *tails[gate.channels]), dtype)
        if gate.channels
        else jax.ShapeDtypeStruct(tokens, jnp.float32)
        for gate in RULES[op].gates
    ]

    def forward(*args):
        return getattr(gdn_jax, op)(*args, chunk_size=chunk_size, schedule=schedule)[0]

    def loss(*args):
        return jnp.sum(forward(*args).astype(jnp.float32))

    fn = jax.grad(loss, argnums=range(len(args))) if grad else forward
    return compile_program(fn, *args, device=devices(topology)[0])
