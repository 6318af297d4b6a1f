"""Scanning a state update over blocks (tokens or chunks), with resets for packed sequences.

Both the recurrent form (a block is one token) and the chunked form (a block is ``C``
tokens) are a ``jax.lax.scan`` of a ``step(state, *block) -> (new_state, y)`` over ``NC``
blocks. Packed sequences add two integer arrays over the blocks:

- ``start_seq[n] = m`` when block ``n`` is the first block of sequence ``m`` (else -1): the
  state is replaced by ``initial_states[m]`` before the block;
- ``end_seq[n] = m`` when block ``n`` is the last block of sequence ``m`` (else -1): the state
  after the block is sequence ``m``'s final state.

Blocks never straddle two sequences (the chunked form lays each sequence out from a chunk
boundary, see ``chunked/varlen.py``). Without ``resets`` there is one sequence over all blocks.
``map_groups`` maps a function over blocks a group at a time (the chunked backward's
gradients, where all blocks at once would not fit an accelerator's memory), and
``add_groups`` adds such a map to arrays it already has.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def scan_blocks(step, blocks, initial_states, resets=None, *, keep_starts=False):
    """Run ``step`` over the blocks.

    Args:
      step: ``step(state [V, K], *block) -> (new_state [V, K], y)``.
      blocks: tuple of arrays with a leading block axis ``NC``.
      initial_states: ``[N, V, K]``, one per sequence (``N = 1`` without resets).
      resets: ``None`` or ``(start_seq [NC], end_seq [NC])``.
      keep_starts: also return the state at each block's start (after any reset). The
        chunked form keeps these, one state per chunk; the recurrent form must not, since
        that would be one state per token.

    Returns:
      ``(ys [NC, ...], finals [N, V, K])``, plus ``starts [NC, V, K]`` when ``keep_starts``.
    """

    def emit(y, state):
        return (y, state) if keep_starts else y

    if resets is None:

        def body(state, block):
            new_state, y = step(state, *block)
            return new_state, emit(y, state)

        final, out = jax.lax.scan(body, initial_states[0], blocks)
        finals = final[None]
    else:

        def body(carry, x):
            state, finals = carry
            (start, end), block = x
            state = jnp.where(start >= 0, initial_states[jnp.maximum(start, 0)], state)
            new_state, y = step(state, *block)
            m = jnp.maximum(end, 0)
            finals = finals.at[m].set(jnp.where(end >= 0, new_state, finals[m]))
            return (new_state, finals), emit(y, state)

        # A sequence with no tokens never ends a block and keeps its initial state.
        carry = (jnp.zeros_like(initial_states[0]), initial_states)
        (_, finals), out = jax.lax.scan(body, carry, (resets, blocks))
    return (*out, finals) if keep_starts else (out, finals)


def scan_blocks_backward(step_bwd, xs, d_finals, resets=None):
    """The reverse scan of ``scan_blocks``, given each block's hand-written backward.

    Args:
      step_bwd: ``step_bwd(d_state_after [V, K], *x) -> (d_state_before [V, K], out)``, the
        pullback of one block's state update with whatever else it needs in ``x``.
      xs: tuple of arrays with a leading block axis ``NC``, one slice per call of ``step_bwd``.
      d_finals: ``[N, V, K]`` cotangents of the final states.
      resets: as in ``scan_blocks``.

    Returns:
      ``(outs [NC, ...], d_initial_states [N, V, K])``.
    """
    if resets is None:

        def body(d_state, x):
            return step_bwd(d_state, *x)

        d_state, outs = jax.lax.scan(body, d_finals[0], xs, reverse=True)
        return outs, d_state[None]

    def body(carry, x):
        d_state, d_init = carry
        (start, end), x = x
        d_state = d_state + jnp.where(end >= 0, d_finals[jnp.maximum(end, 0)], 0)
        d_start, out = step_bwd(d_state, *x)
        m = jnp.maximum(start, 0)
        d_init = d_init.at[m].add(jnp.where(start >= 0, d_start, 0))
        # A reset cuts the dependence on the previous block's state.
        return (jnp.where(start >= 0, 0, d_start), d_init), out

    num_seqs = d_finals.shape[0]
    _, end_seq = resets
    ends = jnp.where(end_seq >= 0, end_seq, num_seqs)  # out of range for "ends nothing"
    ends_somewhere = jnp.zeros(num_seqs, bool).at[ends].set(True, mode="drop")
    # Empty sequences pass their initial state straight through to their final state.
    d_init = jnp.where(ends_somewhere[:, None, None], 0, d_finals)
    carry = (jnp.zeros_like(d_finals[0]), d_init)
    (_, d_init), outs = jax.lax.scan(body, carry, (resets, xs), reverse=True)
    return outs, d_init


def barrier_off_cpu(*xs):
    """``xs`` as they are; off CPU behind an optimisation barrier, so that XLA neither
    moves work across it nor keeps what is made before it for what comes after (the callers
    say why, with the memory it saves). On CPU XLA may merge freely: memory is plenty there
    and the barrier only cost time."""
    return jax.lax.platform_dependent(
        *xs, cpu=lambda *a: a, default=lambda *a: jax.lax.optimization_barrier(a)
    )


def map_groups(fn, xs, size):
    """``fn`` of each entry of ``xs`` along their leading axis, ``size`` entries at a
    time (the last group shorter), batched within a group: ``jax.lax.map(fn, xs,
    batch_size=size)``, except that each group's inputs are sliced out of ``xs`` where they
    lie and its outputs written into their place in the whole. ``lax.map`` stacks ``xs``
    group-major first, a copy of every input (here cast to float32 as well), which on a TPU
    holds more temp than slicing in place (docs/benchmarks.md).
    ``xs`` and ``fn``'s outputs may hold None (a gate an op does not have)."""
    total = jax.tree.leaves(xs)[0].shape[0]
    fn = jax.vmap(fn)
    if total <= size:
        return fn(*xs)
    shapes = jax.eval_shape(fn, *_take(xs, 0, size))
    # Under shard_map the loop's carry must vary over the mesh axes that the groups' outputs
    # vary over (those of the inputs): zeros made with a select that never takes the inputs
    # do (``_varying_zero``), fresh ones would not; XLA folds the select away.
    zero = _varying_zero(xs)
    whole = jax.tree.map(
        lambda s: jnp.zeros((total, *s.shape[1:]), s.dtype) + zero.astype(s.dtype), shapes
    )
    return _over_groups(lambda whole, part, start: _put(whole, part, start), fn, xs, whole, size)


def add_groups(fn, xs, totals, size):
    """``totals`` plus ``fn`` of each entry of ``xs``, taken as ``map_groups`` takes them:
    each group's outputs are added to ``totals`` where they lie, in their buffers (no
    second array of each, where ``map_groups`` and a sum would hold two)."""
    total = jax.tree.leaves(xs)[0].shape[0]
    fn = jax.vmap(fn)
    if total <= size:
        return jax.tree.map(jnp.add, totals, fn(*xs))
    zero = _varying_zero(xs)  # as in map_groups
    whole = jax.tree.map(lambda t: t + zero.astype(t.dtype), totals)

    def add(whole, part, start):
        length = jax.tree.leaves(part)[0].shape[0]
        return _put(whole, jax.tree.map(jnp.add, _take(whole, start, length), part), start)

    return _over_groups(add, fn, xs, whole, size)


def _over_groups(put, fn, xs, whole, size):
    """``whole`` after ``put(whole, fn(*group), start)`` for each group of ``size`` entries
    of ``xs`` (the last shorter): a loop over the full groups, the rest after it."""
    groups, rest = divmod(jax.tree.leaves(xs)[0].shape[0], size)
    whole = jax.lax.fori_loop(
        0, groups, lambda i, whole: put(whole, fn(*_take(xs, i * size, size)), i * size), whole
    )
    if rest:
        whole = put(whole, fn(*_take(xs, groups * size, rest)), groups * size)
    return whole


def _take(xs, start, length):
    return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, start, length), xs)


def _put(whole, part, start):
    return jax.tree.map(
        lambda w, p: jax.lax.dynamic_update_slice_in_dim(w, p, start, 0), whole, part
    )


def _varying_zero(xs):
    """A float32 zero that varies over every mesh axis some leaf of ``xs`` varies over
    inside a ``shard_map`` (outside one, a plain zero), whatever the leaves hold."""
    picks = [jnp.where(False, x.ravel()[0], 0).astype(jnp.float32) for x in jax.tree.leaves(xs)]
    return sum(picks, jnp.float32(0))
