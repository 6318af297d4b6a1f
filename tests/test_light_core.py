"""The core installs and imports light: what training, plotting, file reading and TPU
compiling need are extras, loaded only where they are used.

Flax itself requires optax, orbax-checkpoint and PyYAML, and ``from flax import nnx``
imports optax and yaml; so the layers cannot load less than Flax does, and the checks on them
are against what Flax alone loads.
"""

import importlib.metadata
import json
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

CORE = {"jax", "jaxlib", "jaxtyping", "numpy", "flax"}
# (Not libtpu: JAX itself imports it where it is installed.)
TRAINING = {"optax", "orbax", "yaml", "tqdm", "matplotlib", "safetensors", "torch"}
EXTRAS = {"train", "interop", "tpu-compile", "gpu-compile", "docs", "test-core", "test"}

# One interpreter, three stages: the top-level package and its ops; Flax alone; the layers,
# the models, the loaders and a lazily loaded layer name.
PROBE = """
import json, sys
def loaded():
    return sorted({name.split(".")[0] for name in sys.modules} | {
        name for name in sys.modules if name.startswith("gdn_jax.")})
import gdn_jax, gdn_jax.ops
ops = loaded()
from flax import nnx
flax_alone = loaded()
import gdn_jax.interop, gdn_jax.layers, gdn_jax.models
gdn_jax.GatedDeltaNet, gdn_jax.LanguageModel
print(json.dumps(dict(ops=ops, flax=flax_alone, layers=loaded())))
"""


def test_the_core_requires_only_jax_flax_numpy_and_jaxtyping():
    requirements = [Requirement(text) for text in importlib.metadata.requires("gdn_jax")]
    core = {r.name.lower() for r in requirements if r.marker is None}
    assert core == CORE
    extras = set(importlib.metadata.metadata("gdn_jax").get_all("Provides-Extra"))
    assert extras == EXTRAS
    train = {r.name for r in requirements if r.marker and r.marker.evaluate({"extra": "train"})}
    assert {"optax", "orbax-checkpoint", "pyyaml", "tqdm", "matplotlib"} <= train


@pytest.mark.costly(6)
def test_importing_ops_layers_and_models_loads_nothing_of_training():
    env = {"JAX_PLATFORMS": "cpu", "PATH": ""}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True
    )
    stages = json.loads(out.stdout)
    ops = set(stages["ops"])
    assert not ops & (TRAINING | {"flax"}), sorted(ops & (TRAINING | {"flax"}))
    # gdn_jax.platforms: stdlib and JAX alone, it keeps JAX off accelerators the host lacks.
    light = ("gdn_jax.ops", "gdn_jax.platforms")
    assert all(name.startswith(light) for name in ops if name.startswith("gdn_jax."))
    beyond_flax = set(stages["layers"]) - set(stages["flax"])
    assert not beyond_flax & TRAINING, sorted(beyond_flax & TRAINING)
    ours = {name.split(".")[1] for name in stages["layers"] if name.startswith("gdn_jax.")}
    assert ours == {"ops", "platforms", "layers", "models", "interop"}
