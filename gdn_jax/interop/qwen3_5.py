"""transformers' ``Qwen3_5GatedDeltaNet`` <-> gdn_jax's ``GatedDeltaNet``.

The same layer serves ``qwen3_5``, ``qwen3_5_moe``, ``qwen4_exp`` and ``lara_mini`` (and
their ``*_text`` configs). Unlike Qwen3-Next it stacks rather than interleaves:

- ``in_proj_qkv.weight`` is ``[q (H*K) | k (H*K) | v (HV*V)]``, each head after the other;
- ``in_proj_z.weight`` is the output gate (fla's ``g_proj``), ``in_proj_b.weight`` and
  ``in_proj_a.weight`` are ``b_proj`` and ``a_proj``;
- ``conv1d.weight`` is one depthwise filter over ``[q | k | v]``;
- ``norm.weight`` is the gated RMSNorm's (eps ``rms_norm_eps``), ``out_proj.weight`` is
  ``o_proj``'s. Beta lies in (0, 1).
"""

from gdn_jax.interop.family import QKV_CONV
from gdn_jax.interop.gdn_family import GatedDeltaNetFamily

QWEN3_5 = GatedDeltaNetFamily(
    name="qwen3_5",
    title="Qwen3.5",
    also_model_types=(
        "qwen3_5_text",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
        "qwen4_exp",
        "qwen4_exp_text",
        "lara_mini",
    ),  # fmt: skip
    tensors={
        "in_proj_qkv.weight": ("q_proj.weight", "k_proj.weight", "v_proj.weight"),
        "in_proj_z.weight": ("g_proj.weight",),
        "in_proj_b.weight": ("b_proj.weight",),
        "in_proj_a.weight": ("a_proj.weight",),
        "conv1d.weight": QKV_CONV,
        "A_log": ("A_log",),
        "dt_bias": ("dt_bias",),
        "norm.weight": ("o_norm.weight",),
        "out_proj.weight": ("o_proj.weight",),
    },
)
