"""transformers' ``Qwen3NextGatedDeltaNet`` <-> gdn_jax's ``GatedDeltaNet``.

Qwen3-Next fuses what flash-linear-attention keeps apart, so this module only rearranges
rows between the two layouts and leaves the rest to ``gdn_jax.interop.fla``:

- ``in_proj_qkvz.weight`` holds, for each key head ``i`` in turn, the rows
  ``[q_i (K) | k_i (K) | v_i (R*V) | z_i (R*V)]`` (``R = HV / H`` value heads per key head,
  value head ``i*R + j`` reads key head ``i``, as in gdn_jax's grouping); ``z`` is the output
  gate, fla's ``g_proj``.
- ``in_proj_ba.weight`` holds ``[b_i (R) | a_i (R)]`` for each key head.
- ``conv1d.weight [H*K + H*K + HV*V, 1, W]`` is one depthwise filter over ``[q | k | v]``
  with the heads in order (not interleaved): fla's three ``*_conv1d`` stacked.
- ``norm.weight`` is the gated RMSNorm's (``o_norm``), ``out_proj.weight`` is ``o_proj``'s.

The layer's function is the same: SiLU after the convolution, q and k L2-normalised with
``eps = 1e-6``, ``scale = K ** -0.5``, ``beta = sigmoid(b)``,
``log_alpha = -exp(A_log) * softplus(a + dt_bias)``, and the norm gated by ``silu(z)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import no_type_check

import jax.numpy as jnp
import numpy as np

from gdn_jax.interop.fla import export_fla_layer, load_fla_layer
from gdn_jax.interop.tensors import as_numpy_dict, check_tensors
from gdn_jax.layers.gated_deltanet import GatedDeltaNet
from gdn_jax.layers.recurrent_mixer import RecurrentCache
from gdn_jax.ops import checks

# The kinds of layer a Qwen3-Next config's layer_types may name.
LAYER_KINDS = ("linear_attention", "full_attention")
CONFIG_KEYS = (
    "hidden_size",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "rms_norm_eps",
)


def _check_config_int(fn: str, key: str, value) -> None:
    """A count in a config: a positive integer, not a bool or a string from JSON."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{fn}: config {key} must be a positive integer, got {value!r}")


@no_type_check  # a public entry point: checks.py names its bad arguments
def qwen3_next_layer_kwargs(config) -> dict:
    """``GatedDeltaNet``'s constructor arguments for the linear-attention layers of a
    Qwen3-Next ``config`` (a mapping with ``Qwen3NextConfig``'s attribute names, or the config
    object itself)."""
    fn = "qwen3_next_layer_kwargs"
    if not isinstance(config, Mapping) and hasattr(config, "to_dict"):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise ValueError(f"{fn}: config must be a mapping, got {type(config).__name__}")
    missing = [key for key in CONFIG_KEYS if key not in config]
    if missing:
        raise ValueError(f"{fn}: config lacks {', '.join(missing)}")
    act = config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{fn}: config hidden_act={act!r}; the layer's convolution uses silu")
    for key in CONFIG_KEYS[:-1]:
        _check_config_int(fn, key, config[key])
    checks.check_positive_number(fn, rms_norm_eps=config["rms_norm_eps"])
    key_dim, value_dim = config["linear_key_head_dim"], config["linear_value_head_dim"]
    kwargs = dict(
        hidden_size=config["hidden_size"],
        num_heads=config["linear_num_key_heads"],
        head_dim=key_dim,
        num_v_heads=config["linear_num_value_heads"],
        expand_v=value_dim / key_dim,
        use_gate=True,
        use_short_conv=True,
        conv_size=config["linear_conv_kernel_dim"],
        conv_bias=False,
        allow_neg_eigval=False,
        norm_eps=config["rms_norm_eps"],
    )
    if key_dim * kwargs["expand_v"] != value_dim:
        raise ValueError(
            f"{fn}: linear_value_head_dim={value_dim} is not an exact float multiple of "
            f"linear_key_head_dim={key_dim}"
        )
    if kwargs["num_v_heads"] % kwargs["num_heads"]:
        raise ValueError(
            f"{fn}: config linear_num_value_heads={kwargs['num_v_heads']} must be a multiple "
            f"of linear_num_key_heads={kwargs['num_heads']}"
        )
    return kwargs


def _dims(kwargs: dict) -> tuple[int, int, int, int, int]:
    """``(H, R, K, V, D)``."""
    heads, v_heads, key_dim = kwargs["num_heads"], kwargs["num_v_heads"], kwargs["head_dim"]
    value_dim = int(key_dim * kwargs["expand_v"])
    return heads, v_heads // heads, key_dim, value_dim, kwargs["hidden_size"]


def _expected_shapes(kwargs: dict) -> dict[str, tuple[int, ...]]:
    heads, group, key_dim, value_dim, hidden = _dims(kwargs)
    keys, values = heads * key_dim, heads * group * value_dim
    return {
        "in_proj_qkvz.weight": (2 * keys + 2 * values, hidden),
        "in_proj_ba.weight": (2 * heads * group, hidden),
        "conv1d.weight": (2 * keys + values, 1, kwargs["conv_size"]),
        "A_log": (heads * group,),
        "dt_bias": (heads * group,),
        "norm.weight": (value_dim,),
        "out_proj.weight": (hidden, values),
    }


def _to_fla(tensors: dict, kwargs: dict) -> dict[str, np.ndarray]:
    heads, group, key_dim, value_dim, hidden = _dims(kwargs)
    per_head = group * value_dim
    qkvz = tensors["in_proj_qkvz.weight"].reshape(heads, 2 * key_dim + 2 * per_head, hidden)
    q, k, v, z = np.split(qkvz, np.cumsum([key_dim, key_dim, per_head]), axis=1)
    ba = tensors["in_proj_ba.weight"].reshape(heads, 2 * group, hidden)
    keys = heads * key_dim
    conv = tensors["conv1d.weight"]
    return {
        "q_proj.weight": q.reshape(keys, hidden),
        "k_proj.weight": k.reshape(keys, hidden),
        "v_proj.weight": v.reshape(heads * per_head, hidden),
        "g_proj.weight": z.reshape(heads * per_head, hidden),
        "b_proj.weight": ba[:, :group].reshape(heads * group, hidden),
        "a_proj.weight": ba[:, group:].reshape(heads * group, hidden),
        "q_conv1d.weight": conv[:keys],
        "k_conv1d.weight": conv[keys : 2 * keys],
        "v_conv1d.weight": conv[2 * keys :],
        "A_log": tensors["A_log"],
        "dt_bias": tensors["dt_bias"],
        "o_norm.weight": tensors["norm.weight"],
        "o_proj.weight": tensors["out_proj.weight"],
    }


@no_type_check  # a public entry point: checks.py names its bad arguments
def load_qwen3_next_layer(state_dict, config, *, dtype=None) -> GatedDeltaNet:
    """A ``GatedDeltaNet`` holding one ``Qwen3NextGatedDeltaNet`` layer's weights.

    Args:
      state_dict: ``{name: array}`` without prefix: ``in_proj_qkvz.weight``,
        ``in_proj_ba.weight``, ``conv1d.weight``, ``A_log``, ``dt_bias``, ``norm.weight``,
        ``out_proj.weight`` (``read_safetensors(path, "model.layers.{i}.linear_attn.")``).
      config: a mapping with ``Qwen3NextConfig``'s names (``hidden_size``,
        ``linear_num_key_heads``, ``linear_num_value_heads``, ``linear_key_head_dim``,
        ``linear_value_head_dim``, ``linear_conv_kernel_dim``, ``rms_norm_eps``);
        ``Qwen3NextConfig.to_dict()`` works as is.
      dtype: cast every parameter to it and compute in it; ``None`` keeps each tensor's
        stored dtype and computes in that of ``in_proj_qkvz.weight``.

    Raises:
      ValueError: a config the layer cannot take, or a missing, unexpected or wrongly shaped
        tensor (named, with both shapes), before anything is built.
    """
    fn = "load_qwen3_next_layer"
    checks.check_floating_dtype(fn, dtype=dtype)
    kwargs = qwen3_next_layer_kwargs(config)
    tensors = as_numpy_dict(fn, state_dict)
    check_tensors(fn, tensors, _expected_shapes(kwargs))
    layer_dtype = {} if dtype is None else {"dtype": dtype, "param_dtype": dtype}
    return load_fla_layer(_to_fla(tensors, kwargs), **kwargs, **layer_dtype)


@no_type_check  # a public entry point: checks.py names its bad arguments
def export_qwen3_next_layer(layer: GatedDeltaNet) -> dict[str, np.ndarray]:
    """``layer``'s parameters as a ``Qwen3NextGatedDeltaNet`` state dict, the inverse of
    ``load_qwen3_next_layer``. The layer must have Qwen3-Next's form: output gate, short
    convolutions without bias, ``allow_neg_eigval=False``."""
    fn = "export_qwen3_next_layer"
    fla = export_fla_layer(layer)
    if not layer.use_gate or layer.q_conv1d is None or "q_conv1d.bias" in fla:
        raise ValueError(
            f"{fn}: Qwen3-Next's layer has an output gate and bias-free short convolutions; "
            f"this layer has use_gate={layer.use_gate}, "
            f"use_short_conv={layer.q_conv1d is not None}, conv_bias={'q_conv1d.bias' in fla}"
        )
    if layer.allow_neg_eigval:
        raise ValueError(f"{fn}: Qwen3-Next's beta lies in (0, 1); allow_neg_eigval=True")
    heads, hidden = layer.num_heads, layer.hidden_size

    def per_head(name):
        return fla[name].reshape(heads, -1, hidden)

    qkvz = np.concatenate(
        [per_head(n) for n in ("q_proj.weight", "k_proj.weight")]
        + [per_head(n) for n in ("v_proj.weight", "g_proj.weight")],
        axis=1,
    )
    ba = np.concatenate([per_head("b_proj.weight"), per_head("a_proj.weight")], axis=1)
    conv = [fla[f"{c}_conv1d.weight"] for c in "qkv"]
    return {
        "in_proj_qkvz.weight": qkvz.reshape(-1, hidden),
        "in_proj_ba.weight": ba.reshape(-1, hidden),
        "conv1d.weight": np.concatenate(conv, axis=0),
        "A_log": fla["A_log"],
        "dt_bias": fla["dt_bias"],
        "norm.weight": fla["o_norm.weight"],
        "out_proj.weight": fla["o_proj.weight"],
    }


@no_type_check  # a public entry point: checks.py names its bad arguments
def qwen3_next_cache_to_gdn(conv_state, recurrent_state) -> RecurrentCache:
    """transformers' per-layer decoding cache as gdn_jax's ``RecurrentCache``.

    Args:
      conv_state: ``[B, 2*H*K + HV*V, W]``, the last ``W`` inputs of the fused convolution
        (only the last ``W - 1`` reach a later output; gdn_jax keeps those).
      recurrent_state: ``[B, HV, K, V]`` (gdn_jax's state is its transpose, ``[B, HV, V, K]``).
    """
    fn = "qwen3_next_cache_to_gdn"
    conv, state = np.asarray(conv_state), np.asarray(recurrent_state)
    if conv.ndim != 3 or state.ndim != 4 or conv.shape[0] != state.shape[0]:
        raise ValueError(
            f"{fn}: conv_state must be [B, channels, W] and recurrent_state [B, HV, K, V] with "
            f"one B, got {conv.shape} and {state.shape}"
        )
    batch, v_heads, key_dim, value_dim = state.shape
    keys2 = conv.shape[1] - v_heads * value_dim
    if keys2 <= 0 or keys2 % (2 * key_dim) or conv.shape[2] < 2:
        raise ValueError(
            f"{fn}: conv_state {conv.shape} does not fit recurrent_state {state.shape}: its "
            f"channels must be 2*H*{key_dim} + {v_heads}*{value_dim} and its width at least 2"
        )
    history = conv[:, :, 1:].transpose(0, 2, 1)
    q, k, v = np.split(history, [keys2 // 2, keys2], axis=2)
    return RecurrentCache(
        conv=tuple(jnp.asarray(x) for x in (q, k, v)),
        state=jnp.asarray(state.transpose(0, 1, 3, 2), jnp.float32),
    )


@no_type_check  # a public entry point: checks.py names its bad arguments
def gdn_cache_to_qwen3_next(cache: RecurrentCache) -> tuple[np.ndarray, np.ndarray]:
    """gdn_jax's ``RecurrentCache`` as transformers' ``(conv_state [B, channels, W],
    recurrent_state [B, HV, K, V])``. The oldest column of ``conv_state``, which no later
    output reads, is zero."""
    fn = "gdn_cache_to_qwen3_next"
    if not isinstance(cache, RecurrentCache) or cache.conv is None:
        raise ValueError(
            f"{fn}: cache must be a RecurrentCache with convolution histories (a layer with "
            f"short convolutions), got {type(cache).__name__}"
        )
    history = np.concatenate([np.asarray(h) for h in cache.conv], axis=2)
    conv = np.pad(history.transpose(0, 2, 1), ((0, 0), (0, 0), (1, 0)))
    return np.ascontiguousarray(conv), np.ascontiguousarray(
        np.asarray(cache.state).transpose(0, 1, 3, 2)
    )


@no_type_check  # a public entry point: checks.py names its bad arguments
def qwen3_next_layer_prefixes(config) -> dict[int, str]:
    """``{layer index: "model.layers.{i}.linear_attn."}`` for the linear-attention layers of a
    Qwen3-Next ``config``, the prefixes to give ``read_safetensors``. The layers come from
    ``layer_types`` or, in a ``config.json`` without it, from ``num_hidden_layers`` and
    ``full_attention_interval`` (every ``interval``-th layer is full attention, default 4), as
    ``Qwen3NextConfig`` derives them."""
    fn = "qwen3_next_layer_prefixes"
    if not isinstance(config, Mapping) and hasattr(config, "to_dict"):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise ValueError(f"{fn}: config must be a mapping, got {type(config).__name__}")
    types = config.get("layer_types")
    if types is None:
        if "num_hidden_layers" not in config:
            raise ValueError(f"{fn}: config has neither layer_types nor num_hidden_layers")
        interval = config.get("full_attention_interval", 4)
        _check_config_int(fn, "num_hidden_layers", config["num_hidden_layers"])
        _check_config_int(fn, "full_attention_interval", interval)
        types = [
            "linear_attention" if (i + 1) % interval else "full_attention"
            for i in range(config["num_hidden_layers"])
        ]
    if not isinstance(types, list | tuple):
        raise ValueError(f"{fn}: config layer_types must be a list of layer kinds, got {types!r}")
    unknown = [kind for kind in types if kind not in LAYER_KINDS]
    if unknown:
        # A typo ("linear-attention") would otherwise drop a layer without a word.
        raise ValueError(
            f"{fn}: config layer_types names unknown kinds {unknown[:5]}; known: {LAYER_KINDS}"
        )
    return {
        i: f"model.layers.{i}.linear_attn."
        for i, kind in enumerate(types)
        if kind == "linear_attention"
    }
