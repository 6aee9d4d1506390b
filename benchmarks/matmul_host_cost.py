"""Host time of one bf16 matmul launch on the GPU: why the 6144-token LoRA step is host-bound.

    python benchmarks/matmul_host_cost.py                            # cuBLAS as torch picks it
    BLAS=cublas python benchmarks/matmul_host_cost.py                # torch.backends.cuda.preferred_blas_library
    BLAS=cublaslt python benchmarks/matmul_host_cost.py
    CUBLAS_WORKSPACE_CONFIG=:4096:8 python benchmarks/matmul_host_cost.py

Each case: 20 warm-up calls, then 100 calls timed with perf_counter on the host (host
us/call) and to the end of the GPU work after a synchronize (total us/call). The shapes
are the LTX-2 step's at 6144 video tokens with 2048-wide weights and a rank-32 LoRA A.

Results: benchmarks/results/matmul-host-cost-h100-2026-11-23.md.
"""
from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU: this measures the host cost of launching cuBLAS matmuls")
    lib = os.environ.get("BLAS")
    if lib:
        torch.backends.cuda.preferred_blas_library(lib)
    print(f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG')} "
          f"blas={torch.backends.cuda.preferred_blas_library()} on {torch.cuda.get_device_name()}")
    kw = dict(device="cuda", dtype=torch.bfloat16)
    x, w, b = torch.randn(1, 6144, 2048, **kw), torch.randn(2048, 2048, **kw), torch.randn(2048, **kw)
    a = torch.randn(32, 2048, **kw)
    cases = {"linear": lambda: F.linear(x, w), "linear+bias": lambda: F.linear(x, w, b),
             "lora_A": lambda: F.linear(x, a), "mm2d": lambda: x[0] @ w.t()}
    for name, fn in cases.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        n = 100
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"  {name:12s} host {1e6 * (t1 - t0) / n:7.1f} us/call, total {1e6 * (t2 - t0) / n:7.1f} us/call")


if __name__ == "__main__":
    main()
