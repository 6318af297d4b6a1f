"""Every transformers family with a Gated DeltaNet layer, proven against transformers itself:
Qwen3.5 (and Qwen3.5-MoE through the same code), OLMo-Hybrid, and Qwen3-Next through
``load_layer``. Qwen3-Next's own layer-level tests are in test_interop.py."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.cpu_schedule import SCHEDULE
from support.tolerance import assert_relative_rms
from test_interop import (
    GDN_LAYER_CONFIG,
    LENGTHS,
    REAL_HEADS,
    TESTER,
    Lazy,
    assert_checkpoint_layers_match,
    assert_family_decoding_matches,
    assert_left_padding_matches,
    assert_packed_matches,
    assert_round_trip_exact,
    assert_same_params,
    forward,
    gdn_layer,
    hidden,
    numpy_state,
    packed,
    run_torch,
    torch,
    transformers,
)

from gdn_jax import GatedDeltaNet
from gdn_jax.interop import (
    FAMILIES,
    MODEL_TYPES,
    layer_prefixes,
    load_layer,
)
from gdn_jax.interop.olmo_hybrid import OLMO_HYBRID
from gdn_jax.interop.qwen3_5 import QWEN3_5

TESTER_HEADS = {k: v for k, v in TESTER.items() if k != "hidden_size"}


@dataclasses.dataclass(frozen=True)
class Case:
    """One family as transformers builds it: its config, layer and causal LM classes."""

    config: Lazy  # the class
    layer: Lazy  # the class
    lm: str
    real_heads: dict  # the released models' linear-attention head shape
    extra: dict = dataclasses.field(default_factory=dict)  # what the config needs besides

    def make_config(self, layer_types=("linear_attention",), heads=TESTER_HEADS, **kw):
        return self.config(
            hidden_size=64,
            num_hidden_layers=len(layer_types),
            layer_types=list(layer_types),
            linear_conv_kernel_dim=4,
            **heads,
            **{**self.extra, **kw},
        )


# Qwen3-Next and Qwen3.5 share their linear-attention head shape.
QWEN_REAL = {k: v for k, v in REAL_HEADS.items() if k != "hidden_size"}
MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)


def modeling(family, name):
    """transformers' class ``name`` of ``family``'s modeling module, imported when used."""
    return Lazy(f"transformers.models.{family}.modeling_{family}", name)


CASES = {
    "qwen3_5": Case(
        Lazy("transformers", "Qwen3_5TextConfig"),
        modeling("qwen3_5", "Qwen3_5GatedDeltaNet"),
        "Qwen3_5ForCausalLM",
        QWEN_REAL,
    ),
    "qwen3_5_moe": Case(
        Lazy("transformers", "Qwen3_5MoeTextConfig"),
        modeling("qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet"),
        "Qwen3_5MoeForCausalLM",
        QWEN_REAL,
        MOE,
    ),
    # OLMo-Hybrid 7B: 30 heads, K = 0.75 * 3840 / 30 = 96, V = 2K.
    "olmo_hybrid": Case(
        Lazy("transformers", "OlmoHybridConfig"),
        modeling("olmo_hybrid", "OlmoHybridGatedDeltaNet"),
        "OlmoHybridForCausalLM",
        dict(
            linear_num_key_heads=30,
            linear_num_value_heads=30,
            linear_key_head_dim=96,
            linear_value_head_dim=192,
        ),
        dict(num_attention_heads=4, pad_token_id=0),
    ),
    "qwen3_next": Case(
        Lazy("transformers", "Qwen3NextConfig"),
        modeling("qwen3_next", "Qwen3NextGatedDeltaNet"),
        "Qwen3NextForCausalLM",
        QWEN_REAL,
        MOE,
    ),
}
# OLMo-Hybrid refuses a config without an attention layer; layer 0 is the one under test.
LAYER_TYPES = {"olmo_hybrid": ("linear_attention", "full_attention")}


def family_layer(name, seed=0, heads=TESTER_HEADS):
    """A random transformers layer of family ``name`` and its config. The norm weight and
    dt_bias, which start as constants, are drawn too so that a swapped one shows."""
    case = CASES[name]
    config = case.make_config(LAYER_TYPES.get(name, ("linear_attention",)), heads)
    torch.manual_seed(seed)
    layer = case.layer(config, layer_idx=0).eval()
    norm = layer.o_norm if hasattr(layer, "o_norm") else layer.norm
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        layer.dt_bias.normal_()
    layer.config = config
    return layer, config


@pytest.mark.parametrize(
    ("name", "real"),
    [
        ("qwen3_5", False),
        ("qwen3_5", True),
        ("qwen3_5_moe", False),
        ("olmo_hybrid", False),
        ("olmo_hybrid", True),
        ("qwen3_next", True),
    ],
)
def test_outputs_equal_transformers(name, real):
    """Each T in LENGTHS alone through transformers, packed into one gdn_jax call."""
    reference, config = family_layer(name, heads=CASES[name].real_heads if real else TESTER_HEADS)
    layer = load_layer(numpy_state(reference), config.to_dict(), schedule=SCHEDULE)
    x, bounds = packed(LENGTHS, seed=len(name))
    assert_packed_matches(layer, reference, x, bounds, name)


@pytest.mark.parametrize("name", ["qwen3_5", "olmo_hybrid"])
def test_unpacked_batch_and_left_padding_equal_transformers(name):
    reference, config = family_layer(name, seed=1)
    layer = load_layer(numpy_state(reference), config.to_dict(), schedule=SCHEDULE)
    # Unpacked, T = 65 crosses a chunk boundary by one token.
    x = hidden(2, 2, 65)
    assert_relative_rms(forward(layer, x), run_torch(reference, x), jnp.float32)
    assert_left_padding_matches(layer, reference, x, pad=7)


@pytest.mark.parametrize("name", ["qwen3_5", "olmo_hybrid"])
def test_prefill_cache_and_decoding_equal_transformers(name):
    family = FAMILIES[name]
    reference, config = family_layer(name, seed=2)
    assert_family_decoding_matches(family, reference, config)


@pytest.mark.parametrize("name", ["qwen3_5", "olmo_hybrid", "qwen3_next"])
def test_checkpoint_saved_by_transformers(name, tmp_path):
    """load_layer reads every linear-attention layer of a tiny *ForCausalLM from the shards
    save_pretrained writes, and each maps that layer's real input to its real output."""
    case = CASES[name]
    kinds = ("linear_attention", "linear_attention", "full_attention")
    config = case.make_config(
        kinds,
        vocab_size=96,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    torch.manual_seed(4)
    model = getattr(transformers, case.lm)(config).eval()
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").exists()

    prefixes = layer_prefixes(config.to_dict())
    assert prefixes == {i: f"model.layers.{i}.linear_attn." for i in (0, 1)}
    assert_checkpoint_layers_match(model, tmp_path, prefixes, load_layer)


@pytest.mark.parametrize("name", ["qwen3_5", "olmo_hybrid"])
def test_round_trip_is_exact(name):
    family = FAMILIES[name]
    layer = gdn_layer(
        norm_eps=family.norm_eps or 1e-6, allow_neg_eigval=family.neg_eigval_key is not None
    )
    config = dict(GDN_LAYER_CONFIG, model_type=name)
    back = assert_round_trip_exact(layer, family.export, load_layer, config)
    assert back.allow_neg_eigval == layer.allow_neg_eigval
    assert back.o_norm.epsilon == layer.o_norm.epsilon


def test_multimodal_configs_read_their_text_config():
    text = CASES["qwen3_5"].make_config(("linear_attention", "full_attention")).to_dict()
    composite = {"model_type": "qwen3_5", "text_config": text}
    assert layer_prefixes(composite) == {0: "model.language_model.layers.0.linear_attn."}
    assert QWEN3_5.layer_kwargs(composite) == QWEN3_5.layer_kwargs(text)
    for model_type in ("qwen3_5_moe", "qwen4_exp", "lara_mini"):
        assert MODEL_TYPES[model_type] is QWEN3_5


# --- malformed input: one ValueError naming the tensor or argument, nothing built ---------


def test_unknown_model_types_name_the_supported_ones():
    with pytest.raises(ValueError, match=r"load_layer: config model_type='llama' .* qwen3_next"):
        load_layer({}, {"model_type": "llama"})
    with pytest.raises(ValueError, match=r"layer_prefixes: config model_type=None"):
        layer_prefixes({"layer_types": ["linear_attention"]})


def test_olmo_hybrid_checkpoints_store_the_convolution_in_parts():
    """OLMo-Hybrid's released checkpoints hold fla's q/k/v_conv1d (64, 64, 128 rows here);
    transformers 5.24's save_pretrained writes equal thirds (the checkpoint test)."""
    reference, config = family_layer("olmo_hybrid")
    weights, config = numpy_state(reference), config.to_dict()
    q, k, v = np.split(weights.pop("conv1d.weight"), [64, 128])
    parts = {**weights, "q_conv1d.weight": q, "k_conv1d.weight": k, "v_conv1d.weight": v}
    assert_same_params(load_layer(parts, config), load_layer(numpy_state(reference), config))
    del parts["v_conv1d.weight"]
    with pytest.raises(ValueError, match=r"missing tensor 'conv1d.weight'.*unexpected tensor 'q_"):
        load_layer(parts, config)


def test_family_tensors_and_configs_are_checked():
    reference, config = family_layer("olmo_hybrid")
    weights, config = numpy_state(reference), config.to_dict()
    with pytest.raises(ValueError, match=r"missing tensor 'g_proj.weight' \(expected shape"):
        load_layer({k: v for k, v in weights.items() if k != "g_proj.weight"}, config)
    with pytest.raises(
        ValueError, match=r"'conv1d.weight' has shape \(256, 1, 4\), the config needs \(512, 1, 4\)"
    ):
        load_layer(weights, {**config, "linear_key_head_dim": 32, "linear_value_head_dim": 32})
    with pytest.raises(ValueError, match=r"linear_allow_neg_eigval must be a bool, got 'yes'"):
        load_layer(weights, {**config, "linear_allow_neg_eigval": "yes"})
    qwen = CASES["qwen3_5"].make_config().to_dict()
    with pytest.raises(ValueError, match=r"output_gate_type='sigmoid'; the layer uses silu"):
        QWEN3_5.layer_kwargs({**qwen, "output_gate_type": "sigmoid"})
    with pytest.raises(ValueError, match=r"olmo_hybrid_layer_prefixes: config has no layer_types"):
        OLMO_HYBRID.layer_prefixes({"num_hidden_layers": 4})
    # A short layer_types would give fewer layers, silently.
    short = dict(num_hidden_layers=4, layer_types=["linear_attention"] * 3)
    with pytest.raises(
        ValueError,
        match=r"layer_prefixes: config layer_types must name each of the num_hidden_layers=4 "
        r"layers, got 3 kinds",
    ):
        layer_prefixes({**qwen, **short})


def test_layers_a_family_cannot_hold_are_refused():
    base = dict(num_heads=2, head_dim=8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"export_olmo_hybrid_layer: OLMo-Hybrid's output norm"):
        OLMO_HYBRID.export(GatedDeltaNet(32, norm_eps=1e-6, **base))
    with pytest.raises(ValueError, match=r"export_qwen3_5_layer: Qwen3.5's beta lies in \(0, 1\)"):
        QWEN3_5.export(GatedDeltaNet(32, allow_neg_eigval=True, **base))
    with pytest.raises(ValueError, match=r"Qwen3.5's layer has an output gate.*conv_bias=True"):
        QWEN3_5.export(GatedDeltaNet(32, conv_bias=True, **base))
