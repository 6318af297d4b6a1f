"""The Kimi Delta Attention families, Kimi-Linear, Bailing-hybrid and GLM-5 Next, proven against
transformers itself (its PyTorch fallback of the KDA kernels, as on any machine without fla)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from support.cpu_schedule import SCHEDULE
from support.layer_forms import parameter_count
from support.tolerance import assert_relative_rms
from test_interop import (
    Lazy,
    assert_checkpoint_layers_match,
    assert_family_decoding_matches,
    assert_packed_matches,
    assert_round_trip_exact,
    assert_same_params,
    forward,
    hidden,
    numpy_state,
    run_torch,
    torch,
    transformers,
)
from test_interop_families import LENGTHS, modeling, packed

from gdn_jax import KimiDeltaAttention
from gdn_jax.interop import FAMILIES, layer_prefixes, load_layer

KimiLinearDeltaAttention = Lazy(
    "transformers.models.kimi_linear.modeling_kimi_linear", "KimiLinearDeltaAttention"
)
BailingHybridDeltaAttention = Lazy(
    "transformers.models.bailing_hybrid.modeling_bailing_hybrid", "BailingHybridDeltaAttention"
)

IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


@dataclasses.dataclass(frozen=True)
class Case:
    """One family as transformers builds it: how its config names the head shape, and its
    linear-attention layer."""

    config: Lazy  # the class
    layer: Lazy  # the class
    head_keys: tuple[str, str]  # the config fields of the head count and head dim
    extra: dict = dataclasses.field(default_factory=dict)

    def make_config(
        self, layer_types=("linear_attention",), heads=4, head_dim=16, hidden_size=64, **kw
    ):
        count, dim = self.head_keys
        return self.config(
            hidden_size=hidden_size,
            num_hidden_layers=len(layer_types),
            layer_types=list(layer_types),
            **{count: heads, dim: head_dim},
            **{**IDS, **self.extra, **kw},
        )


CASES = {
    "kimi_linear": Case(
        Lazy("transformers", "KimiLinearConfig"),
        modeling("kimi_linear", "KimiLinearDeltaAttention"),
        ("linear_num_heads", "linear_head_dim"),
    ),
    "bailing_hybrid": Case(
        Lazy("transformers", "BailingHybridConfig"),
        modeling("bailing_hybrid", "BailingHybridDeltaAttention"),
        ("num_attention_heads", "head_dim"),
        dict(num_mtp_layers=0),
    ),
    "glm5_next": Case(
        Lazy("transformers", "Glm5NextTextConfig"),
        modeling("glm5_next", "Glm5NextTextLinearAttention"),
        ("linear_num_heads", "linear_head_dim"),
    ),
}
NAMES = list(CASES)


def family_layer(name, seed=0, heads=4, head_dim=16):
    """A random transformers layer of family ``name`` and its config. ``A_log``, ``dt_bias``
    and the norm weight, which transformers' model initialises (the layer alone leaves them
    empty or ones), are drawn."""
    case = CASES[name]
    config = case.make_config(heads=heads, head_dim=head_dim)
    torch.manual_seed(seed)
    layer = case.layer(config, 0).eval()
    with torch.no_grad():
        layer.forget_gate.A_log.uniform_(-1.0, 1.5)
        layer.forget_gate.dt_bias.normal_()
        layer.o_norm.weight.uniform_(0.5, 1.5)
    layer.config = config
    return layer, config


@pytest.mark.parametrize("name", NAMES)
def test_outputs_equal_transformers(name):
    """Each T in LENGTHS alone through transformers, packed into one gdn_jax call."""
    reference, config = family_layer(name)
    layer = load_layer(numpy_state(reference), config.to_dict(), schedule=SCHEDULE)
    assert isinstance(layer, KimiDeltaAttention)
    x, bounds = packed(LENGTHS, seed=len(name))
    assert_packed_matches(layer, reference, x, bounds, name)


def test_real_head_counts_equal_transformers():
    """Kimi-Linear-48B-A3B's heads (32 of dim 128, as Ling-3.0-Flash's; GLM-5.3-Flash has 64)
    at T = 100, a whole chunk of 64 and a part. transformers' fallback costs as much at any
    T up to 128, about 1.5 s at these heads on 2 cores (3 s at 64 heads), so one length of
    one family stands for the rest, which the tester heads cover."""
    name = "kimi_linear"
    reference, config = family_layer(name, heads=32, head_dim=128)
    layer = load_layer(numpy_state(reference), config.to_dict(), schedule=SCHEDULE)
    x = hidden(len(name), 1, 100)
    assert_relative_rms(forward(layer, x), run_torch(reference, x), jnp.float32)


def test_prefill_cache_and_decoding_equal_transformers():
    """The decoding cache is the same in every family, and the layer decodes as it runs in
    parallel whatever its gate (test_layers.py, test_kda_layer.py): one family stands for
    all."""
    name = "kimi_linear"
    family = FAMILIES[name]
    reference, config = family_layer(name, seed=2)
    assert_family_decoding_matches(family, reference, config)


# Bailing-hybrid's attention layers share num_attention_heads with its KDA layers.
MOE = dict(
    vocab_size=96,
    intermediate_size=64,
    moe_intermediate_size=32,
    num_key_value_heads=4,
    num_experts_per_tok=2,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
)
CHECKPOINT_MODELS = {
    "kimi_linear": lambda kinds: transformers.KimiLinearForCausalLM(
        CASES["kimi_linear"].make_config(
            kinds, **MOE, num_attention_heads=4, num_local_experts=4, qk_rope_head_dim=8
        )
    ),
    "bailing_hybrid": lambda kinds: transformers.BailingHybridForCausalLM(
        CASES["bailing_hybrid"].make_config(
            kinds, **MOE, num_local_experts=4, n_group=1, topk_group=1, qk_rope_head_dim=8
        )
    ),
    "glm5_next": lambda kinds: transformers.Glm5NextForConditionalGeneration(
        transformers.Glm5NextConfig(
            text_config=CASES["glm5_next"]
            .make_config(
                kinds,
                **MOE,
                num_attention_heads=4,
                n_routed_experts=4,
                q_lora_rank=16,
                index_topk=32,
                index_head_dim=16,
                index_n_heads=2,
                index_kpool=4,
                hc_mult=2,
                hc_sinkhorn_iters=2,
            )
            .to_dict(),
            vision_config=dict(
                hidden_size=32, depth=1, num_heads=2, intermediate_size=32, out_hidden_size=64
            ),
        )
    ),
}
# The i-th decoder layer's linear attention in each model.
DECODER_LAYERS = {
    "kimi_linear": lambda model, i: model.model.layers[i].self_attn,
    "bailing_hybrid": lambda model, i: model.model.layers[i].self_attn,
    "glm5_next": lambda model, i: model.model.language_model.layers[i].self_attn,
}
CHECKPOINT_PREFIXES = {
    "kimi_linear": "model.layers.{}.self_attn.",
    "bailing_hybrid": "model.layers.{}.attention.",
    "glm5_next": "model.language_model.layers.{}.self_attn.",
}


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_saved_by_transformers(name, tmp_path):
    """load_layer reads every linear-attention layer of a tiny model from the shards
    save_pretrained writes (under the checkpoint's own names: q/k/v_conv1d, f_a_proj at the
    layer's top, Bailing's attention.dense), and each maps that layer's real input to its
    real output."""
    torch.manual_seed(4)
    model = CHECKPOINT_MODELS[name](("linear_attention", "linear_attention", "full_attention"))
    model.eval().save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").exists()

    prefixes = layer_prefixes(model.config.to_dict())
    assert prefixes == {i: CHECKPOINT_PREFIXES[name].format(i) for i in (0, 1)}
    assert_checkpoint_layers_match(model, tmp_path, prefixes, load_layer, DECODER_LAYERS[name])


FAMILY_FORMS = {
    "kimi_linear": dict(),
    "bailing_hybrid": dict(low_rank_gates=False, gate_lower_bound=-5.0),
    "glm5_next": dict(gate_lower_bound=-2.5),
}


def family_form_layer(name, **kw):
    options = dict(output_gate_bias=False, norm_eps=1e-6, **FAMILY_FORMS[name], **kw)
    return KimiDeltaAttention(32, 2, 8, rngs=nnx.Rngs(7), **options)


def layer_config(name, **kw):
    """The transformers config of ``family_form_layer(name)``."""
    bound = dict(linear_lower_bound=-2.5) if name == "glm5_next" else {}
    return CASES[name].make_config(
        heads=2, head_dim=8, hidden_size=32, rms_norm_eps=1e-6, **bound, **kw
    )


@pytest.mark.parametrize("name", NAMES)
def test_round_trips_are_exact(name):
    """gdn_jax -> family -> gdn_jax is bit-exact, the family's tensors load into the
    transformers layer by its own names and shapes, and so does the decoding cache."""
    family, layer, config = FAMILIES[name], family_form_layer(name), layer_config(name)
    back = assert_round_trip_exact(layer, family.export, load_layer, config.to_dict())
    assert back.gate_lower_bound == layer.gate_lower_bound
    assert back.o_norm.epsilon == layer.o_norm.epsilon

    # transformers' layer takes the tensors as they are (strict: every name and shape).
    torch_layer = CASES[name].layer(config, 0)
    torch_layer.load_state_dict({k: torch.from_numpy(v) for k, v in family.export(layer).items()})

    rng = np.random.default_rng(10)
    empty = layer.init_cache(2)
    # device_put: jnp.asarray would compile a conversion for each shape.
    cache = jax.tree.map(
        lambda z: jax.device_put(rng.standard_normal(z.shape).astype(z.dtype)), empty
    )
    cache_back = family.cache_to_gdn_jax(*family.cache_from_gdn_jax(cache))
    for a, b in zip(cache_back.conv, cache.conv, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(cache_back.state, cache.state)


# --- config.json conventions, read as transformers' config classes read them -------------


def test_config_json_fields_read_as_transformers_reads_them():
    """A config.json names fields otherwise than the loaded config's to_dict(); both give
    the same layer and prefixes, and transformers' config class agrees."""
    kimi = dict(
        model_type="kimi_linear",
        hidden_size=64,
        num_hidden_layers=6,
        rms_norm_eps=1e-5,
        linear_attn_config=dict(
            full_attn_layers=[3, 6],
            kda_layers=[1, 2, 4, 5],
            num_heads=4,
            head_dim=16,
            short_conv_kernel_size=4,
        ),
    )
    glm = dict(
        model_type="glm5_next",
        hidden_size=64,
        num_hidden_layers=5,
        rms_norm_eps=1e-5,
        linear_attn_config=dict(
            num_heads=4,
            head_dim=16,
            short_conv_kernel_size=4,
            gate_lower_bound=None,
            safe_gate=False,
        ),
    )
    bailing = dict(
        model_type="bailing_hybrid",
        hidden_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        head_dim=16,
        short_conv_kernel_size=3,
        layer_group_size=3,
        kda_safe_gate=False,
        rms_norm_eps=1e-6,
    )

    def fields(raw):
        return {k: v for k, v in raw.items() if k != "model_type"}

    loaded = {
        "kimi_linear": transformers.KimiLinearConfig(**IDS, **fields(kimi)),
        "glm5_next": transformers.Glm5NextConfig(**fields(glm)),
        "bailing_hybrid": transformers.BailingHybridConfig(**IDS, **fields(bailing)),
    }
    for name, raw in [("kimi_linear", kimi), ("glm5_next", glm), ("bailing_hybrid", bailing)]:
        family, as_loaded = FAMILIES[name], loaded[name].to_dict()
        assert family.layer_kwargs(raw) == family.layer_kwargs(as_loaded), name
        assert layer_prefixes(raw) == layer_prefixes(as_loaded), name
    assert sorted(layer_prefixes(kimi)) == [0, 1, 3, 4]
    assert FAMILIES["glm5_next"].layer_kwargs(glm)["gate_lower_bound"] is None
    assert layer_prefixes(glm) == {
        i: f"model.language_model.layers.{i}.self_attn." for i in (0, 1, 2, 4)
    }
    bailing_kwargs = FAMILIES["bailing_hybrid"].layer_kwargs(bailing)
    assert (bailing_kwargs["conv_size"], bailing_kwargs["gate_lower_bound"]) == (3, None)
    assert sorted(layer_prefixes(bailing)) == [0, 1, 3, 4]
    # Without the safe gate's switch, GLM-5 Next bounds at -5 as its config class does.
    del glm["linear_attn_config"]["safe_gate"]
    assert FAMILIES["glm5_next"].layer_kwargs(glm)["gate_lower_bound"] == -5.0
    assert transformers.Glm5NextConfig(**fields(glm)).text_config.linear_lower_bound == -5.0


# --- malformed input: one ValueError naming the tensor or argument, nothing built ---------


def test_missing_extra_and_misshapen_tensors_are_named():
    reference, config = family_layer("kimi_linear")
    weights, config = numpy_state(reference), config.to_dict()
    del weights["forget_gate.A_log"]
    with pytest.raises(
        ValueError,
        match=r"load_kimi_linear_layer: missing tensor 'forget_gate.A_log' "
        r"\(expected shape \(1, 1, 4, 1\)\)",
    ):
        load_layer(weights, config)
    weights = numpy_state(reference)
    with pytest.raises(ValueError, match=r"unexpected tensor 'g_b_proj.bias' \(shape \(64,\)\)"):
        load_layer({**weights, "g_b_proj.bias": np.zeros(64, np.float32)}, config)
    short = {**weights, "forget_gate.dt_bias": weights["forget_gate.dt_bias"][:60]}
    with pytest.raises(
        ValueError, match=r"'forget_gate.dt_bias' has shape \(60,\), the config needs \(64,\)"
    ):
        load_layer(short, config)
    # A checkpoint's names: the convolution in parts, the forget gate at the layer's top.
    stored = {k.removeprefix("forget_gate."): v for k, v in weights.items()}
    q, k, v = np.split(stored.pop("conv1d.weight"), 3)
    stored.update({"q_conv1d.weight": q, "k_conv1d.weight": k, "v_conv1d.weight": v})
    assert_same_params(load_layer(stored, config), load_layer(weights, config))
    del stored["k_conv1d.weight"]
    with pytest.raises(ValueError, match=r"missing tensor 'conv1d.weight'.*unexpected tensor 'q_"):
        load_layer(stored, config)


def test_family_configs_are_checked():
    glm = layer_config("glm5_next").to_dict()
    kimi = layer_config("kimi_linear").to_dict()
    with pytest.raises(ValueError, match=r"config linear_lower_bound=0.0 must be a finite neg"):
        FAMILIES["glm5_next"].layer_kwargs({**glm, "linear_lower_bound": 0.0})
    with pytest.raises(ValueError, match=r"config kda_safe_gate must be a bool, got 'yes'"):
        FAMILIES["bailing_hybrid"].layer_kwargs(
            {**layer_config("bailing_hybrid").to_dict(), "kda_safe_gate": "yes"}
        )
    with pytest.raises(ValueError, match=r"config hidden_act='gelu'; the layer uses silu"):
        FAMILIES["kimi_linear"].layer_kwargs({**kimi, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match=r"load_kimi_linear_layer: config lacks linear_head_dim"):
        load_layer({}, {k: v for k, v in kimi.items() if k != "linear_head_dim"})
    with pytest.raises(ValueError, match=r"config linear_num_heads=0 must be a positive integer"):
        load_layer({}, {**kimi, "linear_num_heads": 0})
    bad_layers = dict(model_type="kimi_linear", num_hidden_layers=2)
    bad_layers["linear_attn_config"] = dict(full_attn_layers=[2], kda_layers=[0])
    with pytest.raises(
        ValueError, match=r"linear_attn_config.kda_layers must list layers 1 to num_hidden_la"
    ):
        layer_prefixes(bad_layers)
    with pytest.raises(ValueError, match=r"load_layer: config model_type='llama' .*kimi_linear"):
        load_layer({}, {"model_type": "llama"})


def test_layers_a_family_cannot_hold_are_refused():
    fla_layer = KimiDeltaAttention(32, 2, 8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"export_kimi_linear_layer: Kimi-Linear's output gate"):
        FAMILIES["kimi_linear"].export(fla_layer)
    with pytest.raises(ValueError, match=r"one head count and one head dim for q, k and v"):
        FAMILIES["glm5_next"].export(family_form_layer("glm5_next", num_v_heads=4))
    with pytest.raises(ValueError, match=r"Bailing-hybrid's gates are full projections"):
        FAMILIES["bailing_hybrid"].export(family_form_layer("kimi_linear"))
    with pytest.raises(ValueError, match=r"Kimi-Linear's forget gate has no lower bound"):
        FAMILIES["kimi_linear"].export(family_form_layer("glm5_next"))
    with pytest.raises(ValueError, match=r"GLM-5 Next's beta lies in \(0, 1\)"):
        FAMILIES["glm5_next"].export(family_form_layer("glm5_next", allow_neg_eigval=True))
    with pytest.raises(ValueError, match=r"must be a KimiDeltaAttention, got GatedDeltaNet"):
        from gdn_jax import GatedDeltaNet

        FAMILIES["glm5_next"].export(GatedDeltaNet(32, 2, 8, rngs=nnx.Rngs(0)))


def test_parameter_count_matches_the_transformers_layers():
    """Kimi-Linear's layer is fla's (tests/layers/test_kda_layer.py counts fla's) without the
    output gate's bias; Bailing-hybrid's has full-rank gates."""
    common = dict(hidden_size=64, num_hidden_layers=1, layer_types=["linear_attention"])
    common.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kimi = KimiLinearDeltaAttention(
        transformers.KimiLinearConfig(**common, linear_num_heads=4, linear_head_dim=16), 0
    )
    bailing = BailingHybridDeltaAttention(
        transformers.BailingHybridConfig(**common, num_attention_heads=4, head_dim=16), 0
    )

    def torch_count(module):
        return sum(p.numel() for p in module.parameters())

    def ours(**kw):
        return parameter_count(
            nnx.eval_shape(lambda: KimiDeltaAttention(64, 4, 16, rngs=nnx.Rngs(0), **kw))
        )

    assert ours(output_gate_bias=False) == torch_count(kimi) == ours() - 4 * 16
    assert ours(low_rank_gates=False, output_gate_bias=False) == torch_count(bailing)
