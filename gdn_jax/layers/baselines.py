"""Recall baselines: the recurrent mixer with one part of the recurrence removed.

Everything else (projections, short convolutions, q/k L2 norm, gated output norm) stays, so
a comparison isolates the recurrence itself.
"""

from gdn_jax.layers.recurrent_mixer import RecurrentMixer


class DeltaNet(RecurrentMixer):
    """DeltaNet (Schlag et al., 2021; Yang et al., 2024): no decay gate, ``alpha = 1``:
    ``S_t = S_{t-1} + beta_t (v_t - S_{t-1} k_t) k_t^T``."""

    decay = False
    delta = True


class SimpleGatedLinearAttention(RecurrentMixer):
    """Simple gated linear attention (flash-linear-attention's ``simple_gla``): linear
    attention with a scalar decay gate per head and token, Mamba-2 style, ``S_t = alpha_t
    S_{t-1} + v_t k_t^T`` (GLA's per-channel gate is ``GatedLinearAttention``'s). It was
    called ``GatedLinearAttention`` before; that name's old call still builds it."""

    decay = True
    delta = False


class LinearAttention(RecurrentMixer):
    """Plain causal linear attention, neither decay nor correction: ``S_t = S_{t-1} + v_t k_t^T``."""

    decay = False
    delta = False
