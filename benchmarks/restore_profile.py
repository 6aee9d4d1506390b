"""Watermark restores on the GPU: step time, stall and host waits per activation policy, and
torch.profiler traces of single steps (Chrome JSON, gzipped) to see where the compute stream idles.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python benchmarks/restore_profile.py --out $OUT
    python benchmarks/restore_profile.py --rows off,wm08 --profile wm08 --out DIR

The step is train_bench's (8 LTX-2 blocks, 16384 video tokens, LoRA rank 32, weights resident),
the rows are mode=validate's training grid rows built from the shipped recording
(the watermarks as fractions of the trace's saved bytes, the exact pinned pool), each with
restore_within_low_watermark on (`wm08`) or off (`wm08_old`).
Each row: median of 5 steps after 2 warm-up (train_bench.run_row); stall and finalize waits from
the offloader's telemetry. In each profiled step, the compute stream's idle gaps over 1 ms and
the copies' spans are printed (`--gap-ms`); open the traces in chrome://tracing or Perfetto.

Results: benchmarks/results/restore-profile-h100-2026-11-23.md.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gzip
import json
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_bench import run_row  # noqa: E402

from engine.executor.model_hooks import ResidentWeights  # noqa: E402
from engine.executor.offloader import ActivationOffloader  # noqa: E402
from engine.executor.setup import compute_device  # noqa: E402
from engine.executor.training import lora_step  # noqa: E402
from engine.models import build_spec, load_model_config, make_inputs  # noqa: E402
from engine.models.lora import init_lora  # noqa: E402
from engine.models.run import DictSource  # noqa: E402
from engine.models.seeded import random_weights  # noqa: E402
from engine.policy.activations import build_activation_policy  # noqa: E402
from engine.measure.clocks import clock_for  # noqa: E402
from engine.trace import read_trace  # noqa: E402
from engine.validation import activations_config  # noqa: E402

TRACE = Path(__file__).resolve().parents[1] / "data/traces/ltx2_train_lora.jsonl.gz"
WM08 = {"mode": "watermark", "high": 0.8, "low": 0.7}
WM06 = {"mode": "watermark", "high": 0.6, "low": 0.5}
ROWS = {  # name -> (grid row, restore_within_low_watermark; None: not a watermark row)
    "off": (None, None), "wm08": (WM08, True), "wm08_old": (WM08, False), "wm06": (WM06, True),
    "wm06_old": (WM06, False), "sync2": ({"mode": "sync", "layers": 2}, None),
}


def gaps(trace_path: Path, min_ms: float) -> None:
    """The compute stream's idle gaps and the copies' spans in one profiled step."""
    ev = json.load(gzip.open(trace_path))["traceEvents"]
    gpu = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    compute = collections.Counter(e["args"].get("stream") for e in gpu if e["cat"] == "kernel").most_common(1)[0][0]
    on = sorted((e for e in gpu if e["args"].get("stream") == compute), key=lambda e: e["ts"])
    t0 = on[0]["ts"]
    for a, b in zip(on, on[1:]):
        idle = b["ts"] - (a["ts"] + a["dur"])
        if idle > min_ms * 1e3:
            print(f"    compute idle {idle / 1e3:.2f} ms at {(a['ts'] + a['dur'] - t0) / 1e3:.2f} ms")
    for kind in sorted({e["name"] for e in gpu if e["cat"] == "gpu_memcpy"}):
        cs = sorted((e for e in gpu if e["name"] == kind), key=lambda e: e["ts"])
        print(f"    {kind}: {len(cs)} copies from {(cs[0]['ts'] - t0) / 1e3:.1f} to "
              f"{(cs[-1]['ts'] + cs[-1]['dur'] - t0) / 1e3:.1f} ms, busy {sum(e['dur'] for e in cs) / 1e3:.1f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help=f"of {', '.join(ROWS)}")
    p.add_argument("--profile", default="off,wm08_old,wm08", help="rows to profile one step of")
    p.add_argument("--gap-ms", type=float, default=1.0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    unknown = [r for r in args.rows.split(",") if r not in ROWS]
    if unknown:
        p.error(f"--rows: {unknown[0]!r} is not one of {', '.join(ROWS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    device = compute_device("cuda", no_cuda="restore_profile.py needs a CUDA device")
    model_cfg = dataclasses.replace(load_model_config("ltx"), num_layers=8)
    workload = SimpleNamespace(kind="train_lora", batch=1, video_tokens=16384, audio_tokens=128, text_tokens=256,
                               context_tokens=0, lora_rank=32)
    spec = build_spec(model_cfg, workload)
    weights = random_weights(spec, device=device, draw_on_device=True)
    lora = init_lora(spec, 32, device=device, seed=1)
    inputs = make_inputs(spec, workload, device=device, seed=2)
    trace = read_trace(TRACE)
    clock = clock_for(device)

    def step(off: ActivationOffloader | None = None) -> dict:
        lora_step(spec, DictSource(spec, weights), inputs, lora, off)
        return {}

    def profiled(name: str, wrap) -> None:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with wrap():
                step(off)
            torch.cuda.synchronize()
        raw = args.out / f"{name}.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
            dst.write(src.read())
        raw.unlink()
        print(f"  {name}, one profiled step:")
        gaps(Path(f"{raw}.gz"), args.gap_ms)

    results = []
    for name in args.rows.split(","):
        row, within = ROWS[name]
        off, wrap = None, contextlib.nullcontext
        if row is not None:
            act = activations_config(row, trace)
            if within is not None:
                act = dataclasses.replace(act, restore_within_low_watermark=within)
            off = ActivationOffloader(build_activation_policy(act, spec.num_layers), act, device,
                                      weights=ResidentWeights(weights), keep_steps=None)
            wrap = off.step
        try:
            r = run_row(name, lambda: step(off), wrap, clock, device, 2, 5)
            tele = off.telemetry()[-1] if off is not None else {}
            if name in args.profile.split(","):
                profiled(name, wrap)
        finally:
            if off is not None:
                off.close()
        results.append({"row": name, "step_ms": statistics.median(r.step_ms), "steps_ms": r.step_ms,
                        "peak_gb": r.peak_bytes / 1e9, "stall_ms": tele.get("stall_time_ms", 0.0),
                        "finalize_wait_ms": tele.get("finalize_wait_ms", 0.0),
                        "spilled_gb": tele.get("spill_bytes", 0) / 1e9})
        torch.cuda.empty_cache()
    (args.out / "rows.json").write_text(json.dumps(results, indent=1))
    print(f"\n{'row':<10}{'step ms':>9}{'peak GB':>9}{'stall ms':>10}{'finalize ms':>13}{'spilled GB':>12}")
    for r in results:
        print(f"{r['row']:<10}{r['step_ms']:>9.1f}{r['peak_gb']:>9.2f}{r['stall_ms']:>10.1f}"
              f"{r['finalize_wait_ms']:>13.1f}{r['spilled_gb']:>12.2f}")


if __name__ == "__main__":
    main()
