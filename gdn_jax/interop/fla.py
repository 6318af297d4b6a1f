"""flash-linear-attention's ``GatedDeltaNet`` state dict <-> gdn_jax's ``GatedDeltaNet``.

The two layers have the same parameters under the same names; only the layouts differ
(``torch_layout.py``): PyTorch's ``nn.Linear`` stores ``[out, in]`` where ``nnx.Linear``
stores ``[in, out]``, a depthwise ``nn.Conv1d`` ``[D, 1, W]`` where ``ShortConvolution``
stores ``[W, D]``, and the output norm's weight is ``o_norm.weight`` in PyTorch and
``o_norm.scale`` in Flax.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, no_type_check

import numpy as np
from numpy.typing import ArrayLike

from gdn_jax.interop.torch_layout import load_torch_layer, torch_state_dict
from gdn_jax.layers.gated_deltanet import GatedDeltaNet


@no_type_check  # a public entry point: checks.py names its bad arguments
def load_fla_layer(state_dict: Mapping[str, ArrayLike], **layer_kwargs: Any) -> GatedDeltaNet:
    """A ``GatedDeltaNet`` holding flash-linear-attention ``GatedDeltaNet`` weights.

    Args:
      state_dict: ``{name: array}`` of one layer, without prefix: ``q_proj.weight``,
        ``k_proj.weight``, ``v_proj.weight``, ``a_proj.weight``, ``b_proj.weight``,
        ``g_proj.weight`` (with ``use_gate``), ``q_conv1d.weight``, ``k_conv1d.weight``,
        ``v_conv1d.weight`` (and their ``.bias`` with ``conv_bias``; none without
        ``use_short_conv``), ``A_log``, ``dt_bias``, ``o_norm.weight``, ``o_proj.weight``.
      **layer_kwargs: ``GatedDeltaNet``'s constructor arguments, as given to fla's layer
        (``hidden_size``, ``num_heads``, ``head_dim``, ``expand_v``, ``num_v_heads``, ...).
        ``param_dtype`` casts every tensor; without it each keeps its stored dtype. ``dtype``
        (the compute dtype) defaults to that of ``q_proj.weight``.

    Raises:
      ValueError: a missing, unexpected or wrongly shaped tensor, named with both shapes,
        before anything is built.
    """
    return load_torch_layer("load_fla_layer", GatedDeltaNet, state_dict, **layer_kwargs)


@no_type_check  # a public entry point: checks.py names its bad arguments
def export_fla_layer(layer: GatedDeltaNet) -> dict[str, np.ndarray]:
    """``layer``'s parameters as a flash-linear-attention ``GatedDeltaNet`` state dict
    (``{name: np.ndarray}``, each in its parameter dtype), the inverse of ``load_fla_layer``."""
    if not isinstance(layer, GatedDeltaNet):
        raise ValueError(
            f"export_fla_layer: layer must be a GatedDeltaNet, got {type(layer).__name__}"
        )
    return torch_state_dict(layer)
