"""The Gated DeltaNet layer (Yang, Kautz & Hatamizadeh, ICLR 2025, Sec. 3.4)."""

from __future__ import annotations

from gdn_jax.layers.recurrent_mixer import RecurrentMixer


class GatedDeltaNet(RecurrentMixer):
    """Gated DeltaNet token mixer, ``x [B, T, hidden_size] -> [B, T, hidden_size]``: the
    recurrent mixer with both the decay gate and the delta correction,
    ``S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T``. Its constructor
    takes flash-linear-attention's ``GatedDeltaNet`` arguments; see ``RecurrentMixer``."""

    decay = True
    delta = True
