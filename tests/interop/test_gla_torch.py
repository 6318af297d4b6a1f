"""Gated linear attention against flash-linear-attention's naive GLA (``naive_recurrent_gla``,
written again in PyTorch in support/fla_gla.py): the outputs, the final state and the gradient
of every input, initial state included, in float32 over grouped heads at a length off the
chunk grid, for the recurrent and the chunked form; and the chunked form against the
recurrent one on the same values and gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.fla_gla import naive_recurrent_gla, torch
from support.reference import random_inputs, random_state
from support.tolerance import assert_close_to_scale

import gdn_jax

# Grouped heads (each key head serves two value heads), T = 100: off the grid of 16 and 64.
BATCH, HEADS, V_HEADS, KEY, VALUE, SEQ = 2, 2, 4, 16, 12, 100
NAMES = ("o", "final state", "dq", "dk", "dv", "dlog_alpha", "dinitial_state")
FORMS = {"recurrent": dict(impl="recurrent"), "chunked": dict(impl="chunked", chunk_size=16)}


def inputs():
    """q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, log_alpha ``[B, T, HV, K]`` in (-1, 0),
    an initial state ``[B, HV, V, K]`` and the cotangents of the outputs and final state."""
    q, k, v, la, _ = random_inputs(
        0, SEQ, KEY, VALUE, lead=(BATCH,), heads=(HEADS, V_HEADS), per_channel=True,
        unit_keys=False,
    )  # fmt: skip
    state = random_state(1, BATCH, V_HEADS, VALUE, KEY)
    ct_o = random_state(2, BATCH, SEQ, V_HEADS, VALUE)
    ct_state = random_state(3, BATCH, V_HEADS, VALUE, KEY)
    return q, k, v, la, state, ct_o, ct_state


@functools.cache
def ours(form):
    """``gated_linear_attention`` in ``form``: the outputs, the final state and the
    gradients of the loss ``<o, ct_o> + <final, ct_state>``, jitted once."""
    options = dict(schedule="in_scan", **FORMS[form])

    def loss(q, k, v, la, state, ct_o, ct_state):
        o, final = gdn_jax.gated_linear_attention(q, k, v, la, initial_state=state, **options)
        return jnp.sum(o * ct_o) + jnp.sum(final * ct_state), (o, final)

    grad = jax.grad(loss, argnums=range(5), has_aux=True)
    return jax.jit(lambda *a: (lambda g, aux: (*aux, *g))(*grad(*a)))


def theirs(q, k, v, la, state, ct_o, ct_state):
    """fla's naive GLA on the same values: each value head reads its key head's q and k
    (``repeat_interleave``, so that their gradients sum over the group), the state
    transposed to fla's ``[K, V]``. Returns what ``ours`` returns, in this package's layout."""
    group = V_HEADS // HEADS
    leaves = [torch.tensor(np.asarray(x), requires_grad=True) for x in (q, k, v, la)]
    h0 = torch.tensor(np.asarray(state).swapaxes(-1, -2).copy(), requires_grad=True)
    q_t, k_t = (x.repeat_interleave(group, dim=2) for x in leaves[:2])
    o, final = naive_recurrent_gla(q_t, k_t, *leaves[2:], h0, output_final_state=True)
    ct_final = torch.tensor(np.asarray(ct_state).swapaxes(-1, -2).copy())
    loss = (o * torch.tensor(np.asarray(ct_o))).sum() + (final * ct_final).sum()
    loss.backward()
    grads = [x.grad.numpy() for x in leaves] + [h0.grad.numpy().swapaxes(-1, -2)]
    return o.detach().numpy(), final.detach().numpy().swapaxes(-1, -2), *grads


@pytest.mark.parametrize("form", list(FORMS))
def test_outputs_final_state_and_every_gradient_equal_fla_naive(form):
    args = inputs()
    want = theirs(*args)
    got = ours(form)(*args)
    for name, g, w in zip(NAMES, got, want, strict=True):
        assert np.asarray(g).shape == w.shape, name
        assert_close_to_scale(g, w, jnp.float32, f"{form}: {name}")


def test_chunked_equals_recurrent_on_values_and_gradients():
    args = inputs()
    chunked, recurrent = ours("chunked")(*args), ours("recurrent")(*args)
    for name, c, r in zip(NAMES, chunked, recurrent, strict=True):
        assert_close_to_scale(c, r, jnp.float32, name)
