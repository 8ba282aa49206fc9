"""Compile the ``cuda`` backend's own Triton kernels for a GPU target on a machine without one
(run as a script by ``test_kernels_compile_for_a_gpu.py``; never imported by the product).

The interpreter runs a kernel's Python body in numpy, so it accepts code the compiler refuses
(a loop-carried value that changes type, an op with no lowering, a block shape the layouts
cannot hold) and says nothing of registers. Here Triton's own compiler builds every kernel the
backend's ops launch, through LLVM to PTX and ``ptxas`` (shipped in Triton's wheel) to a cubin
for ``--arch`` (default sm_90: an H100 or H200), as a GPU run's first launch would:

- a stand-in driver answers Triton's questions about the device (the target, device 0, stream
  0), and ``JITFunction.run`` compiles without launching (``warmup``); autotuned kernels take
  their first config, as under the interpreter;
- the contract's ops (``tests/models/test_backend_contract.py``) run through ``CudaBackend`` on
  CPU tensors at real head shapes, fp32 and bf16, on its mixed layout (prefills, decodes,
  snapshots) and its verify layout (decodes of several positions), each Mamba2 prefill form
  forced: their Python wrappers pick every kernel variant the engine launches (the outputs are
  never read: nothing ran);
- fla-core's Gated DeltaNet prefill and one-position decode are left out (their kernels are
  fla-core's, run on GPUs elsewhere; they stand in as zeros here), the GDN verify kernel is ours
  and is compiled.

Prints one JSON object: the kernels compiled (name -> variants) and, per variant, the
registers and spilled bytes ``ptxas`` reports.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the real compiler, not the interpreter

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import autotuner  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "models"))


class _Device:
    """What Triton asks the driver while it compiles (nothing is launched)."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def _ptxas_usage(cubin: bytes, arch: int) -> dict[str, int]:
    """Registers and spill bytes of a cubin's kernel (``cuobjdump --dump-resource-usage``)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", fh.name], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    found = {k: int(v) for k, v in re.findall(r"(REG|STACK):(\d+)", out)}
    return {"registers": found.get("REG", -1), "stack_bytes": found.get("STACK", -1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    args = ap.parse_args()
    # imported before the stand-in driver: fla-core asks the active driver about the device
    # at import, and must find the CPU (its own kernels do not run here)
    import test_backend_contract as contract

    from mambaradix.kernels.cuda_backend import CudaBackend
    from mambaradix.kernels.triton import gdn

    triton.runtime.driver.set_active(_Device(args.arch))
    compiled: dict[str, list[dict]] = {}
    seen: set = set()
    run = JITFunction.run

    def compile_only(self, *a, grid, warmup, **kw):
        kernel = run(self, *a, grid=grid, warmup=True, **kw)
        name = self.fn.__name__
        key = (name, id(kernel))
        if key not in seen:
            seen.add(key)
            usage = _ptxas_usage(kernel.asm["cubin"], args.arch)
            usage["num_warps"] = kernel.metadata.num_warps
            usage["constants"] = {k: v for k, v in kw.items() if isinstance(v, (bool, int, str))}
            compiled.setdefault(name, []).append(usage)
        return kernel

    JITFunction.run = compile_only
    autotuner.Autotuner._bench = lambda self, *a, config=None, **kw: [0.0, 0.0, 0.0]

    # fla-core's kernels stand in as zeros (module docstring)
    gdn.gdn_prefill = lambda q, k, v, *rest, **kw: torch.zeros_like(v)
    gdn.gdn_decode = lambda q, k, v, *rest, **kw: torch.zeros_like(v)
    for case in args.dtypes:
        for requests in (contract.REQUESTS_STRIDE_64, contract.REQUESTS_VERIFY_STRIDE_64):
            for chunked in (False, True):
                backend = CudaBackend("cpu")
                backend.mamba2_chunked = chunked
                ops = contract._Ops(contract.CASES[case], contract.REAL, requests).on("cpu")
                for name in contract.STATE_OPS:
                    contract._tensors(ops, name, backend)
        _split_attention(contract.CASES[case].dtype)
        _routed_experts(contract.CASES[case].dtype)
    print(json.dumps({"arch": args.arch, "kernels": compiled}))


def _split_attention(dtype: torch.dtype) -> None:
    """Attention whose keys are split across programs (long contexts) and merged: the contract's
    short sequences take one program each."""
    from mambaradix.kernels.triton import attention

    hq, hkv, d, width = 8, 2, 128, 4096
    pool = torch.zeros(width, hkv, d, dtype=dtype)
    table = torch.arange(width, dtype=torch.int32)[None]
    lens = torch.tensor([width], dtype=torch.int32)
    q = torch.zeros(1, hq, d, dtype=dtype)
    attention.paged_attention_decode(q, pool, pool, table, lens, 0.1, splits=8)
    cu, prefix = torch.tensor([0, 1], dtype=torch.int32), lens - 1
    attention.paged_attention_prefill(q, pool, pool, cu, prefix, table, 0.1, 1, splits=8)


def _routed_experts(dtype: torch.dtype) -> None:
    """The MoE grouped GEMM at Qwen3-Next's expert shape (512 experts of intermediate 512,
    hidden 2048, top 10): a decode step's blocks of 16 pairs and a prefill's of 64."""
    from mambaradix.kernels.activation import activation
    from mambaradix.kernels.triton import moe

    E, H, inter, K = 512, 2048, 512, 10
    gate_up, down = torch.zeros(E, 2 * inter, H, dtype=dtype), torch.zeros(E, H, inter, dtype=dtype)
    for T in (1, 512):
        ids = torch.arange(T * K).reshape(T, K) % E
        x, w = torch.zeros(T, H, dtype=dtype), torch.full((T, K), 1.0 / K)
        moe.moe_experts(x, w, ids, gate_up, down, activation("silu"))


if __name__ == "__main__":
    main()
