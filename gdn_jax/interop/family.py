"""What every transformers linear-attention family shares, and the spec that says how it
differs: the Gated DeltaNet families (``gdn_family.GatedDeltaNetFamily``) and the Kimi Delta
Attention ones (``kda_family.KDAFamily``).

Each family's linear-attention layer has a gdn_jax layer's parameters (under PyTorch's names,
``torch_layout.py``) under other names, some of them fused: a fused PyTorch tensor is the
layer's tensors concatenated along their first (output) axis, either whole one after another
(``[q | k | v]``) or, in Qwen3-Next's ``in_proj_qkvz``, per key head
(``[q_0 | k_0 | v_0 | z_0 | q_1 | ...]``). A ``Family`` is that table plus the few config
conventions that differ; everything else lives here once:

- the whole-state-dict check (one ``ValueError`` listing every missing, unexpected or
  misshapen tensor), against shapes taken from an abstract build of the layer;
- the names a checkpoint stores tensors under, where transformers renames or concatenates
  them on load;
- splitting fused tensors into the layer's and joining them back, so
  ``torch_layout.load_torch_layer`` and ``torch_layout.torch_state_dict`` do the layout work;
- the decoding cache, which is the same in every family: one depthwise convolution over
  ``[q | k | v]`` and a ``[B, HV, K, V]`` state;
- the linear-attention layers' prefixes from ``layer_types``.
A subclass reads the layer's constructor arguments from the config and says which layers
the family can hold.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from typing import ClassVar, no_type_check

import jax.numpy as jnp
import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from gdn_jax.interop.tensors import as_numpy_dict, check_tensors
from gdn_jax.interop.torch_layout import load_torch_layer, torch_state_dict, torch_tensor_shapes
from gdn_jax.layers.recurrent_layer import RecurrentCache, RecurrentLayer
from gdn_jax.ops import checks

LINEAR = "linear_attention"
# The other kinds a layer_types list may name; a typo would otherwise drop a layer silently.
ATTENTION_KINDS = ("full_attention", "sliding_attention", "indexed_attention")
# The fused convolution over [q | k | v] that every family has.
QKV_CONV = ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")


@dataclasses.dataclass(frozen=True)
class Family(abc.ABC):
    """How one transformers family lays out a gdn_jax layer's parameters.

    Attributes:
      name: the stem of the public functions (``load_{name}_layer``, ...).
      title: the family's name in messages.
      tensors: ``{PyTorch name: the layer's tensors it concatenates, in order}``, every
        tensor of the transformers layer's state dict.
      per_key_head: the fused tensors whose parts are interleaved per key head.
      interval_default: without ``layer_types``, every ``full_attention_interval``-th layer
        (this default) is full attention; ``None`` requires ``layer_types``.
      stored_in_parts: ``{PyTorch name: the names a checkpoint stores it under}``, parts
        that transformers' ``conversion_mapping`` concatenates along the first axis on load
        (whatever their sizes: transformers 5.24 saves them back in equal thirds).
      stored_as: ``{PyTorch name: the name a checkpoint stores it under}``, where
        transformers' ``conversion_mapping`` renames a tensor on load.
      unsqueezed: ``{PyTorch name: axes}``, tensors the transformers layer holds with axes of
        size 1 inserted (``np.expand_dims``) around the gdn_jax layer's shape.
      module: the layer's name in checkpoints' tensor names (``model.layers.{i}.{module}.``).
      layers_stem: where the decoder layers lie in a checkpoint; ``None`` means
        ``model.layers``, or ``model.language_model.layers`` for a multimodal config.
      also_model_types: the other ``model_type`` values (besides ``name``) of configs the
        family reads, e.g. siblings and the ``*_text`` of a multimodal config's text part.
    """

    layer_class: ClassVar[type]  # the gdn_jax layer a family's layers load as

    name: str
    title: str
    tensors: Mapping[str, tuple[str, ...]]
    per_key_head: frozenset[str] = frozenset()
    interval_default: int | None = 4
    stored_in_parts: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    stored_as: Mapping[str, str] = dataclasses.field(default_factory=dict)
    unsqueezed: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    module: str = "linear_attn"
    layers_stem: str | None = None
    also_model_types: tuple[str, ...] = ()

    @property
    def model_types(self) -> tuple[str, ...]:
        return (self.name, *self.also_model_types)

    @abc.abstractmethod
    def config_kwargs(self, fn: str, config: Mapping) -> dict:
        """The layer's constructor arguments from the text config, each value checked
        (errors name ``fn``)."""

    @abc.abstractmethod
    def check_form(self, fn: str, layer, tensors: Mapping) -> None:
        """Raise a ``ValueError`` naming ``fn`` unless the family can hold ``layer``, whose
        PyTorch-named ``tensors`` are given."""

    def config_view(self, fn: str, config: Mapping) -> Mapping:
        """The text config with the fields the family reads filled in as transformers'
        config class does on load (from a ``config.json``'s own names); as given here."""
        return config

    @no_type_check  # a public entry point: checks.py names its bad arguments
    def layer_kwargs(self, config) -> dict:
        """The gdn_jax layer's constructor arguments for this family's linear-attention
        layers (a mapping with the config's attribute names, the config object itself, or a
        multimodal config, whose ``text_config`` is read)."""
        return _layer_kwargs(self, f"{self.name}_layer_kwargs", config)

    @no_type_check  # a public entry point: checks.py names its bad arguments
    def load(
        self,
        state_dict: Mapping[str, ArrayLike],
        config: Mapping | object,
        *,
        dtype: DTypeLike | None = None,
        schedule: str = "auto",
    ) -> RecurrentLayer:
        """The gdn_jax layer (``layer_class``) holding one linear-attention layer's weights.

        Args:
          state_dict: ``{name: array}`` of one layer without prefix, as
            ``read_safetensors(path, prefix)`` gives it for a prefix of ``layer_prefixes``.
          config: the model's config as a mapping (``config.to_dict()``, or ``config.json``
            read), or the config object.
          dtype: cast every parameter to it and compute in it; ``None`` keeps each tensor's
            stored dtype and computes in that of the first projection.
          schedule: the layer's chunked schedule (``"auto"``, ``"hoisted"``,
            ``"associative"`` or ``"in_scan"``).

        Raises:
          ValueError: a config the layer cannot take, or a missing, unexpected or wrongly
            shaped tensor (named, with both shapes), before anything is built.
        """
        fn = f"load_{self.name}_layer"
        checks.check_floating_dtype(fn, dtype=dtype)
        checks.check_schedule(fn, schedule)
        kwargs = _layer_kwargs(self, fn, config)
        tensors = _from_stored_names(self, as_numpy_dict(fn, state_dict))
        layer_shapes = torch_tensor_shapes(self.layer_class, **kwargs)
        check_tensors(fn, tensors, _fused_shapes(self, layer_shapes))
        parts = _split(self, tensors, layer_shapes, kwargs["num_heads"])
        layer_dtype = {} if dtype is None else {"dtype": dtype, "param_dtype": dtype}
        layer_options = dict(kwargs, schedule=schedule, **layer_dtype)
        return load_torch_layer(fn, self.layer_class, parts, **layer_options)

    @no_type_check  # a public entry point: checks.py names its bad arguments
    def export(self, layer) -> dict[str, np.ndarray]:
        """``layer``'s parameters as this family's state dict (the transformers layer's
        names), the inverse of ``load``. The layer must have the family's form
        (``check_form``)."""
        fn = f"export_{self.name}_layer"
        if not isinstance(layer, self.layer_class):
            raise ValueError(
                f"{fn}: layer must be a {self.layer_class.__name__}, got {type(layer).__name__}"
            )
        tensors = torch_state_dict(layer)
        self.check_form(fn, layer, tensors)
        return {
            name: _join(self, name, [tensors[part] for part in parts], layer.num_heads)
            for name, parts in self.tensors.items()
        }

    @no_type_check  # a public entry point: checks.py names its bad arguments
    def cache_to_gdn_jax(self, conv_state: ArrayLike, recurrent_state: ArrayLike) -> RecurrentCache:
        """transformers' per-layer decoding cache as gdn_jax's ``RecurrentCache``.

        Args:
          conv_state: ``[B, 2*H*K + HV*V, W]``, the last ``W`` inputs of the fused
            convolution (only the last ``W - 1`` reach a later output; gdn_jax keeps those).
          recurrent_state: ``[B, HV, K, V]`` (gdn_jax's state is its transpose).
        """
        return _cache_to_gdn_jax(f"{self.name}_cache_to_gdn_jax", conv_state, recurrent_state)

    @no_type_check  # a public entry point: checks.py names its bad arguments
    def cache_from_gdn_jax(self, cache: RecurrentCache) -> tuple[np.ndarray, np.ndarray]:
        """gdn_jax's ``RecurrentCache`` as transformers' ``(conv_state [B, channels, W],
        recurrent_state [B, HV, K, V])``. The oldest column of ``conv_state``, which no
        later output reads, is zero."""
        return _cache_from_gdn_jax(f"gdn_jax_cache_to_{self.name}", cache)

    @no_type_check  # a public entry point: checks.py names its bad arguments
    def layer_prefixes(self, config) -> dict[int, str]:
        """``{layer index: prefix}`` of the linear-attention layers, the prefixes to give
        ``read_safetensors``: ``model.layers.{i}.{module}.``, or
        ``model.language_model.layers.{i}.{module}.`` for a multimodal config (or under
        ``layers_stem``). The layers come from ``layer_types`` or, where the family allows a
        ``config.json`` without it, from ``num_hidden_layers`` and
        ``full_attention_interval`` (or the family's own fields, ``config_view``)."""
        return _layer_prefixes(self, f"{self.name}_layer_prefixes", config)


def _as_mapping(fn: str, config) -> Mapping:
    if not isinstance(config, Mapping) and hasattr(config, "to_dict"):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise ValueError(f"{fn}: config must be a mapping, got {type(config).__name__}")
    return config


def text_config(fn: str, config) -> tuple[Mapping, bool]:
    """The config that describes the language model, and whether it was a multimodal
    config's ``text_config``."""
    config = _as_mapping(fn, config)
    if "text_config" in config:
        return _as_mapping(f"{fn}: text_config", config["text_config"]), True
    return config, False


def _layer_kwargs(family: Family, fn: str, config) -> dict:
    text, _ = text_config(fn, config)
    return family.config_kwargs(fn, family.config_view(fn, text))


def check_activation(fn: str, config: Mapping, *keys: str) -> None:
    """The convolution and the output gate of the layers use SiLU: refuse a config whose
    ``keys`` name another activation (an absent or empty one is SiLU)."""
    for key in keys:
        act = config.get(key) or "silu"
        if act not in ("silu", "swish"):
            raise ValueError(f"{fn}: config {key}={act!r}; the layer uses silu")


def require_keys(fn: str, config: Mapping, keys) -> None:
    missing = [key for key in keys if key not in config]
    if missing:
        raise ValueError(f"{fn}: config lacks {', '.join(missing)}")


def check_gated_short_conv(family: Family, fn: str, layer, tensors: Mapping) -> None:
    """Every family's layer has an output gate and bias-free short convolutions."""
    if not layer.use_gate or layer.q_conv1d is None or "q_conv1d.bias" in tensors:
        raise ValueError(
            f"{fn}: {family.title}'s layer has an output gate and bias-free short "
            f"convolutions; this layer has use_gate={layer.use_gate}, "
            f"use_short_conv={layer.q_conv1d is not None}, "
            f"conv_bias={'q_conv1d.bias' in tensors}"
        )


def _from_stored_names(family: Family, tensors: dict) -> dict:
    """``tensors`` under the transformers layer's names: each renamed one under its name,
    each complete set of stored parts concatenated as transformers does. A name given both
    ways, or an incomplete set, is left for ``check_tensors`` to name."""
    for name, stored in family.stored_as.items():
        if name not in tensors and stored in tensors:
            tensors[name] = tensors.pop(stored)
    for name, parts in family.stored_in_parts.items():
        if name not in tensors and all(part in tensors for part in parts):
            tensors[name] = np.concatenate([tensors.pop(part) for part in parts], axis=0)
    return tensors


def _groups(family: Family, name: str, heads: int) -> int:
    """How many blocks a fused tensor interleaves its parts in: one per key head, or one."""
    return heads if name in family.per_key_head else 1


def _fused_shapes(family: Family, layer_shapes: Mapping) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for name, parts in family.tensors.items():
        first, *rest = layer_shapes[parts[0]]
        shape = (first + sum(layer_shapes[p][0] for p in parts[1:]), *rest)
        if name in family.unsqueezed:
            shape = np.expand_dims(np.empty(shape), family.unsqueezed[name]).shape
        shapes[name] = shape
    return shapes


def _split(family: Family, tensors: Mapping, layer_shapes: Mapping, heads: int) -> dict:
    out = {}
    for name, parts in family.tensors.items():
        groups = _groups(family, name, heads)
        tensor = tensors[name]
        if name in family.unsqueezed:
            tensor = np.squeeze(tensor, family.unsqueezed[name])
        blocks = tensor.reshape(groups, -1, *tensor.shape[1:])
        rows = [layer_shapes[part][0] // groups for part in parts]
        pieces = np.split(blocks, np.cumsum(rows)[:-1], axis=1)
        for part, piece in zip(parts, pieces, strict=True):
            out[part] = piece.reshape(layer_shapes[part])
    return out


def _join(family: Family, name: str, pieces: list[np.ndarray], heads: int) -> np.ndarray:
    groups = _groups(family, name, heads)
    blocks = [p.reshape(groups, -1, *p.shape[1:]) for p in pieces]
    joined = np.concatenate(blocks, axis=1).reshape(-1, *pieces[0].shape[1:])
    if name in family.unsqueezed:
        joined = np.expand_dims(joined, family.unsqueezed[name])
    return np.ascontiguousarray(joined)


def _cache_to_gdn_jax(fn: str, conv_state, recurrent_state) -> RecurrentCache:
    conv, state = np.asarray(conv_state), np.asarray(recurrent_state)
    if conv.ndim != 3 or state.ndim != 4 or conv.shape[0] != state.shape[0]:
        raise ValueError(
            f"{fn}: conv_state must be [B, channels, W] and recurrent_state [B, HV, K, V] with "
            f"one B, got {conv.shape} and {state.shape}"
        )
    _, v_heads, key_dim, value_dim = state.shape
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


def _cache_from_gdn_jax(fn: str, cache: RecurrentCache) -> tuple[np.ndarray, np.ndarray]:
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


def _layer_types(family: Family, fn: str, config: Mapping) -> list:
    types = config.get("layer_types")
    if types is None and family.interval_default is None:
        raise ValueError(f"{fn}: config has no layer_types")
    if types is None:
        if "num_hidden_layers" not in config:
            raise ValueError(f"{fn}: config has neither layer_types nor num_hidden_layers")
        interval = config.get("full_attention_interval", family.interval_default)
        checks.check_positive_int(
            fn,
            **{
                "config num_hidden_layers": config["num_hidden_layers"],
                "config full_attention_interval": interval,
            },
        )
        types = [
            LINEAR if (i + 1) % interval else "full_attention"
            for i in range(config["num_hidden_layers"])
        ]
    if not isinstance(types, list | tuple):
        raise ValueError(f"{fn}: config layer_types must be a list of layer kinds, got {types!r}")
    layers = config.get("num_hidden_layers")
    if layers is not None and len(types) != layers:
        raise ValueError(
            f"{fn}: config layer_types must name each of the num_hidden_layers={layers} "
            f"layers, got {len(types)} kinds"
        )
    known = (LINEAR, *ATTENTION_KINDS)
    unknown = [kind for kind in types if kind not in known]
    if unknown:
        raise ValueError(
            f"{fn}: config layer_types names unknown kinds {unknown[:5]}; known: {known}"
        )
    return list(types)


def _layer_prefixes(family: Family, fn: str, config) -> dict[int, str]:
    text, multimodal = text_config(fn, config)
    stem = family.layers_stem or ("model.language_model.layers" if multimodal else "model.layers")
    types = _layer_types(family, fn, family.config_view(fn, text))
    return {i: f"{stem}.{i}.{family.module}." for i, kind in enumerate(types) if kind == LINEAR}
