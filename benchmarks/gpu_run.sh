#!/usr/bin/env bash
# On a GPU host without network (the H200 image: Python 3.12, jax 0.11.2 with CUDA, torch, and
# the triton that fla's kernels need): installs the wheels that benchmarks/gpu_wheels.sh
# downloaded into .whl/ beside the image's packages (never over its jax, torch or triton), runs
# benchmarks/gpu_check.py, then the op, layer and model tests on the GPU. Everything it writes
# goes to OUT, at most eight files, as many as a lent GPU sends back: gpu_check.json, .md and
# .log (nvidia-smi's report first), xla_autotune.textproto (XLA's autotune results of the
# timed programs, for gpu_compile_report.py --autotune-results), profile/gpu_check.json and
# .md, pytest_gpu.xml and .log.
#
#     bash benchmarks/gpu_run.sh OUT [check budget s, default 300] [test limit s, default 180]
#
# TRAIN_LIMIT (seconds after the budget for the training items, default 150; with
# --skip-training, what an item started before the budget may run past it), CHECK_ARGS (more
# arguments for gpu_check.py, such as --item) and TESTS (the test paths, default the op, layer
# and model tests; a test limit of 0 runs none) narrow a run. PROFILE_ARGS (gpu_check.py
# arguments, such as --item) adds a second, profiled pass of those items after the first
# (OUT/profile/), in its own process, so that a profiler that fails costs nothing the first
# pass measured; it loads the first pass's autotune results rather than tuning the same programs
# again. PROFILE_LIMIT (seconds, default 150) bounds it.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: gpu_run.sh OUT [check budget s] [test limit s]}"
budget="${2:-300}"
test_limit="${3:-180}"
mkdir -p "$out"
autotune="$(cd "$out" && pwd)/xla_autotune.textproto"
site=/tmp/gdn_jax_site
wheels=(.whl/fla_core-*.whl .whl/jax_linear_attention-*.whl .whl/beartype-*.whl)
# The image's flax is used where it is at least gdn_jax's floor; otherwise the carried one.
if ! python3 -c "import flax, sys; sys.exit(tuple(map(int, flax.__version__.split('.')[:3])) < (0, 12, 8))"; then
    wheels+=(.whl/flax-*.whl)
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    "${wheels[@]}" || exit 1
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1
# JAX takes memory as it needs it, so that torch (fla) has the rest of the card.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi > "$out/gpu_check.log" 2>&1
began=$SECONDS
timeout -k 10 $((budget + ${TRAIN_LIMIT:-150})) python3 benchmarks/gpu_check.py --out "$out" --budget "$budget" \
    --autotune-to "$autotune" ${CHECK_ARGS:-} 2>&1 | tee -a "$out/gpu_check.log"
echo "gpu_check: exit ${PIPESTATUS[0]} after $((SECONDS - began)) s"
if [ -n "${PROFILE_ARGS:-}" ]; then
    began=$SECONDS
    tuned="${XLA_FLAGS:-}"
    if [ -s "$autotune" ]; then
        tuned+=" --xla_gpu_load_autotune_results_from=$autotune"
    fi
    # Its log goes to the terminal only, and it writes no autotune file: eight files come back.
    XLA_FLAGS="$tuned" timeout -k 10 "${PROFILE_LIMIT:-150}" python3 benchmarks/gpu_check.py \
        --out "$out/profile" --profile --skip-training --repeats 3 ${PROFILE_ARGS} 2>&1 | tail -n 30
    echo "gpu_check --profile: exit ${PIPESTATUS[0]} after $((SECONDS - began)) s"
fi
if [ "$test_limit" -le 0 ]; then
    exit 0
fi
began=$SECONDS
GDN_TEST_PLATFORMS=cuda timeout -s INT -k 20 "$test_limit" python3 -m pytest -n 12 -rfE \
    --tb=short -p no:cacheprovider --junitxml="$out/pytest_gpu.xml" \
    ${TESTS:-tests/ops tests/layers tests/models} \
    > "$out/pytest_gpu.log" 2>&1
echo "pytest on the GPU: exit $? after $((SECONDS - began)) s"
tail -n 40 "$out/pytest_gpu.log"
