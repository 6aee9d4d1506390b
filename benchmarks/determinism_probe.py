"""Is a spec model's all-resident forward bitwise repeatable on this GPU, and which op is not?

    python benchmarks/determinism_probe.py --model llama8b --workload decode [--layers 4]

`mode=execute` compares the streamed outputs bitwise with an all-resident forward; that
comparison means something only if the resident forward repeats itself. This runs the
resident forward REPEATS times (random bf16 weights, the workload's inputs) and reports
whether every output repeats, then repeats each op the family's forward uses alone at the
model's shapes (linear, SDPA, RMSNorm), with and without copies running on another stream,
and prints which ones ever differ. Run it once with and once without
CUBLAS_WORKSPACE_CONFIG=:4096:8 to see whether cuBLAS's workspace choice is the cause.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.models import build_spec, forward, load_model_config, make_inputs  # noqa: E402
from engine.models.seeded import random_weights  # noqa: E402
from engine.models.run import DictSource  # noqa: E402

REPEATS = 8
WORKLOADS = {
    "decode": SimpleNamespace(name="decode", kind="decode", batch=1, video_tokens=0, audio_tokens=0,
                              text_tokens=0, context_tokens=4096, lora_rank=0),
    "infer": SimpleNamespace(name="infer", kind="infer", batch=1, video_tokens=6144, audio_tokens=128,
                             text_tokens=256, context_tokens=0, lora_rank=0),
}


def repeats(fn, background: bool) -> bool:
    """True when REPEATS calls of fn give bitwise equal results."""
    copy = torch.cuda.Stream()
    src = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    outs = []
    for _ in range(REPEATS):
        if background:
            with torch.cuda.stream(copy):
                for _ in range(4):
                    dst.copy_(src, non_blocking=True)
        outs.append(fn())
    torch.cuda.synchronize()
    first = outs[0]
    flat = lambda o: list(o.values()) if isinstance(o, dict) else [o]  # noqa: E731
    return all(torch.equal(a, b) for o in outs[1:] for a, b in zip(flat(first), flat(o)))


def alignment(ptr: int) -> int:
    a = 1
    while a < 4096 and ptr % (2 * a) == 0:
        a *= 2
    return a


def alignment_report(spec, weights: dict, inputs: dict, reference: dict) -> str:
    """The executor's resident forward against the reference, the alignment of the weights
    it hands out, and whether a linear's result depends on its weight's alignment."""
    from engine.executor import WeightExecutor
    from engine.executor.setup import forward_order

    host = {n: t.cpu().pin_memory() for n, t in weights.items()}
    lines = []
    for backend in ("cuda", "vmm"):
        ex = WeightExecutor(forward_order(spec), host, budget_bytes=None, backend=backend)
        seen: dict[str, int] = {}
        fetch = ex.fetch

        def spy(i, fetch=fetch, seen=seen):
            got = fetch(i)
            for n, t in got.items():
                seen[n] = alignment(t.data_ptr())
            return got
        ex.fetch = spy
        with torch.no_grad():
            for _ in range(2):
                with ex.step():
                    out = forward(spec, ex, inputs)
        torch.cuda.synchronize()
        same = all(torch.equal(out[k], reference[k]) for k in reference)
        hist: dict[int, int] = {}
        for a in seen.values():
            hist[a] = hist.get(a, 0) + 1
        lines.append(f"executor {backend}, all resident: bitwise {same}; weight alignments (bytes: count) "
                     f"{dict(sorted(hist.items()))}")
        ex.close()
    ref = {n: alignment(t.data_ptr()) for n, t in weights.items()}
    lines.append(f"reference weight alignments: {dict(sorted({a: list(ref.values()).count(a) for a in set(ref.values())}.items()))}")
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    base = F.linear(x, w)
    buf = torch.empty(4096 * 4096 * 2 + 8192, dtype=torch.uint8, device="cuda")
    for off in (16, 32, 64, 128, 256, 512):
        moved = buf[off:off + w.numel() * 2].view(torch.bfloat16).view(w.shape)
        moved.copy_(w)
        lines.append(f"linear m=1 4096x4096, weight {alignment(moved.data_ptr())}-aligned: "
                     f"bitwise {torch.equal(F.linear(x, moved), base)}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama8b")
    ap.add_argument("--workload", default="decode")
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    cfg = load_model_config(args.model)
    cfg = dataclasses.replace(cfg, num_layers=args.layers)
    wl = WORKLOADS[args.workload]
    spec = build_spec(cfg, wl)
    torch.manual_seed(0)
    weights = random_weights(spec, seed=0, device="cuda")
    inputs = make_inputs(spec, wl, device="cuda", seed=1)
    print(f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG')}, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}")

    def model() -> dict:
        with torch.no_grad():
            return forward(spec, DictSource(spec, weights), inputs)

    rows = [("whole forward", model)]
    shapes = sorted({k.shape for k in spec.kernels if k.op == "linear" and k.shape})
    for m, n, k in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        rows.append((f"linear m={m} n={n} k={k}", lambda x=x, w=w: F.linear(x, w)))
    for bh, lq, lk, d in sorted({k.shape for k in spec.kernels if k.op == "attention" and k.shape}):
        q = torch.randn(1, bh, lq, d, device="cuda", dtype=torch.bfloat16)
        kv_heads = getattr(cfg, "kv_heads", bh) or bh
        kv = torch.randn(1, kv_heads, lk + (1 if args.workload == "decode" else 0), d, device="cuda",
                         dtype=torch.bfloat16)
        rows.append((f"sdpa bh={bh} lq={lq} lk={kv.shape[2]} d={d} kv_heads={kv_heads}",
                     lambda q=q, kv=kv, g=kv_heads != bh: F.scaled_dot_product_attention(q, kv, kv, enable_gqa=g)))
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    rows.append(("rms_norm 1x4096", lambda: F.rms_norm(x, (4096,), torch.ones(4096, device="cuda",
                                                                                  dtype=torch.bfloat16), 1e-5)))
    print(alignment_report(spec, weights, inputs, model()))
    print("| op | repeats alone | repeats beside copies |")
    print("|---|---|---|")
    for name, fn in rows:
        print(f"| {name} | {repeats(fn, False)} | {repeats(fn, True)} |", flush=True)


if __name__ == "__main__":
    main()
