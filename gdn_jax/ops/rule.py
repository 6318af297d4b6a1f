"""What a recurrence of the family is to the ops around it: its gates, its token step and its
chunked form (``Rule``), one value in ``rules.RULES`` per rule.

Every rule updates one head's state ``S [V, K]`` token by token, ``S_t = f(S_{t-1}, k_t, v_t,
gates_t)``, and reads it, ``y_t = S_t (scale q_t)``; what differs is ``f`` and its gates.
The batched entry (``api.batched``), the one-head forms (``dispatch.one_head_form``), the
sequence-parallel form and the tests over every rule take a ``Rule`` and need nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal, NamedTuple

Channels = Literal[None, "K", "V"]


class GateSpec(NamedTuple):
    """One gate of a rule: its argument name and whether it holds one number per token and
    value head (``None``), or one per key channel (``"K"``) or value channel (``"V"``)."""

    name: str
    channels: Channels = None


@dataclasses.dataclass(frozen=True)
class Rule:
    """One recurrence of the family.

    Attributes:
      name: its batched op, ``gdn_jax.<name>``, also the name its errors use.
      gates: its gates in argument order after q, k and v.
      step: the token step ``(S [V, K], q [K], k [K], v [V], *gates) -> (S', S' q [V])`` on
        arrays in the compute dtype, ``q`` as given (the recurrent form scales after).
      chunked: the chunked form of one head, ``(q [T, K], k, v [T, V], gates, initial_states
        [N, V, K], *, chunk_size, cu_seqlens, schedule) -> (y [T, V], finals [N, V, K])``,
        ``q`` unscaled, ``gates`` a tuple in the compute dtype.
      shares_qk: whether the value heads of one key head run with its q and k shared (their
        products are then formed once per group); rules whose every product of q or k carries
        a value head's own per-channel decays run them per value head instead.
      forward_mode: whether forward-mode autodiff runs through ``chunked`` (a hand-written
        ``custom_vjp`` runs in reverse mode only).
    """

    name: str
    gates: tuple[GateSpec, ...]
    step: Callable
    chunked: Callable
    shares_qk: bool
    forward_mode: bool = False

    @property
    def gate_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.gates)
