#!/usr/bin/env bash
# A stand-in for the GPU machine's image on this CPU, for a rehearsal of bench/gpu_check.sh
# before its minutes are spent: a venv with the image's Python (3.12), torch 2.11.0 and Triton
# 3.6.0 (PyPI's torch is its CUDA build, which runs on a CPU: ~4.6 GB with its CUDA libraries)
# and the image's other packages that the check imports, at the image's versions where
# /work/.library/device/KINDS.md gives them (transformers 5.17.0, which the carried wheel
# replaces); and without what the image lacks (fastapi, uvicorn, pydantic, xgrammar, openai),
# so that an import of one of those on the check's path fails here as it would there. Then:
#
#   bash bench/gpu_image_venv.sh /tmp/gpu-image
#   PATH=/tmp/gpu-image/bin:$PATH OUT=/tmp/gc WHEELS=1 TEST_WORKERS=2 TESTS_S=1500 \
#     bash bench/gpu_check.sh --dry-run
#
# which installs the carried wheels (.whl/, bench/gpu_wheels.sh) as the GPU run does, runs the
# check's tests on CPU tensors under Triton's interpreter and bench_gpu.py's dry run.
set -euo pipefail
DIR=${1:?usage: bash bench/gpu_image_venv.sh DIR}
PY312=${PYTHON312:-$(command -v python3.12 || true)}
[ -n "$PY312" ] || { echo "no python3.12 on the PATH (set PYTHON312)" >&2; exit 1; }
"$PY312" -m venv "$DIR"
"$DIR/bin/pip" install -q torch==2.11.0 triton==3.6.0 transformers==5.17.0 accelerate numpy \
  pytest pytest-xdist hypothesis tokenizers safetensors huggingface-hub einops jinja2 tqdm httpx \
  prometheus-client psutil pyyaml requests packaging filelock matplotlib
"$DIR/bin/python" -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)"
