"""LoRA training on a real diffusers LTX-2 with its activations spilled: engine.offload(training=True).

    python benchmarks/real_train.py --blocks 8 --tokens 16384 --out DIR
    python benchmarks/real_train.py --blocks 2 --tokens 1024 --steps 3     # quick

diffusers LTX2VideoTransformer3DModel with --blocks blocks (default config otherwise), random
weights, bf16, on the device; peft LoRA rank --rank on the attention projections and the
feed-forward linears; the base frozen. One step = forward, loss (mean square of both outputs),
backward. Rows, in one process on the same model and batch:
  no offload        the plain step: the reference for time, peak and gradients
  sync K            engine.offload(training=True, activations sync, num_offload_layers=K)
  sync dict D       the same with activations.sync_dict D (--dicts: a JSON list of them), e.g. layer 0
                    whole and the first 40 spillable tensors of layer 1, reloaded a layer earlier:
                    '[{"0": [7, -1, 7, -1], "1": [7, 40, 6, 40]}]'
  watermark         engine.offload(training=True, activations watermark at --high/--low MB)
  save_on_cpu       torch.autograd.graph.save_on_cpu(pin_memory=True)
Step: median of --steps after the sizing step and a warm-up (CUDA events). Peak: torch's
max_memory_allocated over the timed steps. Gradients: max |g - g_ref| over the adapters, and
whether every one is bitwise equal. Writes real_train.json under --out; prints a table last.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import engine  # noqa: E402
from engine.modules.build import ltx2_inputs  # noqa: E402

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]


def build(blocks: int, rank: int) -> Any:
    import diffusers
    import peft

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = diffusers.LTX2VideoTransformer3DModel(num_layers=blocks)
    model = torch.nn.Module.to(model, torch.bfloat16)
    model.requires_grad_(False)
    cfg = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS, init_lora_weights=False)
    return peft.get_peft_model(model, cfg)


def loss_of(out: Any) -> torch.Tensor:
    return sum(o.float().pow(2).mean() for o in out[:2])


def run_steps(model: Any, inputs: dict, steps: int, wrap: Callable[[], Any]) -> tuple[list[float], int, dict]:
    times = []
    grads: dict = {}
    for s in range(steps + 2):
        for p in model.parameters():
            p.grad = None
        if s == 2:
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        with wrap():
            loss_of(model(**inputs)).backward()
        b.record()
        b.synchronize()
        if s >= 2:
            times.append(a.elapsed_time(b))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return times, torch.cuda.max_memory_allocated(), grads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--sync", default="2,4")
    ap.add_argument("--dicts", default="", help="JSON list of sync dicts, one row each")
    ap.add_argument("--min-bytes", type=int, default=None, help="activations.min_tensor_bytes of every row")
    ap.add_argument("--high", type=float, default=0.0, help="watermark high MB (0: 60%% of the saved peak; negative: no watermark row)")
    ap.add_argument("--inflight", type=int, default=64, help="activations.max_inflight_d2h and _h2d")
    ap.add_argument("--no-save-on-cpu", action="store_true")
    ap.add_argument("--out", default="outputs/real_train")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    model = build(args.blocks, args.rank)
    wl = SimpleNamespace(kind="train_lora", batch=1, video_tokens=args.tokens, audio_tokens=128, text_tokens=256)
    inputs = ltx2_inputs(model.base_model.model, wl, torch.device("cuda"), torch.bfloat16)
    rows = []
    base = torch.cuda.memory_allocated()

    def record(name: str, times: list[float], peak: int, grads: dict, ref: dict | None, extra: dict) -> None:
        diff = max(((grads[n].float() - ref[n].float()).abs().max().item() for n in ref), default=0.0) \
            if ref else 0.0
        same = all(torch.equal(grads[n], ref[n]) for n in ref) if ref else True
        rows.append({"row": name, "step_ms": statistics.median(times), "peak_bytes": peak,
                     "activation_peak_bytes": peak - base, "grad_max_abs_diff": diff, "grads_bitwise": same,
                     **extra})
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {rows[-1]['step_ms']:.1f} ms, peak {peak / 1e9:.2f} GB",
              file=sys.stderr, flush=True)

    from contextlib import nullcontext
    times, peak, ref = run_steps(model, inputs, args.steps, nullcontext)
    record("no offload", times, peak, ref, None, {})
    saved_peak = peak - base
    caps = {"max_inflight_d2h": args.inflight, "max_inflight_h2d": args.inflight}
    if args.min_bytes is not None:
        caps["min_tensor_bytes"] = args.min_bytes
    configs = [(f"sync K={k}", {"mode": "sync", "num_offload_layers": int(k), **caps})
               for k in args.sync.split(",") if k]
    configs += [(f"sync dict {json.dumps(d)}", {"mode": "sync", "sync_dict": {int(k): v for k, v in d.items()}, **caps})
                for d in (json.loads(args.dicts) if args.dicts else [])]
    if args.high >= 0:
        high = args.high or 0.6 * saved_peak / 1e6
        configs.append((f"watermark {high:.0f}/{0.8 * high:.0f} MB",
                        {"mode": "watermark", "high_watermark_mb": high, "low_watermark_mb": 0.8 * high, **caps}))
    for name, act in configs:
        h = engine.offload(model, budget_mb=None, training=True, activations=act)
        times, peak, grads = run_steps(model, inputs, args.steps, h.step)
        record(name, times, peak, grads, ref, {"telemetry": h.telemetry()[-1]})
        h.remove()
    if not args.no_save_on_cpu:
        times, peak, grads = run_steps(model, inputs, args.steps,
                                       lambda: torch.autograd.graph.save_on_cpu(pin_memory=True))
        record("save_on_cpu(pin_memory=True)", times, peak, grads, ref, {})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "real_train.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%F"),
         "args": vars(args), "weights_bytes": base, "rows": rows}, indent=1, default=str))
    ref_row = rows[0]
    print("| row | step ms | vs no offload | peak GB | peak vs no offload | spilled GB a step | grads |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['row']} | {r['step_ms']:.1f} | {100 * (r['step_ms'] / ref_row['step_ms'] - 1):+.1f}% | "
              f"{r['peak_bytes'] / 1e9:.2f} | {100 * (r['peak_bytes'] / ref_row['peak_bytes'] - 1):+.1f}% | "
              f"{r.get('telemetry', {}).get('spill_bytes', 0) / 1e9:.2f} | "
              f"{'bitwise' if r['grads_bitwise'] else 'max diff %.2e' % r['grad_max_abs_diff']} |")


if __name__ == "__main__":
    main()
