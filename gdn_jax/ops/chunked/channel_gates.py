"""What the gates of the channel-gated rules (``ops/chunked/channel.py``) do to a chunk's keys
and values: an erase gate ``b`` (``[C]`` or ``[C, K]``) scales the keys a token erases along,
``e = b * k``, a write gate ``w`` (``[C]`` or ``[C, V]``) the values it writes, ``x = w *
v``. KDA has one gate for both (no write gate, ``None``); GLA has neither: it erases nothing
(``NO_ERASE``) and writes ``v`` as it is (``WRITTEN``).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

from gdn_jax.ops.chunked.decays import LOG_ALPHA_FLOOR

Gate = Float[Array, " C"] | Float[Array, "C D"]  # one number per token, or one per channel
EraseGate = Float[Array, " C"] | Float[Array, "C K"] | tuple[()]  # or NO_ERASE
WriteGate = Float[Array, " C"] | Float[Array, "C V"]


def gated(x: Float[Array, "C D"], gate: Gate) -> Float[Array, "C D"]:
    """``x`` times its gate, one number per row or one per entry."""
    return x * (gate[:, None] if gate.ndim == 1 else gate)


def gated_bwd(x, gate: Gate, d) -> tuple[Float[Array, "C D"], Gate]:
    """The pullback of ``gated(x, gate)``: ``(dx, d gate)``."""
    return gated(d, gate), (d * x).sum(1) if gate.ndim == 1 else d * x


# In place of a write gate: the values are already what each token writes (``w * v``).
WRITTEN = ()
# In place of an erase gate: the rule erases nothing (GLA), so it has no WY system.
NO_ERASE = ()


def erases(erase_gate) -> bool:
    """Whether a rule with this erase gate has the delta correction (not ``NO_ERASE``)."""
    return not isinstance(erase_gate, tuple)


def writes(v, erase_gate: EraseGate, write_gate) -> Float[Array, "C V"]:
    """What each token writes: ``w * v``, KDA's ``beta * v`` (``write_gate`` None: the erase
    gate writes too), or ``v`` itself (``WRITTEN``)."""
    if write_gate is None:
        return gated(v, erase_gate)
    return v if isinstance(write_gate, tuple) else gated(v, write_gate)


def writes_bwd(v, erase_gate: EraseGate, write_gate, d_write) -> tuple:
    """The pullback of ``writes(v, erase_gate, write_gate)``: ``(dv, d write gate)``, the
    latter ``None`` for KDA (the erase gate's share, left for the caller to add to its own)
    and ``WRITTEN`` where ``v`` is what is written."""
    if isinstance(write_gate, tuple):
        return d_write, WRITTEN
    return gated_bwd(v, erase_gate if write_gate is None else write_gate, d_write)


def clamped(log_alpha):
    """The gates with ``-inf`` (and anything below ``LOG_ALPHA_FLOOR``) as a full reset that
    keeps the decays finite. Inside the core, so that no clamped copy of the gates is kept
    for the backward, which passes no gradient to a clamped gate."""
    return jnp.maximum(log_alpha, LOG_ALPHA_FLOOR)
