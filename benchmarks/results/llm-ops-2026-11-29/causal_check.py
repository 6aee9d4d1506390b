"""Causal attention against full on this GPU: SDPA over (1, heads, L, d), is_causal or not, as
inference runs it (torch's default kernels) and as a training step does (cuDNN's off: the
forward, and the backward of query, key and value), each timed on the GPU alone (the host
queues the repeats behind a spin kernel), median of 5 rounds; beside the share of the tiles a
causal flash kernel runs (engine.compute.causal_share), which the engine prices it by."""
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from engine.compute import causal_share  # noqa: E402
from engine.measure.compute import TRAIN_BACKENDS  # noqa: E402

dev = torch.device("cuda")


def gpu_us(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(5):
        torch.cuda._sleep(20_000_000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(repeats):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / repeats)
    return statistics.median(out)


print("| heads | L | d | share | inference full / causal us (ratio) | training fwd full / causal (ratio) | "
      "training bwd full / causal (ratio) |")
print("|---|---|---|---|---|---|---|")
for heads, n, d in [(8, 1024, 128), (8, 4096, 128), (8, 8192, 128), (32, 1024, 128), (32, 2048, 128),
                    (32, 4096, 128), (32, 8192, 128), (24, 4429, 64), (40, 4096, 128)]:
    q = torch.randn(1, heads, n, d, device=dev, dtype=torch.bfloat16)
    inf = [gpu_us(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=c)) for c in (False, True)]
    leaves = [torch.randn(1, n, heads, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    qt, kt, vt = (t.transpose(1, 2) for t in leaves)
    fwd, bwd = [], []
    with sdpa_kernel(TRAIN_BACKENDS):
        for c in (False, True):
            fwd.append(gpu_us(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=c)))
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=c)
            g = torch.randn_like(o)
            bwd.append(gpu_us(lambda: torch.autograd.grad(o, leaves, g, retain_graph=True)))
    share = causal_share((heads, n, n, d))
    print(f"| {heads} | {n} | {d} | {share:.3f} | {inf[0]:.0f} / {inf[1]:.0f} ({inf[1] / inf[0]:.3f}) | "
          f"{fwd[0]:.0f} / {fwd[1]:.0f} ({fwd[1] / fwd[0]:.3f}) | {bwd[0]:.0f} / {bwd[1]:.0f} ({bwd[1] / bwd[0]:.3f}) |",
          flush=True)
    del q, leaves, qt, kt, vt, o, g
