"""Every rule token by token: its step under ``jax.lax.scan`` (``blocks.scan_blocks``).

This is the readable reference form. Its forward is cheap, but reverse-mode autodiff keeps
one ``[V, K]`` state per token (``T * V * K`` floats per head), so train with the chunked form.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from gdn_jax.ops.chunked.blocks import scan_blocks
from gdn_jax.ops.chunked.varlen import pack_layout
from gdn_jax.ops.rule import Rule


def recurrent_rule(
    q: Float[Array, "T K"],
    k: Float[Array, "Tn K"],
    v: Float[Array, "Tn V"],
    gates: tuple,
    initial_states: Float[Array, "N V K"],
    *,
    step: Callable,
    cu_seqlens: Int[Array, " N+1"] | None = None,
    per_step: tuple[bool, ...] = (),
) -> tuple[Float[Array, "T V"], Float[Array, "N V K"]]:
    """Scan ``step(S, q_t, k_t, v_t, *gates_t)`` over the tokens in the states' dtype (q, k
    and v are cast to it; ``q`` unscaled), resetting the state where packed ``cu_seqlens``
    start a sequence: the recurrent twin of the chunked forms, with their arguments and
    results (``rule.Rule.chunked``). A block is one token, so the layout keeps every token in
    place; its gather zeroes the tokens past a traced last offset.

    ``per_step`` flags those of k, v and the gates that are one a step (``T n`` long, with
    ``n`` steps a token, ``Rule.steps``): each token's ``n`` of them reach ``step`` together,
    ``[n, ...]``."""
    seq_len = q.shape[0]
    q, k, v, *gates = (jnp.asarray(x, initial_states.dtype) for x in (q, k, v, *gates))
    if per_step:
        k, v, *gates = (
            x.reshape(seq_len, -1, *x.shape[1:]) if grouped else x
            for x, grouped in zip((k, v, *gates), per_step, strict=True)
        )

    def token(state, q, k, v, gates):
        return step(state, q, k, v, *gates)

    blocks = (q, k, v, tuple(gates))
    if cu_seqlens is None:
        return scan_blocks(token, blocks, initial_states)
    layout = pack_layout(cu_seqlens, q.shape[0], 1)
    ys, finals = scan_blocks(token, blocks, initial_states, layout.resets)
    return layout.gather(ys), finals


def rule_recurrent(rule: Rule) -> Callable:
    """``rule``'s recurrent form of one head, with ``recurrent_rule``'s arguments and results
    (``rule.Rule.chunked``'s): its step, and its per-step arguments grouped by token."""
    per_step = tuple(spec.per_step for spec in rule.arguments[1:]) if rule.steps else ()
    return functools.partial(recurrent_rule, step=rule.step, per_step=per_step)
