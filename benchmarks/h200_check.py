"""The accelerator check: the op and the MQAR train step timed on whatever JAX runs on here.

    python benchmarks/h200_check.py                 # on a GPU host: installs, then times
    python benchmarks/h200_check.py --smoke --no-install   # tiny sizes, e.g. on a CPU

Prepared for an NVIDIA H200 (its image: Python 3.12, jax with the CUDA plugin, flax, optax,
chex, orbax; no network), in under 5 minutes: installs this checkout with
``pip install --no-deps --no-build-isolation -e .`` (falling back to importing it from here
when that fails), then prints the wall time (best of ``--repeats`` after a warm-up call) and
compile time of

- ``gated_delta_rule`` forward and forward+backward (``jax.grad`` of ``sum(y)`` over every
  input), both schedules, bfloat16 q, k, v with float32 gates and state, at B=4, T=4096 and
  at B=1, T=32768 (H=16, K=V=128, C=64);
- one MQAR training step of ``configs/mqar_gdn.yaml`` (``jit_steps``, as ``train.py``).

Nothing else depends on it. ``--smoke`` shrinks everything to seconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNTIME_DEPENDENCIES = ("jax", "flax", "optax", "orbax", "jaxtyping", "yaml", "tqdm", "numpy")
# (B, T) at H=16, K=V=128, C=64: the shapes, and tiny ones for --smoke.
OP_SHAPES = {False: [(4, 4096), (1, 32768)], True: [(1, 256)]}
SMOKE_HEADS, SMOKE_DIM = 2, 32
SMOKE_RUN = [
    "model.vocab_size=128", "data.vocab_size=128", "model.d_model=32", "model.mixers=[gdn]",
    "data.seq_len=64", "data.num_kv_pairs=4", "train.batch_size=4",
]  # fmt: skip


def install() -> None:
    """``pip install --no-deps --no-build-isolation -e .``; the checkout is importable from
    here either way (``sys.path``), so a failure is reported, not fatal."""
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation"]
    result = subprocess.run(
        [*command, "-q", "-e", str(REPO)], capture_output=True, text=True, check=False
    )
    if result.returncode == 0:
        print("pip install --no-deps -e .: ok")
        return
    lines = [line.strip() for line in result.stderr.splitlines()]
    reason = next((line for line in lines if line.startswith("error:")), lines[-1:])
    print(f"pip install --no-deps -e . failed ({reason}); importing gdn_jax from {REPO}")


def timed(fn, args, repeats):
    """``(compile s, best run ms)`` of jitted ``fn`` on ``args``."""
    import jax

    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - start
    jax.block_until_ready(compiled(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        best = min(best, time.perf_counter() - start)
    return compile_s, 1e3 * best


def op_times(batch, seq_len, heads, dim, repeats):
    import jax
    import jax.numpy as jnp

    import gdn_jax

    keys = jax.random.split(jax.random.key(0), 5)
    q, k, v = (
        jax.random.normal(key, (batch, seq_len, heads, dim), jnp.bfloat16) for key in keys[:3]
    )
    k = k / jnp.linalg.norm(k.astype(jnp.float32), axis=-1, keepdims=True).astype(k.dtype)
    log_alpha = -jax.nn.softplus(jax.random.normal(keys[3], (batch, seq_len, heads)))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (batch, seq_len, heads)))
    args = (q, k, v, log_alpha, beta)
    for schedule in ("hoisted", "in_scan"):

        def forward(*args, schedule=schedule):
            return gdn_jax.gated_delta_rule(*args, chunk_size=64, schedule=schedule)[0]

        def loss(*args, forward=forward):
            return jnp.sum(forward(*args).astype(jnp.float32))

        for name, fn in (("fwd", forward), ("fwd+bwd", jax.grad(loss, argnums=range(5)))):
            compile_s, ms = timed(fn, args, repeats)
            print(
                f"op B={batch} T={seq_len} H={heads} K=V={dim} {schedule:<8} {name:<8} "
                f"{ms:9.2f} ms  (compile {compile_s:.1f} s)",
                flush=True,
            )


def train_step_time(smoke, repeats):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from gdn_jax.data.mqar import make_batch, make_mqar
    from gdn_jax.models import LanguageModel
    from gdn_jax.training import mesh as mesh_lib
    from gdn_jax.training.config import load_config
    from gdn_jax.training.optim import make_optimizer
    from gdn_jax.training.state import jit_steps
    from gdn_jax.training.step import TrainState

    config = load_config(REPO / "gdn_jax" / "configs" / "mqar_gdn.yaml", SMOKE_RUN if smoke else [])
    mesh = mesh_lib.check_mesh(config, jax.devices())
    _, params = nnx.split(LanguageModel(config.model, rngs=nnx.Rngs(0)))
    optimizer = make_optimizer(config.train, params)
    steps = jit_steps(config, mesh)
    pure = nnx.to_pure_dict(params)
    state = jax.device_put(
        TrainState(jnp.zeros((), jnp.int32), pure, optimizer.init(pure)), steps.state_shardings
    )
    examples = make_mqar(config.data, num_examples=config.train.batch_size, seed=0)
    batch = mesh_lib.place(make_batch(*examples), steps.batch_shardings)
    with jax.set_mesh(mesh):
        start = time.perf_counter()
        state, metrics = steps.train_step(state, batch)  # compiles
        jax.block_until_ready(metrics)
        first_s = time.perf_counter() - start
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            state, metrics = steps.train_step(state, batch)
            jax.block_until_ready(metrics)
            best = min(best, time.perf_counter() - start)
    print(
        f"MQAR train step ({config.train.batch_size} x {config.data.seq_len} tokens, "
        f"{len(jax.devices())} device(s)): {1e3 * best:.2f} ms (first call, compile included, "
        f"{first_s:.1f} s; loss {float(metrics['loss']):.3f})",
        flush=True,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: a check that it runs")
    parser.add_argument("--no-install", action="store_true", help="skip the pip install")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    began = time.perf_counter()
    if not args.no_install:
        install()
    sys.path.insert(0, str(REPO))
    missing = [name for name in RUNTIME_DEPENDENCIES if importlib.util.find_spec(name) is None]
    if missing:
        sys.exit(f"missing, and not installed by this check: {', '.join(missing)}")

    import jax

    import gdn_jax

    device = jax.devices()[0]
    print(
        f"jax {jax.__version__} on {len(jax.devices())} x {device.device_kind} "
        f"({jax.default_backend()}); gdn_jax from {Path(gdn_jax.__file__).parent}"
    )
    heads, dim = (SMOKE_HEADS, SMOKE_DIM) if args.smoke else (16, 128)
    for batch, seq_len in OP_SHAPES[args.smoke]:
        op_times(batch, seq_len, heads, dim, args.repeats)
    train_step_time(args.smoke, args.repeats)
    print(f"done in {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
