"""transformers' ``Qwen3NextGatedDeltaNet`` <-> gdn_jax's ``GatedDeltaNet``.

Qwen3-Next fuses what flash-linear-attention keeps apart (``family.py`` does the work):

- ``in_proj_qkvz.weight`` holds, for each key head ``i`` in turn, the rows
  ``[q_i (K) | k_i (K) | v_i (R*V) | z_i (R*V)]`` (``R = HV / H`` value heads per key head);
  ``z`` is the output gate, fla's ``g_proj``.
- ``in_proj_ba.weight`` holds ``[b_i (R) | a_i (R)]`` for each key head.
- ``conv1d.weight [H*K + H*K + HV*V, 1, W]`` is one depthwise filter over ``[q | k | v]``
  with the heads in order (not interleaved): fla's three ``*_conv1d`` stacked.
- ``norm.weight`` is the gated RMSNorm's (``o_norm``, eps ``rms_norm_eps``),
  ``out_proj.weight`` is ``o_proj``'s. Beta lies in (0, 1).
"""

from gdn_jax.interop.family import QKV_CONV
from gdn_jax.interop.gdn_family import GatedDeltaNetFamily

QWEN3_NEXT = GatedDeltaNetFamily(
    name="qwen3_next",
    title="Qwen3-Next",
    tensors={
        "in_proj_qkvz.weight": ("q_proj.weight", "k_proj.weight", "v_proj.weight", "g_proj.weight"),
        "in_proj_ba.weight": ("b_proj.weight", "a_proj.weight"),
        "conv1d.weight": QKV_CONV,
        "A_log": ("A_log",),
        "dt_bias": ("dt_bias",),
        "norm.weight": ("o_norm.weight",),
        "out_proj.weight": ("o_proj.weight",),
    },
    per_key_head=frozenset({"in_proj_qkvz.weight", "in_proj_ba.weight"}),
)
