"""Data-parallel LoRA training on the GPUs of one host, each replica streaming its weights and spilling its activations.

    python benchmarks/node_train.py --budget 16000                  # full LTX-2, every visible GPU
    python benchmarks/node_train.py --blocks 2 --tokens 256 --device cpu --budget 0 --steps 1   # smoke

diffusers LTX2VideoTransformer3DModel (default config, --blocks blocks) built on the meta device,
peft LoRA rank --rank on the attention projections and feed-forward linears, per-block gradient
checkpointing; its frozen weights (random bf16) in one .safetensors in --dir, which every process
maps (the page cache holds it once). Each replica: engine.offload(checkpoint=..., budget_mb=--budget,
training=True, activations sync K=--sync, pool capped at its share of --node-pinned-mb: the
checkpoint, registered once, then an even split), wrapped in engine.data_parallel (NCCL).
The global batch is --replicas micro-batches (micro-batch i: inputs seeded i):
  one GPU    one process runs them one after another, its loss scaled by 1/N, gradients accumulated
  the node   one process per GPU runs micro-batch `rank`; DDP averages the gradients
Step: the global batch, CUDA events, median of --steps after 2 (the first sizes the pool); throughput
= global batch / step. Gradients: the node's against one GPU's, beside one GPU's own spread (the
same global batch run twice). Pinned: the checkpoint once plus each replica's slab pool, from the
telemetry. Writes node_train.json under --out; prints a table last.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from real_models import log  # noqa: E402
from real_train import TARGETS, loss_of  # noqa: E402
from node_replicas import gather, used_ram  # noqa: E402


def build(blocks: int, rank: int, device: torch.device) -> nn.Module:
    """Meta-built LTX-2 with checkpointing and seeded LoRA adapters on `device`."""
    import peft

    from engine.modules.build import build_module

    model = build_module({"module": {"_target_": "diffusers.LTX2VideoTransformer3DModel", "num_layers": blocks},
                          "dtype": "bf16"})
    model.enable_gradient_checkpointing()
    model.train()
    model.requires_grad_(False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS))
    g = torch.Generator(device=device).manual_seed(0)
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and p.requires_grad:
                mod._parameters[name] = nn.Parameter(
                    0.01 * torch.randn(p.shape, generator=g, device=device, dtype=torch.bfloat16))
    return model


def worker(rank: int, world: int, args: argparse.Namespace, path: str, init: str, results: Any) -> None:
    """One process: world 1 runs the whole global batch, world > 1 its micro-batch under DDP."""
    warnings.simplefilter("ignore")
    import torch.distributed as dist

    import engine
    from engine.modules.build import ltx2_inputs

    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world)
    model = build(args.blocks, args.rank, device)
    base = model.base_model.model
    wl = SimpleNamespace(kind="train_lora", batch=1, video_tokens=args.tokens, audio_tokens=128, text_tokens=256)
    micro = [ltx2_inputs(base, wl, device, torch.bfloat16, seed=i) for i in range(args.replicas)]
    mine = micro if world == 1 else [micro[rank]]
    share = engine.replica_pool_mb(args.node_pinned_mb, Path(path).stat().st_size, args.replicas)
    t0 = time.perf_counter()
    h = engine.offload(model, budget_mb=args.budget or None, training=True, example_inputs=mine[0], checkpoint=path,
                       eviction="priority", backend="cuda" if cuda else "cpu",
                       activations={"mode": "sync", "num_offload_layers": args.sync, "pool": {"max_mb": share}})
    setup_s = time.perf_counter() - t0
    net = engine.data_parallel(model) if world > 1 else model
    scale = 1.0 / len(mine)

    def step() -> float:
        for p in model.parameters():
            p.grad = None
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        for inputs in mine:
            with h.step():
                (loss_of(net(**inputs)) * scale).backward()
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    times = [step() for _ in range(args.steps + 2)][2:]
    grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
    spread = None
    if world == 1:  # the same global batch again: one GPU's own spread
        step()
        spread = max((p.grad.detach().cpu().float() - grads[n].float()).abs().max().item()
                     for n, p in model.named_parameters() if p.requires_grad)
    if rank == 0:
        torch.save(grads, f"{path}.grads-{world}.pt")
    rows = h.telemetry()
    del net  # DDP holds every parameter: on the CPU the resident frozen ones view the checkpoint's mapping
    gc.collect()
    results.put({"rank": rank, "world": world, "setup_s": setup_s, "step_ms": statistics.median(times),
                 "times": times, "spread": spread, "pool_share_mb": share,
                 "pinned_bytes": max(r.get("pinned_bytes", 0) for r in rows),
                 "pool_hits": rows[-1]["pool_hits"], "pool_misses": rows[-1]["pool_misses"],
                 "spill_bytes": rows[-1]["spill_bytes"], "weight_h2d_bytes": rows[-1]["weight_h2d_bytes"],
                 "node_used_ram": used_ram()})
    h.remove()
    dist.destroy_process_group()


def run(world: int, args: argparse.Namespace, path: str) -> list[dict]:
    """`world` processes, one per GPU; their result rows by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init = f"file://{path}.rendezvous-{world}"
    Path(init[len("file://"):]).unlink(missing_ok=True)
    procs = [ctx.Process(target=worker, args=(r, world, args, path, init, results)) for r in range(world)]
    rows = gather(procs, results, "training process")
    Path(init[len("file://"):]).unlink(missing_ok=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=6144)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--budget", type=float, default=16000.0, help="MB of weights a replica (0: all resident)")
    ap.add_argument("--sync", type=int, default=2, help="activations sync: layers whose saved tensors spill")
    ap.add_argument("--node-pinned-mb", type=float, default=0.0,
                    help="the node's pinned budget (default: the checkpoint plus 4000 MB a replica)")
    ap.add_argument("--replicas", type=int, default=0, help="default: one per visible GPU")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dir", default="/dev/shm", help="where the checkpoint is written (deleted after)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default="outputs/node_train")
    args = ap.parse_args()
    args.replicas = args.replicas or (torch.cuda.device_count() if args.device == "cuda" else 2)
    warnings.simplefilter("ignore")
    from engine.modules.checkpoint import module_weights
    from engine.weightfile import materialize

    device = torch.device(args.device)
    model = build(args.blocks, args.rank, device)
    table = module_weights(model, "ltx2", frozen_only=True)
    del model
    path = Path(args.dir) / f"node-train-ltx2-{args.blocks}.safetensors"
    if not args.node_pinned_mb:
        args.node_pinned_mb = table.model_bytes / 1e6 + 4000 * args.replicas
    ram_before = used_ram()
    try:
        t0 = time.perf_counter()
        materialize(table, path, seed=0, device=args.device, order=list(table.weights))
        log(f"wrote {path} ({table.model_bytes / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s")
        one = run(1, args, str(path))
        log(f"one GPU: {one[0]['step_ms']:.1f} ms a global batch of {args.replicas}")
        node = run(args.replicas, args, str(path))
        log(f"{args.replicas} GPUs: {[round(r['step_ms'], 1) for r in node]} ms")
        ref = torch.load(f"{path}.grads-1.pt")
        got = torch.load(f"{path}.grads-{args.replicas}.pt")
        diff = max((got[k].float() - ref[k].float()).abs().max().item() for k in ref)
        bitwise = all(torch.equal(got[k], ref[k]) for k in ref)
        grad_max = max(ref[k].float().abs().max().item() for k in ref)
    finally:
        path.unlink(missing_ok=True)
        for world in (1, args.replicas):
            Path(f"{path}.grads-{world}.pt").unlink(missing_ok=True)
    pinned = table.model_bytes + sum(r["pinned_bytes"] for r in node)
    step_node = max(r["step_ms"] for r in node)
    summary = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "torch": torch.__version__, "date": time.strftime("%F"), "args": vars(args),
               "model_bytes": table.model_bytes, "ram_before": ram_before, "one_gpu": one, "node": node,
               "grad_max_abs_diff": diff, "grads_bitwise": bitwise, "grad_max": grad_max,
               "node_pinned_bytes": pinned, "throughput_ratio": one[0]["step_ms"] / step_node}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "node_train.json").write_text(json.dumps(summary, indent=1))
    print(f"LoRA training of LTX-2 ({args.blocks} blocks, {args.tokens} tokens), global batch {args.replicas}, "
          f"budget {args.budget:.0f} MB, sync K={args.sync}; weights {table.model_bytes / 1e9:.2f} GB")
    print("| run | process | set-up s | step ms | samples/s | pool GB (share) | hits / misses | weight H2D GB |")
    print("|---|---|---|---|---|---|---|---|")
    for name, rows in (("one GPU", one), (f"{args.replicas} GPUs", node)):
        for r in rows:
            print(f"| {name} | {r['rank']} | {r['setup_s']:.1f} | {r['step_ms']:.1f} | "
                  f"{args.replicas * 1e3 / r['step_ms']:.2f} | {r['pinned_bytes'] / 1e9:.2f} "
                  f"({r['pool_share_mb'] / 1e3:.2f}) | {r['pool_hits']} / {r['pool_misses']} | "
                  f"{r['weight_h2d_bytes'] / 1e9:.1f} |")
    print(f"throughput {summary['throughput_ratio']:.2f}x one GPU; node pinned {pinned / 1e9:.2f} GB of "
          f"{args.node_pinned_mb / 1e3:.2f} GB (checkpoint once + pools); node RAM in use "
          f"{max(r['node_used_ram'] for r in node) / 1e9:.1f} GB ({ram_before / 1e9:.1f} before); gradients "
          f"{'bitwise' if bitwise else f'max diff {diff:.2e}'} against one GPU (its own spread "
          f"{one[0]['spread']:.2e}; largest gradient {grad_max:.2e})")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
