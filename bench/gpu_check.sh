#!/usr/bin/env bash
# The cuda backend's check on one GPU machine (one NVIDIA H200 here): its tests on the GPU, then
# the real-size benchmark (bench/bench_gpu.py). Needs, beyond PyTorch with CUDA and Triton:
# fla-core==0.6.0, transformers==5.24.0 and accelerate==1.16.0 (transformers loads straight onto
# the GPU with it; without it, into host memory and then moved, and the start comparison says
# so); wheels in .whl/ where the machine has no network:
#   pip download --no-deps -d .whl fla-core==0.6.0 transformers==5.24.0 accelerate==1.16.0
# and einops, tokenizers, safetensors, huggingface-hub, jinja2, tqdm, numpy, psutil, pytest,
# hypothesis, which that machine's image has). Before spending a GPU's minutes on a change to
# bench_gpu.py: tests/bench/test_bench_gpu.py runs all of it on the CPU (--dry-run). Output: $OUT/gpu.jsonl (one JSON object per figure), the
# tests' and the benchmark's logs, and a table on stdout. About 8 minutes.
#
#   OUT=/tmp/out bash bench/gpu_check.sh [bench_gpu.py flags]
set -uo pipefail
OUT=${OUT:-/tmp/mambaradix-gpu-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/machine.txt"
python3 -c "import torch, triton, transformers, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'fla-core', fla.__version__)" | tee -a "$OUT/machine.txt"

# the cuda backend's tests, on the GPU (no interpreter there): kernels, the contract at small
# and real shapes, the engine's outputs against the reference and captured steps against eager
timeout "${TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider -m "slow or not slow" \
  tests/triton tests/engine/test_cuda_backend.py \
  "tests/models/test_backend_contract.py::test_backend_passes_the_contract" \
  "tests/models/test_backend_contract.py::test_backend_passes_the_contract_at_real_shapes" \
  "tests/models/test_backend_contract.py::test_the_cuda_backends_chunked_mamba2_prefill_passes_the_contract" \
  -k "cuda or triton or Triton or test_engine or captured or stale" 2>&1 | tail -40 > "$OUT/tests.txt"
tail -15 "$OUT/tests.txt"

timeout "${BENCH_S:-330}" python3 bench/bench_gpu.py --out "$OUT/gpu.jsonl" "$@" 2>&1 \
  | grep -v "Warning\|warn(" | tee "$OUT/bench.txt" | tail -60
