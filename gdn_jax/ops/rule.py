"""What a recurrence of the family is to the ops around it: its gates, its token step and its
chunked form (``Rule``), one value in ``rules.RULES`` per rule.

Every rule updates one head's state ``S [V, K]`` token by token, ``S_t = f(S_{t-1}, k_t, v_t,
gates_t)``, and reads it, ``y_t = S_t (scale q_t)``; what differs is ``f`` and its gates.
A rule may take several steps a token (Gated DeltaProduct's ``n``), each with its own key,
value and per-step gates, the query and the per-token gates once. The batched entry
(``api.batched``), the one-head forms (``dispatch.one_head_form``), the sequence-parallel form,
the checks and the tests over every rule take a ``Rule`` and need nothing else.

The layout of every array argument derives from the rule (``Rule.layout``): the shapes that
the checks expect, the layouts their messages show and the Args of the public forms'
docstrings (``Rule.args_doc``) are read from it, never written out per form.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import textwrap
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple, Protocol, no_type_check, runtime_checkable

import jax.numpy as jnp

Channels = Literal[None, "K", "V"]
Form = Literal["step", "one_head", "batched"]

STEPS = "n"  # the legend's letter for a token's steps in layouts: ``[B, T n, H, K]``


class KernelInputs(NamedTuple):
    """What a kernel's limits are read from, all known before any work: the channels, v's
    dtype, the compute dtype, the chunk, the tokens as the kernels lay them out (at most:
    each sequence padded to whole chunks) and the value heads."""

    key_dim: int
    value_dim: int
    v_dtype: Any
    compute: Any
    chunk_size: int
    tokens: int
    v_heads: int


@runtime_checkable
class Refusals(Protocol):
    """A kernel's limits: every reason it cannot take ``inputs``, forward and backward alike
    (empty: it can). ``dispatch.check_kernel`` renders them in one message with the op's
    name."""

    def __call__(self, inputs: KernelInputs) -> tuple[str, ...]: ...


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A kernel of a rule, run over the whole batch in place of its one-head forms.

    ``run`` and ``refusals`` are callables or ``"module:name"`` references, imported when
    first used, so that ``import gdn_jax`` loads no Pallas.

    Attributes:
      impl: the ``impl`` that names it (``checks.KERNEL_IMPLS``).
      run: ``(q, k, v, gates, initial_states, cu_seqlens, *, chunk_size, op, interpret) ->
        (o, finals)`` on ``api.prepare_batched``'s inputs, differentiable in reverse mode;
        ``op`` names the calling op in its errors, ``interpret`` is ``dispatch``'s choice
        (``dispatch.kernel_interpret``).
      refusals: its limits (``Refusals``). ``impl="auto"`` takes no kernel until a GPU has
        timed it faster than the chunked form (docs/benchmarks.md).
      platform: the platform it is compiled for, as ``dispatch`` names platforms; lowered
        for any other, it runs in Pallas's interpret mode (slow, faithful).
    """

    impl: str
    run: Callable | str
    refusals: Refusals | str
    platform: str = "cuda"

    def __call__(self, *args, **kwargs):
        return _load(self.run)(*args, **kwargs)

    def refuses(self, inputs: KernelInputs) -> tuple[str, ...]:
        return tuple(_load(self.refusals)(inputs))


# Every Mosaic GPU kernel's limits (``ops/mosaic/limits.py``), read when first checked.
MOSAIC_LIMITS = "gdn_jax.ops.mosaic.limits:refusals"


def _load(ref):
    """A callable, or the object a ``"module:name"`` reference names."""
    if callable(ref):
        return ref
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


# What every rule calls its decays in log space (``<= 0``), which checks.py reads where they
# are concrete.
LOG_DECAY = "log_alpha"


class GateSpec(NamedTuple):
    """One array argument of a rule (a gate; q, k and v are described the same way).

    Attributes:
      name: its argument name.
      channels: one number per token and value head (``None``), or one per key channel
        (``"K"``) or value channel (``"V"``).
      per_step: one per step of a token (``n`` a token) rather than one per token.
      default: the value everywhere that ``None`` stands for (Gated DeltaProduct's
        ``log_alpha=None``: no decay); ``None``: the gate must be given.
      doc: what it holds, for the public forms' docstrings.
    """

    name: str
    channels: Channels = None
    per_step: bool = False
    default: float | None = None
    doc: str = ""


@dataclasses.dataclass(frozen=True)
class Rule:
    """One recurrence of the family.

    Attributes:
      name: its batched op, ``gdn_jax.<name>``, also the name its errors use.
      gates: its gates in argument order after q, k and v.
      step: the token step ``(S [V, K], q [K], k, v, *gates) -> (S', S' q [V])`` on arrays in
        the compute dtype, ``q`` as given (the recurrent form scales after); ``k [K]`` and
        ``v [V]``, or ``[n, K]`` and ``[n, V]`` with ``steps``, and the gates as ``layout``
        says (``"step"``).
      chunked: the chunked form of one head, ``(q [T, K], k, v, gates, initial_states [N, V,
        K], *, chunk_size, cu_seqlens, schedule) -> (y [T, V], finals [N, V, K])``, ``q``
        unscaled, ``gates`` a tuple in the compute dtype; ``k``, ``v`` and per-step gates
        ``T n`` long with ``steps`` (``n`` is their length over ``T``), ``cu_seqlens`` in
        tokens.
      shares_qk: whether the value heads of one key head run with its q and k shared (their
        products are then formed once per group); rules whose every product of q or k carries
        a value head's own per-channel decays run them per value head instead.
      forward_mode: whether forward-mode autodiff runs through ``chunked`` (a hand-written
        ``custom_vjp`` runs in reverse mode only).
      steps: the keyword option of the public forms that counts a token's steps (Gated
        DeltaProduct's ``num_householder``), each with its own key and value; ``None``: one
        step a token.
      kernels: its kernels (``Kernel``), each an ``impl`` of its own.
    """

    name: str
    gates: tuple[GateSpec, ...]
    step: Callable
    chunked: Callable
    shares_qk: bool
    forward_mode: bool = False
    steps: str | None = None
    kernels: tuple[Kernel, ...] = ()

    @property
    def gate_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.gates)

    @property
    def arguments(self) -> tuple[GateSpec, ...]:
        """q, k, v and the gates, in argument order: k and v are per step with ``steps``."""
        per_step = self.steps is not None
        return (
            GateSpec("q", "K", doc="queries; q, k and v share one floating dtype"),
            GateSpec("k", "K", per_step=per_step, doc="keys"),
            GateSpec("v", "V", per_step=per_step, doc="values"),
            *self.gates,
        )

    def steps_per_token(self, options: Mapping[str, int]) -> int:
        """How many steps a token takes under the public forms' keyword ``options``."""
        return 1 if self.steps is None else options[self.steps]

    def with_defaults(self, gates: tuple, form: Form, sizes: Mapping[str, int]) -> tuple:
        """``gates`` with each ``None`` (allowed where its spec has a default, and checked
        so) replaced by that default in its layout in ``form``, in float32."""
        return tuple(
            jnp.full(shape_of(self.layout(spec, form), sizes), spec.default, jnp.float32)
            if x is None
            else x
            for spec, x in zip(self.gates, gates, strict=True)
        )

    def layout(self, spec: GateSpec, form: Form) -> tuple[str, ...]:
        """The axes of argument ``spec`` in ``form`` (one token of one head, one head and
        one sequence, or the batched layout), in the legend's letters: Gated DeltaProduct's
        batched ``beta`` is ``("B", "T n", "HV")``, GDN-2's one-head ``w`` ``("T", "V")``."""
        time = f"T {STEPS}" if spec.per_step else "T"
        heads = "H" if spec.name in ("q", "k") else "HV"
        match form:
            case "step":
                lead = (STEPS,) if spec.per_step else ()
            case "one_head":
                lead = (time,)
            case "batched":
                lead = ("B", time, heads)
        return (*lead, *((spec.channels,) if spec.channels else ()))

    def args_doc(self, form: Form) -> str:
        """The Args lines of q, k, v and the gates for the docstring of the public form of
        ``form``, from their specs: name, layout and what each holds."""
        lines = []
        for spec in self.arguments:
            axes = self.layout(spec, form)
            shown = f"``[{', '.join(axes)}]``" if axes else "a scalar (array or Python number)"
            extra = " or ``None`` (no decay)" if spec.default is not None else ""
            lines.append(f"{spec.name}: {shown}{extra}, {spec.doc}.")
            if spec.name == LOG_DECAY:
                lines[-1] += (
                    " A value above 0 is refused where it is concrete; traced (under"
                    " ``jax.jit``) it cannot be read, and the outputs grow without bound."
                )
        if form == "batched":
            lines[2] += (
                " ``HV`` is a multiple of ``H``: value head ``i`` reads query/key head"
                " ``i // (HV // H)``."
            )
        if self.steps is not None:
            lines.append(f"{self.steps}: ``{STEPS} >= 1``, the steps a token.")
        wrap = functools.partial(textwrap.fill, width=88, subsequent_indent="    ")
        return "\n".join(textwrap.indent(wrap(line), "  ") for line in lines)


def shape_of(axes: tuple[str, ...], sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The shape of ``axes`` (``Rule.layout``) for the sizes of the legend's letters
    (``T n`` is ``T`` times ``n``)."""
    return tuple(
        sizes["T"] * sizes[STEPS] if axis == f"T {STEPS}" else sizes[axis] for axis in axes
    )


def public_form(rule: Rule, form: Form) -> Callable:
    """Declare a function one of ``rule``'s public forms of ``form``: its docstring's
    ``{args}`` line becomes the Args of q, k, v and the gates (``Rule.args_doc``), and the
    type checker of the test session leaves it alone (``no_type_check``), since it takes
    NumPy arrays and Python numbers too and ``checks.py`` answers a bad argument with a
    ``ValueError`` that names it, which a type checker would pre-empt."""

    def declare(fn: Callable) -> Callable:
        head, placeholder, tail = fn.__doc__.partition("{args}")
        indent = head[len(head.rstrip(" ")) :]
        lines = rule.args_doc(form).splitlines()
        fn.__doc__ = head + f"\n{indent}".join(lines) + tail if placeholder else fn.__doc__
        return no_type_check(fn)

    return declare
