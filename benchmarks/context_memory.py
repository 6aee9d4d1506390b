"""Device memory a process holds outside the tensors it allocates: the CUDA context and the
libraries' workspaces (what `hardware.context_mb` and `workspace_mb` carry).

    python benchmarks/context_memory.py

Device memory in use (total - free, the GPU otherwise idle) minus torch's reserved bytes, after
each stage: the context alone, a bf16 matmul (cuBLAS/cuBLASLt handle and workspace), scaled dot
product attention (flash / efficient kernels), a second stream's matmul (a workspace per stream).
"""
from __future__ import annotations

import torch


def outside_torch(device: torch.device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)


def main() -> None:
    device = torch.device("cuda", 0)
    torch.cuda.init()
    torch.empty(1, device=device)
    rows = [("context", outside_torch(device))]
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    (a @ a).sum().item()
    rows.append(("+ bf16 matmul", outside_torch(device)))
    q = torch.randn(1, 24, 4096, 128, device=device, dtype=torch.bfloat16)
    torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().item()
    rows.append(("+ SDPA", outside_torch(device)))
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        (a @ a).sum().item()
    torch.cuda.synchronize()
    rows.append(("+ matmul on a second stream", outside_torch(device)))
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print("| stage | outside torch's allocator (MB) |")
    print("|---|---|")
    for name, nbytes in rows:
        print(f"| {name} | {nbytes / 1e6:.1f} |")


if __name__ == "__main__":
    main()
