"""LoRA training on the full diffusers LTX-2 with its weights streamed: engine.offload(training=True, budget_mb=...).

    python benchmarks/real_train_streamed.py --budget 16000 --out DIR
    python benchmarks/real_train_streamed.py --blocks 8 --tokens 2048 --budget 4000 --steps 3   # quick

LTX2VideoTransformer3DModel (default config, --blocks blocks) built on the meta device, random
bf16 weights written once to a .safetensors under --dir, peft LoRA rank --rank on the attention
projections and feed-forward linears (real adapters on the device), per-block gradient
checkpointing (diffusers' own, enable_gradient_checkpointing). Rows, one process:
  resident   every frozen weight loaded to the device from the checkpoint: the reference step
  streamed   engine.offload(checkpoint=..., budget_mb=--budget, training=True), activations kept
  + spill    the same with activations sync K=--sync
Step: forward, mean-square loss of both outputs, backward; median of --steps after 2 (CUDA events).
Peak: torch's max_memory_allocated + the weight pool's peak. Gradients against the resident step.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import engine  # noqa: E402
from engine.modules.build import build_module, ltx2_inputs  # noqa: E402
from engine.modules.checkpoint import Checkpoint, module_weights  # noqa: E402
from engine.weightfile import materialize  # noqa: E402
from real_train import run_steps  # noqa: E402  (the same timed LoRA step)

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build(blocks: int, rank: int) -> Any:
    """Meta-built LTX-2 with checkpointing and real LoRA adapters (seeded) on the device."""
    import peft

    cfg = {"module": {"_target_": "diffusers.LTX2VideoTransformer3DModel", "num_layers": blocks}, "dtype": "bf16"}
    model = build_module(cfg)
    model.enable_gradient_checkpointing()
    model.train()
    model.requires_grad_(False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS))
    g = torch.Generator(device="cuda").manual_seed(0)
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and p.requires_grad:
                mod._parameters[name] = nn.Parameter(
                    0.01 * torch.randn(p.shape, generator=g, device="cuda", dtype=torch.bfloat16))
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=6144)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--budget", type=float, default=16000)
    ap.add_argument("--sync", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--out", default="outputs/real_train_streamed")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    model = build(args.blocks, args.rank)
    base = model.base_model.model
    table = module_weights(model, "ltx2", frozen_only=True)
    path = Path(args.dir) / f"ltx2-{args.blocks}.safetensors"
    rows = []
    try:
        if not path.exists():
            materialize(table, path, seed=0, device="cuda", order=list(table.weights))
        wl = SimpleNamespace(kind="train_lora", batch=1, video_tokens=args.tokens, audio_tokens=128, text_tokens=256)
        inputs = ltx2_inputs(base, wl, torch.device("cuda"), torch.bfloat16)
        inputs["hidden_states"].requires_grad_(False)
        from contextlib import nullcontext

        # Resident reference: the frozen weights loaded into the same module.
        with Checkpoint(path, table) as ckpt:
            loaded = {n: t.to("cuda") for n, t in ckpt.tensors().items()}
        saved = {}
        for n, p in list(model.named_parameters()):
            if n in loaded:
                owner = model.get_submodule(n.rpartition(".")[0])
                saved[n] = owner._parameters[n.rpartition(".")[2]]
                owner._parameters[n.rpartition(".")[2]] = nn.Parameter(loaded[n], requires_grad=False)
        for n, b in list(model.named_buffers()):
            owner = model.get_submodule(n.rpartition(".")[0]) if "." in n else model
            owner._buffers[n.rpartition(".")[2]] = b.to("cuda")
        times, peak, ref = run_steps(model, inputs, args.steps, nullcontext)
        rows.append({"row": "resident", "step_ms": statistics.median(times), "peak_bytes": peak})
        log(f"resident: {rows[-1]['step_ms']:.1f} ms, peak {peak / 1e9:.2f} GB")
        for n, p in saved.items():  # back to meta: the offload maps the checkpoint itself
            owner = model.get_submodule(n.rpartition(".")[0])
            owner._parameters[n.rpartition(".")[2]] = p
        del loaded
        gc.collect()
        torch.cuda.empty_cache()
        for name, act in (("streamed", None), (f"streamed + sync K={args.sync}",
                                               {"mode": "sync", "num_offload_layers": args.sync})):
            t0 = time.perf_counter()
            h = engine.offload(model, budget_mb=args.budget, training=True, example_inputs=inputs,
                               checkpoint=path, activations=act, eviction="priority")
            setup = time.perf_counter() - t0
            torch.cuda.reset_peak_memory_stats()
            times, peak, grads = run_steps(model, inputs, args.steps, h.step)
            tel = h.telemetry()[-1]
            pool = tel["weight_peak_device_bytes"]
            diff = max((grads[k].float() - ref[k].float()).abs().max().item() for k in ref)
            rows.append({"row": name, "step_ms": statistics.median(times), "peak_bytes": peak + pool,
                         "torch_peak_bytes": peak, "pool_peak_bytes": pool, "setup_s": setup,
                         "h2d_bytes": tel["weight_h2d_bytes"], "grad_max_abs_diff": diff,
                         "grads_bitwise": all(torch.equal(grads[k], ref[k]) for k in ref), "telemetry": tel})
            log(f"{name}: {rows[-1]['step_ms']:.1f} ms, device {(peak + pool) / 1e9:.2f} GB "
                f"(torch {peak / 1e9:.2f} + pool {pool / 1e9:.2f}), H2D {tel['weight_h2d_bytes'] / 1e9:.1f} GB, "
                f"grad diff {diff:.2e}, set-up {setup:.1f} s")
            h.remove()
            gc.collect()
            torch.cuda.empty_cache()
    finally:
        path.unlink(missing_ok=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "real_train_streamed.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%F"),
         "args": vars(args), "rows": rows}, indent=1, default=str))
    ref_row = rows[0]
    print("| row | step ms | vs resident | device GB | grads |")
    print("|---|---|---|---|---|")
    for r in rows:
        grads = "ref" if r is ref_row else ("bitwise" if r["grads_bitwise"] else f"max diff {r['grad_max_abs_diff']:.2e}")
        print(f"| {r['row']} | {r['step_ms']:.1f} | {r['step_ms'] / ref_row['step_ms']:.3f}x | "
              f"{r['peak_bytes'] / 1e9:.2f} | {grads} |")


if __name__ == "__main__":
    main()
