"""The language model's configuration: data, validated when the model is built."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Literal, no_type_check

import jax
import jax.numpy as jnp

from gdn_jax.layers.params import GateInit
from gdn_jax.models.mixers import MIXERS, RENAMED
from gdn_jax.ops.checks import Impl, Schedule, is_real_number
from gdn_jax.ops.renamed import warn_renamed

# The names of the registered mixers (models/mixers.py), in the registry's order.
Mixer = Literal[tuple(MIXERS)]
DTYPES = ("float32", "bfloat16", "float16", "float64")
GATE_INITS = ("head_gate_init", "channel_gate_init")
GATE_INIT_FIELDS = {f.name for f in dataclasses.fields(GateInit)}


@no_type_check  # data: validate() names bad fields
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A stack of pre-norm blocks; every field is checked by ``validate``."""

    # Token ids are [0, vocab_size).
    vocab_size: int = 8192
    # Width D of the residual stream.
    d_model: int = 64
    # Token mixer of each layer, a name of models.mixers.MIXERS; the number of layers is
    # len(mixers). A hybrid stack is a mixed list, e.g. ("gdn", "gdn", "attention"); one
    # name alone is a one-layer stack.
    mixers: tuple[Mixer, ...] = ("gdn", "gdn")
    # Query/key heads H of every mixer.
    num_heads: int = 2
    # Key dim K per head (and attention's head dim); None means d_model // num_heads.
    head_dim: int | None = None
    # Recurrent mixers: value head dim V = head_dim * expand_v (flash-linear-attention uses 2).
    expand_v: float = 1.0
    # Recurrent mixers: value heads HV, a multiple of num_heads; None means num_heads.
    num_v_heads: int | None = None
    # Recurrent mixers: gate the output norm with silu(g_proj(x)) (kda: with its sigmoid gate).
    use_gate: bool = True
    # Recurrent mixers: causal depthwise convolution on q, k, v.
    use_short_conv: bool = True
    # Width of that convolution (also attention_conv's).
    conv_size: int = 4
    # Delta-rule mixers: beta in [0, 2] instead of [0, 1] (negative eigenvalues).
    allow_neg_eigval: bool = False
    # Gated DeltaProduct: delta-rule steps a token (each with its key, value and beta).
    num_householder: int = 2
    # KDA: its forget and output gates each a product of two projections through rank
    # head_v_dim (flash-linear-attention's); false: one full-rank projection each (Bailing's).
    low_rank_gates: bool = True
    # Chunk size C of the chunked recurrence.
    chunk_size: int = 64
    # Recurrent mixers' form: "auto" (a kernel of the rule where it is marked for the
    # platform compiled for and takes these shapes, else "chunked"), "chunked" (train with
    # this), "recurrent" (the token-by-token reference) or a kernel ("mosaic_gpu").
    impl: Impl = "auto"
    # Schedule of the chunked recurrence: "hoisted", "associative" or "in_scan", traced
    # alone; "auto" picks one by the platform the program is lowered for (in_scan on CPU,
    # associative on an NVIDIA GPU, hoisted elsewhere), so all three are traced.
    schedule: Schedule = "auto"
    # Attention: sliding window in tokens, or None for full causal attention.
    window: int | None = None
    # Attention: RoPE base.
    rope_theta: float = 10000.0
    # Whether blocks have the SwiGLU MLP after the mixer (recall studies often drop it).
    use_mlp: bool = True
    # MLP inner width; None means 8/3 * d_model rounded up to a multiple of 8.
    mlp_hidden: int | None = None
    # Share the embedding matrix with the output head.
    tie_embeddings: bool = False
    # Epsilon of every RMSNorm.
    norm_eps: float = 1e-5
    # Std of the normal init of projections and embeddings (flash-linear-attention: 0.02).
    init_std: float = 0.02
    # Std of the normal init of the mixers' projections alone; None is init_std.
    mixer_init_std: float | None = None
    # Initial law of the decay gates of the mixers with one decay per head (gdn, simple_gla,
    # gated_deltaproduct) and one per key channel (kda, gdn2): A ~ U(a_min, a_max), dt
    # log-uniform in [dt_min, dt_max] floored at dt_floor. An unset field is the layer's
    # default, flash-linear-attention's (A from U(0, 16) a head, U(1, 16) a channel; dt in
    # [1e-3, 0.1], floor 1e-4). A mapping of these fields is taken as a GateInit.
    head_gate_init: GateInit = GateInit()
    channel_gate_init: GateInit = GateInit()
    # Activation and parameter dtypes.
    dtype: str = "float32"
    param_dtype: str = "float32"

    def __post_init__(self):
        # Written by hand as a YAML file reads: one mixer name is a one-layer stack (as YAML's
        # "mixers: gdn" and the CLI's --set model.mixers=gdn are), a list a tuple, and a
        # mapping of GateInit's fields that law. Anything else stays for validate() to name.
        if isinstance(self.mixers, str):
            object.__setattr__(self, "mixers", (self.mixers,))
        elif isinstance(self.mixers, list):
            object.__setattr__(self, "mixers", tuple(self.mixers))
        if isinstance(self.mixers, tuple) and any(name in RENAMED for name in self.mixers):
            for old in {name for name in self.mixers if name in RENAMED}:
                warn_renamed(f"mixer name {old!r}", repr(RENAMED[old]), stacklevel=4)
            renamed = tuple(RENAMED.get(name, name) for name in self.mixers)
            object.__setattr__(self, "mixers", renamed)
        for field in GATE_INITS:
            value = getattr(self, field)
            if isinstance(value, dict) and set(value) <= GATE_INIT_FIELDS:
                object.__setattr__(self, field, GateInit(**value))

    def validate(self) -> ModelConfig:
        """Raise ``ValueError`` naming the first bad field; return ``self`` when all are fine.

        Checks the field types (a config is data, often read from YAML) and the model-level
        rules: the mixer list, the head split of ``d_model``, dtypes and the positive numbers
        the model itself uses. Per-layer rules (``chunk_size``, ``impl``, ``schedule``,
        ``num_v_heads``, ``expand_v``, the RoPE head dim, ``window``, ``mlp_hidden``) belong to
        the layer constructors, which raise when the model is built (``LanguageModel`` or
        ``check_buildable``)."""

        def fail(field, message):
            raise ValueError(f"ModelConfig.{field}={getattr(self, field)!r}: {message}")

        def whole(value):
            return isinstance(value, numbers.Integral) and not isinstance(value, bool)

        for field in ("vocab_size", "d_model", "num_heads", "conv_size"):
            if not whole(getattr(self, field)) or getattr(self, field) < 1:
                fail(field, "must be a positive integer")
        for field in ("head_dim", "num_v_heads", "window", "mlp_hidden"):
            if getattr(self, field) is not None and not whole(getattr(self, field)):
                fail(field, "must be a positive integer or None")
        for field in ("expand_v", "norm_eps", "init_std", "rope_theta"):
            value = getattr(self, field)
            if not is_real_number(value):
                fail(field, "must be a number")
        for field in (
            "allow_neg_eigval",
            "low_rank_gates",
            "use_gate",
            "use_short_conv",
            "use_mlp",
            "tie_embeddings",
        ):
            if not isinstance(getattr(self, field), bool):
                fail(field, "must be true or false")
        if not isinstance(self.mixers, tuple) or not self.mixers:
            fail("mixers", f"needs a list of at least one layer, each one of {tuple(MIXERS)}")
        for name in self.mixers:
            if name not in MIXERS:
                fail("mixers", f"unknown mixer {name!r}; allowed: {tuple(MIXERS)}")
        if self.head_dim is None and self.d_model % self.num_heads:
            fail("num_heads", f"must divide d_model={self.d_model} when head_dim is None")
        for field in ("dtype", "param_dtype"):
            if getattr(self, field) not in DTYPES:
                fail(field, f"allowed: {DTYPES}")
            if getattr(self, field) == "float64" and not jax.config.jax_enable_x64:
                fail(
                    field,
                    "needs JAX's 64-bit mode, which is off (the model would compute in "
                    "float32): set JAX_ENABLE_X64=1",
                )
        for field in ("norm_eps", "init_std"):
            if not (math.isfinite(getattr(self, field)) and getattr(self, field) > 0):
                fail(field, "must be finite and positive")
        std = self.mixer_init_std
        if std is not None and not (is_real_number(std) and math.isfinite(std) and std > 0):
            fail("mixer_init_std", "must be a finite positive number or None")
        for field in GATE_INITS:
            if not isinstance(getattr(self, field), GateInit):
                fail(
                    field,
                    f"must be a GateInit or a mapping of its fields {sorted(GATE_INIT_FIELDS)}",
                )
        return self

    @property
    def num_layers(self) -> int:
        return len(self.mixers)

    @property
    def key_head_dim(self) -> int:
        return self.d_model // self.num_heads if self.head_dim is None else self.head_dim

    @property
    def mlp_width(self) -> int:
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        return -(-(8 * self.d_model // 3) // 8) * 8

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def jnp_param_dtype(self):
        return jnp.dtype(self.param_dtype)
