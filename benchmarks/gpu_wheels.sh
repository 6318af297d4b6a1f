#!/usr/bin/env bash
# Downloads, on a machine with network, the wheels that benchmarks/gpu_check.py and the GPU test
# run need on a GPU host that has none: the two peers (flash-linear-attention's fla-core and
# jax-linear-attention), beartype (the test suite's shape checks) and flax (used there only
# where the host's own is older than gdn_jax's floor). Everything else they need (torch,
# triton, einops, equinox, optax, safetensors, numpy) is on the H200 image.
#
#     bash benchmarks/gpu_wheels.sh            # into .whl/ (git-ignored)
#     bash benchmarks/gpu_wheels.sh DIR
#
# The wheels are for CPython 3.12 on x86-64 Linux, the GPU image's interpreter, whatever this
# machine runs. On the GPU host, benchmarks/gpu_run.sh installs them with --no-deps into a
# folder of their own, so the image's jax, torch and triton stay as they are.
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.whl}"
mkdir -p "$dest"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dest" \
    fla-core==0.6.0 jax-linear-attention==0.1.0 beartype==0.23.1 flax==0.12.12
ls -1 "$dest"
