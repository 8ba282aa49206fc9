#!/usr/bin/env bash
# The wheels bench/gpu_check.sh needs on the GPU machine, which has no network: what its image
# lacks (/work/.library/device/KINDS.md lists the image's packages: PyTorch, Triton, accelerate,
# pytest-xdist, hypothesis, tokenizers, safetensors, huggingface-hub... are there) or holds at
# another version. Python 3.12 there. Written to .whl/ (ignored by git: carry it, `carry: [".whl"]`).
#
#   bash bench/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
# our pins, and transformers 5.24.0's needs the image may hold older (regex >= 2025.10.22);
# xgrammar (grammar tests) and what it needs: apache-tvm-ffi, pydantic (not in the image)
WHEELS=(fla-core==0.6.0 transformers==5.24.0 regex==2026.12.2 xgrammar==0.2.9
        apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic_core==2.50.5
        annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${WHEELS[@]}"
ls .whl
