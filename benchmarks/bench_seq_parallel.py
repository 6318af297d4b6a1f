"""Cost and reach of the sequence-parallel gated delta rule.

    python benchmarks/bench_seq_parallel.py                  # both tables in docs/parallel.md
    python benchmarks/bench_seq_parallel.py --repeats 9 --budget-gib 16

1. Overhead on one device: ``gated_delta_rule_seq_parallel`` on a one-device mesh against
   ``gated_delta_rule`` (chunked), forward and forward+backward (gradient of ``sum(y ** 2)``
   with respect to every input), median of ``--repeats`` interleaved runs after a warm-up.
   Ratios within one run are the figures to read; these machines are shared and noisy.
2. Reach: the largest T (doubling from 1024) whose forward+backward fits ``--budget-gib`` of
   temporary memory per device, by the compiler's memory analysis (programs are compiled,
   not run): on one device, and split over 8 sequence shards (8 virtual CPU devices).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from gdn_jax import gated_delta_rule  # noqa: E402
from gdn_jax.ops import gated_delta_rule_seq_parallel  # noqa: E402

B, H, K, V = 1, 8, 128, 128


def inputs(seq_len, abstract=False):
    shapes = [(B, seq_len, H, K), (B, seq_len, H, K), (B, seq_len, H, V), (B, seq_len, H)]
    shapes.append((B, seq_len, H))
    if abstract:
        return [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes[:3])
    log_alpha = jnp.asarray(-rng.uniform(0, 0.1, shapes[3]), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, shapes[4]), jnp.float32)
    return [q, k, v, log_alpha, beta]


def plain(*args):
    return gated_delta_rule(*args, chunk_size=64, use_qk_l2norm=True)[0]


def parallel(mesh):
    def run(*args):
        return gated_delta_rule_seq_parallel(*args, mesh=mesh, chunk_size=64, use_qk_l2norm=True)[0]

    return run


def with_grad(fn):
    return jax.grad(lambda *args: jnp.sum(fn(*args) ** 2), argnums=(0, 1, 2, 3, 4))


def overhead(seq_len, repeats):
    one = Mesh(np.asarray(jax.devices()[:1]), ("seq",))
    args = inputs(seq_len)
    programs = {
        "forward": (jax.jit(plain), jax.jit(parallel(one))),
        "forward+backward": (jax.jit(with_grad(plain)), jax.jit(with_grad(parallel(one)))),
    }
    print(f"## Overhead on one device: T={seq_len}, B={B}, H=HV={H}, K={K}, V={V}, chunk 64")
    print("| pass | gated_delta_rule | seq-parallel, 1 shard | ratio |\n|---|---|---|---|")
    for name, (base, split) in programs.items():
        jax.block_until_ready((base(*args), split(*args)))
        times = {base: [], split: []}
        for _ in range(repeats):
            for fn in (base, split):
                start = time.perf_counter()
                jax.block_until_ready(fn(*args))
                times[fn].append(1e3 * (time.perf_counter() - start))
        a, b = statistics.median(times[base]), statistics.median(times[split])
        print(f"| {name} | {a:.1f} ms | {b:.1f} ms | {b / a:.2f} |")


def temp_gib(fn, seq_len, shardings=None):
    jitted = jax.jit(fn) if shardings is None else jax.jit(fn, in_shardings=shardings)
    compiled = jitted.lower(*inputs(seq_len, abstract=True)).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**30


def reach(budget):
    mesh = Mesh(np.asarray(jax.devices()), ("seq",))
    tokens = NamedSharding(mesh, P(None, "seq"))
    cases = {
        "one device": (with_grad(plain), None),
        "8 sequence shards": (with_grad(parallel(mesh)), (tokens,) * 5),
    }
    print(f"\n## Reach: largest T whose forward+backward fits {budget} GiB of temp memory")
    print("| | largest T | temp GiB per device there | at 2T |\n|---|---|---|---|")
    for name, (fn, shardings) in cases.items():
        seq_len, fits = 1024, None
        while True:
            used = temp_gib(fn, seq_len, shardings)
            if used > budget:
                break
            fits = (seq_len, used)
            seq_len *= 2
        print(f"| {name} | {fits[0]} | {fits[1]:.2f} | {used:.2f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--budget-gib", type=float, default=16.0)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {len(jax.devices())} devices")
    overhead(args.seq_len, args.repeats)
    reach(args.budget_gib)


if __name__ == "__main__":
    main()
