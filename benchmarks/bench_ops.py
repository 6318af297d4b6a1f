"""Time and memory of the recurrent and chunked gated delta rule.

    python benchmarks/bench_ops.py                       # the table in docs/benchmarks.md
    python benchmarks/bench_ops.py --seq-lens 4096 --chunk-sizes 16 32 64 128

For each impl and T at B=1, H=8, K=V=128, float32 it prints the forward and forward+backward
wall time (best of --repeats after a warm-up call), the compiled programs' temp memory
(``memory_analysis().temp_size_in_bytes``), and for the chunked forward its achieved
GFLOP/s next to a 2048^3 matmul timed in the same run. Ratios within one run are what to
compare: these machines are noisy from run to run.
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import gdn_jax

BATCH, HEADS, KEY, VALUE = 1, 8, 128, 128


def best_ms(fn, args, repeats):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def temp_mb(jitted, args):
    return jitted.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20


def chunked_forward_flops(seq_len, chunk):
    """Matmul flops of the chunked forward: per chunk and head, k k^T and q k^T (2 C^2 K
    each), k S^T, q S^T and U^T k (2 C K V each), inverse (~2 C^3 / 3), T rhs and attn U
    (2 C^2 V each)."""
    num_chunks = -(-seq_len // chunk)
    per_chunk = 4 * chunk**2 * KEY + 6 * chunk * KEY * VALUE + 4 * chunk**2 * VALUE
    per_chunk += 2 * chunk**3 // 3
    return BATCH * HEADS * num_chunks * per_chunk


def inputs(seq_len):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((BATCH, seq_len, HEADS, KEY))
    k = rng.standard_normal((BATCH, seq_len, HEADS, KEY))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((BATCH, seq_len, HEADS, VALUE))
    log_alpha = rng.uniform(-0.5, -0.01, (BATCH, seq_len, HEADS))
    beta = rng.uniform(0.0, 1.0, (BATCH, seq_len, HEADS))
    return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v, log_alpha, beta))


def programs(impl, chunk):
    def forward(*args):
        return gdn_jax.gated_delta_rule(*args, impl=impl, chunk_size=chunk)[0]

    def loss(*args):
        return jnp.sum(forward(*args) ** 2)

    return jax.jit(forward), jax.jit(jax.grad(loss, argnums=range(5)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--max-temp-gb",
        type=float,
        default=12.0,
        help="compile but do not run programs whose temp memory exceeds this",
    )
    args = parser.parse_args()

    size = 2048
    a = jnp.asarray(np.random.default_rng(1).standard_normal((size, size)), jnp.float32)
    matmul_ms = best_ms(jax.jit(lambda x: x @ x), (a,), args.repeats)
    matmul_gflops = 2 * size**3 / matmul_ms / 1e6
    print(
        f"# {platform.processor() or platform.machine()}, {jax.devices()[0].device_kind}, "
        f"jax {jax.__version__}; B={BATCH} H={HEADS} K={KEY} V={VALUE} float32"
    )
    print(f"# reference: {size}^3 matmul {matmul_ms:.1f} ms = {matmul_gflops:.1f} GFLOP/s\n")
    print(
        "| impl | C | T | fwd ms | fwd+bwd ms | fwd temp MB | fwd+bwd temp MB | fwd GFLOP/s (% of matmul) |"
    )
    print("|---|---|---|---|---|---|---|---|")

    runs = [("recurrent", 64)] + [("chunked", c) for c in args.chunk_sizes]
    for seq_len in args.seq_lens:
        data = inputs(seq_len)
        for impl, chunk in runs:
            forward, grad = programs(impl, chunk)
            fwd_mb, grad_mb = temp_mb(forward, data), temp_mb(grad, data)
            fwd_ms = best_ms(forward, data, args.repeats)
            if grad_mb / 1024 <= args.max_temp_gb:
                grad_ms = f"{best_ms(grad, data, max(1, args.repeats - 1)):.0f}"
            else:
                grad_ms = f"not run (> {args.max_temp_gb:g} GB)"
            rate = "-"
            if impl == "chunked":
                gflops = chunked_forward_flops(seq_len, chunk) / fwd_ms / 1e6
                rate = f"{gflops:.1f} ({100 * gflops / matmul_gflops:.0f}%)"
            label_c = chunk if impl == "chunked" else "-"
            print(
                f"| {impl} | {label_c} | {seq_len} | {fwd_ms:.1f} | {grad_ms} | "
                f"{fwd_mb:.1f} | {grad_mb:.1f} | {rate} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
