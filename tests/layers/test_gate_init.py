"""The decay gates' initial laws (``layers.GateInit``): flash-linear-attention's by default,
the given ranges when set, on the layer or through ``ModelConfig``; a bad law is refused at
build, naming the field."""

import dataclasses

import numpy as np
import pytest
from flax import nnx

from gdn_jax.layers import (
    CHANNEL_DECAY,
    HEAD_DECAY,
    DeltaNet,
    GatedDeltaNet,
    GatedDeltaNet2,
    GatedDeltaProduct,
    GateInit,
    KimiDeltaAttention,
    LinearAttention,
    SimpleGatedLinearAttention,
)
from gdn_jax.models import LanguageModel
from gdn_jax.training.config import load_config, to_dict

HEAD = [GatedDeltaNet, SimpleGatedLinearAttention, GatedDeltaProduct]  # one decay per head
CHANNEL = [KimiDeltaAttention, GatedDeltaNet2]  # one per key channel
# Wide enough that every draw of a law lands near both ends of its range.
WIDTH, HEADS, HEAD_DIM = 64, 16, 4


def drawn(layer):
    """``(A, dt)`` of a layer as drawn: ``exp(A_log)`` and ``softplus(dt_bias)``."""
    a = np.exp(np.asarray(layer.A_log[...], np.float64))
    dt = np.log1p(np.exp(np.asarray(layer.dt_bias[...], np.float64)))
    return a, dt


def assert_drawn_from(layer, law):
    a, dt = drawn(layer)
    # float32 parameters; U(0, .) is floored at 1e-4 before its log (params.a_log_init).
    assert np.all((a >= max(law.a_min, 1e-4) * (1 - 1e-6)) & (a <= law.a_max * (1 + 1e-6))), a
    low = max(law.dt_min, law.dt_floor)
    assert np.all((dt >= low * (1 - 1e-5)) & (dt <= law.dt_max * (1 + 1e-5))), dt
    assert len(set(np.round(a, 4))) > 1 and len(set(np.round(dt, 7))) > 1  # drawn, spread


def build(cls, **kwargs):
    return cls(WIDTH, HEADS, HEAD_DIM, rngs=nnx.Rngs(0), **kwargs)


@pytest.mark.parametrize("cls", HEAD + CHANNEL, ids=lambda c: c.__name__)
def test_defaults_are_flash_linear_attentions_laws(cls):
    assert_drawn_from(build(cls), HEAD_DECAY if cls in HEAD else CHANNEL_DECAY)
    assert (HEAD_DECAY.a_min, CHANNEL_DECAY.a_min, HEAD_DECAY.a_max) == (0.0, 1.0, 16.0)
    assert (HEAD_DECAY.dt_min, HEAD_DECAY.dt_max, HEAD_DECAY.dt_floor) == (1e-3, 0.1, 1e-4)


@pytest.mark.parametrize("cls", HEAD + CHANNEL, ids=lambda c: c.__name__)
def test_a_given_law_is_drawn_from_and_unset_fields_keep_the_default(cls):
    given = GateInit(a_min=0.5, a_max=2.0, dt_min=1e-4, dt_max=1e-3)
    layer = build(cls, gate_init=given)
    default = HEAD_DECAY if cls in HEAD else CHANNEL_DECAY
    assert_drawn_from(layer, dataclasses.replace(given, dt_floor=default.dt_floor))
    # The floor clamps draws below it.
    floored = build(cls, gate_init=GateInit(dt_min=1e-6, dt_max=1e-5, dt_floor=3e-6))
    assert np.min(drawn(floored)[1]) == pytest.approx(3e-6, rel=1e-4)


@pytest.mark.parametrize(
    "law, message",
    [
        (GateInit(dt_min=0.5), r"gate_init=GateInit\(.*dt_min=0.5.*\) needs 0 < dt_min <= dt_max"),
        (GateInit(dt_min=0.0), r"needs 0 < dt_min <= dt_max"),
        (GateInit(a_min=-1.0), r"needs 0 <= a_min <= a_max"),
        (GateInit(a_max=0.5), r"needs 0 <= a_min <= a_max"),  # below the default a_min 1
        (GateInit(dt_floor=0.0), r"needs dt_floor > 0"),
        (GateInit(dt_max=float("inf")), r"gate_init.dt_max=inf must be a finite number"),
        (GateInit(a_min="1"), r"gate_init.a_min='1' must be a finite number"),
    ],
)
def test_a_bad_law_is_refused_naming_the_layer_and_field(law, message):
    with pytest.raises(ValueError, match=rf"KimiDeltaAttention: .*{message}"):
        build(KimiDeltaAttention, gate_init=law)


@pytest.mark.parametrize("cls", [DeltaNet, LinearAttention], ids=lambda c: c.__name__)
def test_a_mixer_without_a_decay_gate_refuses_a_law(cls):
    with pytest.raises(ValueError, match=rf"{cls.__name__}: gate_init=.* does not have"):
        build(cls, gate_init=GateInit(dt_min=1e-4))
    with pytest.raises(ValueError, match=r"GatedDeltaProduct: gate_init=.*use_forget_gate=False"):
        build(GatedDeltaProduct, use_forget_gate=False, gate_init=GateInit(dt_min=1e-4))


def test_model_config_sets_each_kind_of_decay_and_keeps_earlier_keys():
    overrides = [
        "model.mixers=[gdn, kda, simple_gla, gdn2, gated_deltaproduct, deltanet]",
        "model.head_gate_init.dt_min=1e-4", "model.head_gate_init.dt_max=1e-3",
        "model.channel_gate_init.a_min=0.0",
    ]  # fmt: skip
    config = load_config(None, overrides)
    model = LanguageModel(dataclasses.replace(config.model, d_model=WIDTH), rngs=nnx.Rngs(0))
    head = dataclasses.replace(HEAD_DECAY, dt_min=1e-4, dt_max=1e-3)
    channel = dataclasses.replace(CHANNEL_DECAY, a_min=0.0)
    for block, law in zip(model.blocks, (head, channel, head, channel, head), strict=False):
        assert_drawn_from(block.mixer, law)
    # A config that sets no law resolves to what it did before the fields existed (the keys
    # of earlier runs and sweep cells); one that sets a law records it.
    assert not {"head_gate_init", "mixer_init_std"} & set(to_dict(load_config(None, []))["model"])
    recorded = to_dict(config)["model"]
    assert recorded["head_gate_init"]["dt_min"] == 1e-4 and "channel_gate_init" in recorded
    assert load_config(None, overrides).model == config.model
