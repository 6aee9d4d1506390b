"""Host cost of streaming a real module: the same forward plain and through engine.offload.

    python benchmarks/module_host_cost.py                      # Llama decode, 32 layers, width 2048
    python benchmarks/module_host_cost.py --hidden 4096 --profile 20

A transformers Llama built from a config with random bf16 weights on the device, one decode token
over a KV cache. Rows: the plain module, and engine.offload with every weight resident
(budget None: each kernel is a fetch that hits). Step: CUDA events, median of --steps after a
warm-up; host: perf_counter of the Python call alone (the GPU may still run). --profile N
prints cProfile's top functions over N offloaded forwards.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import engine  # noqa: E402
from engine.modules.build import llama_inputs  # noqa: E402


def measure(fn, steps: int) -> tuple[float, float]:
    for _ in range(3):
        fn()
    gpu, host = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        fn()
        b.record()
        host.append((time.perf_counter() - t0) * 1e3)
        b.synchronize()
        gpu.append(a.elapsed_time(b))
    return statistics.median(gpu), statistics.median(host)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile", type=int, default=0)
    args = ap.parse_args()
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                                   num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
                                   num_key_value_heads=max(1, args.hidden // 512))
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    wl = SimpleNamespace(kind="decode", batch=1, context_tokens=args.context, text_tokens=0)
    inputs = llama_inputs(model, wl, torch.device("cuda"), torch.bfloat16)
    rows = []
    with torch.no_grad():
        rows.append(("plain", *measure(lambda: model(**inputs), args.steps)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            h = engine.offload(model, budget_mb=None, example_inputs=inputs, eviction="priority")
        rows.append(("engine.offload, resident", *measure(lambda: model(**inputs), args.steps)))
        kernels = len(h.order)
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.profile):
                model(**inputs)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        h.remove()
    print(f"| row | step ms (GPU) | host ms | host us / kernel over plain ({kernels} kernels) |")
    print("|---|---|---|---|")
    for name, gpu, host in rows:
        extra = (host - rows[0][2]) * 1e3 / kernels
        print(f"| {name} | {gpu:.2f} | {host:.2f} | {extra:.0f} |")


if __name__ == "__main__":
    main()
