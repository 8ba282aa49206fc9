#!/usr/bin/env bash
# The cuda backend's check on one GPU machine (one NVIDIA H200 here): its tests on the GPU, then
# the real-size benchmark (bench/bench_gpu.py). Needs, beyond the GPU machine's image (PyTorch
# with CUDA, Triton, accelerate, pytest-xdist, hypothesis, tokenizers...: KINDS.md of the device
# tool lists it), the wheels `bash bench/gpu_wheels.sh` writes to .whl/ (fla-core, transformers
# 5.24.0, xgrammar and their needs), carried: run it as
#   run(command="OUT=$OUT bash bench/gpu_check.sh", carry=[".whl"], timeout_s=560)
# Before spending a GPU's minutes on a change to bench_gpu.py: tests/bench/test_bench_gpu.py runs
# all of it on the CPU (--dry-run), and `bash bench/gpu_check.sh --dry-run` this whole script;
# bench/gpu_image_venv.sh's header rehearses it in a stand-in for the GPU machine's image.
# Output: $OUT/gpu.jsonl (one JSON object per figure), the tests' and the benchmark's logs, and
# the figures on stdout. About 8 minutes.
#   OUT=/tmp/out bash bench/gpu_check.sh [bench_gpu.py flags]
set -uo pipefail
OUT=${OUT:-/tmp/mambaradix-gpu-out}
mkdir -p "$OUT"
# the carried wheels: on the GPU; in a dry run only with WHEELS=1 (a rehearsal in the image's
# stand-in, bench/gpu_image_venv.sh), else a dry run takes the local packages
WHEELS=${WHEELS:-}
[[ " $* " == *" --dry-run "* ]] && WHEELS=${WHEELS:-0}
if [ "${WHEELS:-1}" != 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
  SITE=${SITE:-/tmp/site}
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl || exit 1
  export PYTHONPATH=$SITE:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c "import torch, triton, transformers, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'fla-core', fla.__version__)" | tee -a "$OUT/machine.txt"

# the cuda backend's tests, on the GPU (no interpreter there): kernels, the contract at small
# and real shapes, the engine's outputs against the reference and captured steps against eager.
# On a GPU every new shape compiles each kernel variant, and fla-core autotunes its chunked
# kernels over up to 12 configs each: with pytest-xdist (in the image) the tests spread over 8
# processes so that those compiles run in parallel. TESTS_S=0 skips them (a dry run's choice).
WORKERS=()
python3 -c "import xdist" 2>/dev/null && WORKERS=(-n "${TEST_WORKERS:-8}")
# (pyproject's addopts has -q already: one more would drop pytest's closing counts)
TESTS_S=${TESTS_S:-150}
if [ "$TESTS_S" != 0 ]; then
  timeout "$TESTS_S" python3 -m pytest -p no:cacheprovider "${WORKERS[@]}" -m "slow or not slow" \
    tests/triton tests/engine/test_cuda_backend.py \
    "tests/models/test_backend_contract.py::test_backend_passes_the_contract" \
    "tests/models/test_backend_contract.py::test_backend_passes_the_contract_at_real_shapes" \
    "tests/models/test_backend_contract.py::test_the_cuda_backends_chunked_mamba2_prefill_passes_the_contract" \
    -k "cuda or triton or Triton or test_engine or captured or stale" > "$OUT/tests.txt" 2>&1
  tail -15 "$OUT/tests.txt"
fi

# the benchmark starts no new part in its budget's last 60 s (the timeout kills what runs on)
BENCH_S=${BENCH_S:-330}
timeout "$BENCH_S" python3 bench/bench_gpu.py --out "$OUT/gpu.jsonl" --budget-s $((BENCH_S - 60)) "$@" 2>&1 \
  | grep -v "Warning\|warn(" | tee "$OUT/bench.txt" | tail -60
