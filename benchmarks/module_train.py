"""LoRA training on a real module through the CLI: recorded once, then executed over
budgets and activation policies, each beside the prediction from that one recording.

    python benchmarks/module_train.py                                  # LTX-2, 48 blocks, 6144 tokens
    python benchmarks/module_train.py --blocks 8 --tokens 16384 --checkpointing false \\
        --budgets null --activations off,sync,watermark --override activations.high_watermark_mb=...
    python benchmarks/module_train.py --model flux_diffusers --synthesized   # predicted with no recording

The commands a user runs:
1. `mode=materialize` writes random bf16 weights for the model (--blocks: that many) into --dir;
2. `workload=train_lora mode=record` records one training step (peft LoRA rank --rank on the
   config's lora_targets, per-block checkpointing unless --checkpointing false); with
   --synthesized, the step's trace is synthesized on the meta device instead, as
   `mode=simulate` does without a GPU (engine/modules/synthesize.py), and written there;
3. `-m mode=execute trace=...` runs each budget x activations policy, workload.steps steps each,
   after the same steps with every weight resident (losses and adapter gradients compared);
4. the checkpoint is deleted.
Writes OUT/module_train.json (every report) and prints measured against predicted.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# Copies in flight before the host waits (engine/modules/training.py MODULE_INFLIGHT): a real
# block saves ~150 tensors, and a lower cap makes the host wait inline.
INFLIGHT = ["activations.max_inflight_d2h=1024", "activations.max_inflight_h2d=1024"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def engine(*args: str, check: bool = True) -> None:
    cmd = [sys.executable, "-m", "engine", *args]
    log(" ".join(cmd[3:]))
    if subprocess.run(cmd, check=check).returncode:
        log("the sweep stopped early: the table has the points that finished")


def pct(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{100 * (a - b) / b:+.1f}%"


def describe(path: Path) -> None:
    """The recorded step in a few lines: compute and host time, forward and backward, and the memory."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from engine.trace import read_trace

    trace = read_trace(path)
    h = trace.header
    for phase in ("fwd", "bwd"):
        recs = [r for r in trace.records if r.phase == phase]
        top = max(recs, key=lambda r: r.compute_ns)
        log(f"{phase}: {len(recs)} kernels, compute {sum(r.compute_ns for r in recs) / 1e6:.1f} ms, host "
            f"{sum(r.host_ns for r in recs) / 1e6:.1f} ms; longest {top.name} {top.compute_ns / 1e6:.2f} ms "
            f"(host {top.host_ns / 1e6:.2f} ms)")
    saved = sum(s.nbytes for r in trace.records for s in r.saved)
    log(f"pipelined step {(h.get('pipelined_step_ns') or 0) / 1e6:.1f} ms, compute_scale {h.get('compute_scale')}, "
        f"saved {saved / 1e9:.3f} GB, transient {(h.get('activation_peak_bytes') or 0) / 1e9:.3f} GB, "
        f"context {(h.get('context_bytes') or 0) / 1e9:.3f} GB, record {h.get('record_s')} s")


def synthesized(path: Path, overrides: list[str]) -> None:
    """Write the trace `mode=simulate` synthesizes for these overrides (no GPU, no checkpoint)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from hydra import compose, initialize_config_module

    from engine.config import register
    from engine.modules.synthesize import synthesize_module
    from engine.trace import write_trace

    register()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_trace(path, synthesize_module(cfg.model, cfg.workload, cfg.hardware))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="ltx2_diffusers")
    ap.add_argument("--blocks", type=int, default=None, help="model.module.num_layers (default: the config's)")
    ap.add_argument("--tokens", type=int, default=6144)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--checkpointing", default="true")
    ap.add_argument("--budgets", default="16000,24000")
    ap.add_argument("--activations", default="off,sync")
    ap.add_argument("--sync-layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--override", action="append", default=[], help="an engine override for every run")
    ap.add_argument("--synthesized", action="store_true", help="predict from the synthesized trace, not a recording")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = [f"model={args.model}"] + ([f"+model.module.num_layers={args.blocks}"] if args.blocks else [])
    train = ["workload=train_lora", f"workload.video_tokens={args.tokens}", f"workload.lora_rank={args.rank}",
             f"workload.checkpointing={args.checkpointing}", f"workload.steps={args.steps}", *args.override]
    ckpt = Path(args.dir) / f"module-train-{args.model}-{args.blocks or 'all'}.safetensors"
    try:
        t = time.perf_counter()
        engine(*model, "mode=materialize", f"out={ckpt}", f"hydra.run.dir={out / 'materialize'}")
        log(f"materialized in {time.perf_counter() - t:.0f} s")
        t = time.perf_counter()
        trace = out / "record" / "trace.jsonl"
        if args.synthesized:
            synthesized(trace, model + train)
            log(f"synthesized in {time.perf_counter() - t:.0f} s")
        else:
            engine(*model, *train, "mode=record", f"weights.file={ckpt}", f"hydra.run.dir={out / 'record'}")
            log(f"recorded in {time.perf_counter() - t:.0f} s")
        describe(trace)
        engine("-m", *model, *train, "mode=execute", f"trace={trace}", f"weights.file={ckpt}",
               f"budget={args.budgets}", f"activations={args.activations}",
               f"activations.num_offload_layers={args.sync_layers}", *INFLIGHT,
               f"hydra.sweep.dir={out / 'execute'}", check=False)
    finally:
        ckpt.unlink(missing_ok=True)
    shutil.make_archive(str(out / "record"), "gztar", out / "record")  # the trace, in one file to fetch
    rows = [json.loads(p.read_text()) for p in sorted((out / "execute").glob("*/report.json"),
                                                       key=lambda p: int(p.parent.name))]
    (out / "module_train.json").write_text(json.dumps({"args": vars(args), "reports": rows}, indent=1, default=str))
    print("| budget MB | activations | step predicted | measured | error | x resident | pool+torch peak "
          "predicted | measured | error | H2D pred / meas GB | D2H pred / meas GB | spill misses, stall ms | losses, grads |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p, m, c = r["prediction"], r["measurement"], r["config"]
        peak, resident = m.get("peak_pool_torch_bytes"), m.get("resident_step_ms")
        ratio = f"{m['step_ms'] / resident:.3f}" if resident else "-"
        print(f"| {c['budget_mb']} | {c['activations']} | {p['step_ms']:.1f} | {m['step_ms']:.1f} | "
              f"{pct(p['step_ms'], m['step_ms'])} | {ratio} | {p['peak_pool_torch_bytes'] / 1e9:.2f} | "
              f"{'-' if peak is None else f'{peak / 1e9:.2f}'} | {pct(p['peak_pool_torch_bytes'], peak)} | "
              f"{p['h2d_bytes'] / 1e9:.2f} / {m['h2d_bytes'] / 1e9:.2f} | "
              f"{p['d2h_bytes'] / 1e9:.3f} / {m['d2h_bytes'] / 1e9:.3f} | {m['pool_misses']}, {m['stall_ms']:.1f} | "
              f"{r['loss_match_reference']}, {r['grads_match_reference']} |")


if __name__ == "__main__":
    main()
