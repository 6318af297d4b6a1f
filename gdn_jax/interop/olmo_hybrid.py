"""transformers' ``OlmoHybridGatedDeltaNet`` <-> gdn_jax's ``GatedDeltaNet``.

OLMo-Hybrid keeps fla's projections (``q_proj``, ``k_proj``, ``v_proj``, ``a_proj``,
``b_proj``, ``g_proj``, ``o_proj``) and ``o_norm``, and fuses only the convolution:
``conv1d.weight`` is one depthwise filter over ``[q | k | v]``. Its output norm's eps is
1e-5 whatever ``rms_norm_eps`` says (fla's ``FusedRMSNormGated`` default), and
``linear_allow_neg_eigval`` (default true) doubles beta into (0, 2). ``A_log`` and
``dt_bias`` are only initialised from ``linear_a_log_*`` and ``linear_dt_*``; a checkpoint
carries their values. Checkpoints store the convolution as fla's three
``{q,k,v}_conv1d.weight``, which loading concatenates as transformers does.
"""

from gdn_jax.interop.family import QKV_CONV
from gdn_jax.interop.gdn_family import GatedDeltaNetFamily

SAME_NAMES = ("A_log", "dt_bias", "o_norm.weight", "o_proj.weight") + tuple(
    f"{x}_proj.weight" for x in "qkvabg"
)

OLMO_HYBRID = GatedDeltaNetFamily(
    name="olmo_hybrid",
    title="OLMo-Hybrid",
    tensors={"conv1d.weight": QKV_CONV, **{name: (name,) for name in SAME_NAMES}},
    norm_eps=1e-5,
    neg_eigval_key="linear_allow_neg_eigval",
    interval_default=None,
    stored_in_parts={"conv1d.weight": QKV_CONV},
)
