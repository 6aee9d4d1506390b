"""Replicas on the GPUs of one host, every one streaming the same checkpoint: alone, then all at once.

    python benchmarks/node_replicas.py --model ltx2 --budget 16000          # every visible GPU
    python benchmarks/node_replicas.py --model tiny --device cpu --budget 0  # smoke, timings meaningless

One checkpoint (random bf16 weights, a single .safetensors in --dir, the page cache) and one process
per GPU. Each builds the module on the meta device and runs engine.offload(checkpoint=...,
budget_mb=--budget, eviction=priority): it maps the same file and registers its own mapping, so the
host holds the weights once. Steps (CUDA events, median of --steps after --warmup, the host waiting
for each step's end): each replica alone while the others wait, then every replica at once, started
together. Host memory: the node's used RAM (MemTotal - MemAvailable) before the checkpoint, with the
checkpoint written, and while all replicas run; each replica's resident set. Prints a table last and
writes node_replicas.json under --out.
"""
from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.multiprocessing as mp
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from real_models import MODELS, WORKLOADS, host_rss, log  # noqa: E402

# The CPU smoke model beside the real ones.
MODELS = {**MODELS, "tiny": "tiny_llama_hf"}
WORKLOADS = {**WORKLOADS, "tiny": dict(kind="decode", batch=1, video_tokens=0, audio_tokens=0, text_tokens=0,
                                       context_tokens=16)}


def used_ram() -> int:
    """The node's RAM in use: MemTotal - MemAvailable."""
    m = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, value = line.partition(":")
        m[key] = int(value.split()[0]) * 1024
    return m["MemTotal"] - m["MemAvailable"]


def gather(procs: list, results: Any, what: str) -> list[dict]:
    """Start `procs`, take one result row from each off `results` (a process that dies
    ends the run: SystemExit naming it), join them; the rows by rank."""
    for p in procs:
        p.start()
    rows: list[dict] = []
    while len(rows) < len(procs):
        try:
            rows.append(results.get(timeout=5))
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.terminate()
                raise SystemExit(f"{what} {procs.index(dead[0])} of {len(procs)} exited with code "
                                 f"{dead[0].exitcode}; its traceback is above")
    for p in procs:
        p.join()
    return sorted(rows, key=lambda r: r["rank"])


def replica(rank: int, args: argparse.Namespace, path: str, barrier: Any, results: Any) -> None:
    """One replica: offload, then time its steps alone (in rank order) and with every other replica."""
    warnings.simplefilter("ignore")
    import engine
    from engine.modules.build import build_module, example_inputs

    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    cfg = OmegaConf.load(ROOT / "conf" / "model" / f"{MODELS[args.model]}.yaml")
    module = build_module(cfg)
    inputs = example_inputs(cfg, module, SimpleNamespace(**WORKLOADS[args.model]), device)
    t0 = time.perf_counter()
    h = engine.offload(module, budget_mb=args.budget or None, example_inputs=inputs, eviction="priority",
                       checkpoint=path, backend="cuda" if cuda else "cpu")
    setup_s = time.perf_counter() - t0

    def step_ms() -> float:
        if not cuda:
            t = time.perf_counter()
            module(**inputs)
            return (time.perf_counter() - t) * 1e3
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        module(**inputs)
        b.record()
        b.synchronize()
        return a.elapsed_time(b)

    with torch.no_grad():
        for _ in range(args.warmup):
            step_ms()
        alone: list[float] = []
        for turn in range(args.replicas):
            barrier.wait()
            if turn == rank:
                alone = [step_ms() for _ in range(args.steps)]
            barrier.wait()
        barrier.wait()  # every replica at once
        together = [step_ms() for _ in range(args.steps)]
        node_ram = used_ram()
        barrier.wait()
    results.put({"rank": rank, "setup_s": setup_s, "alone_ms": statistics.median(alone),
                 "together_ms": statistics.median(together), "alone": alone, "together": together,
                 "h2d_bytes": h.telemetry()[-1]["h2d_bytes"], "rss": host_rss(), "node_used_ram": node_ram,
                 "eviction": h.eviction})
    h.remove()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="ltx2", choices=sorted(MODELS))
    ap.add_argument("--budget", type=float, default=16000.0, help="MB per replica (0: all resident)")
    ap.add_argument("--replicas", type=int, default=0, help="default: one per visible GPU")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dir", default="/dev/shm", help="where the checkpoint is written (deleted after)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default="outputs/node_replicas")
    args = ap.parse_args()
    args.replicas = args.replicas or (torch.cuda.device_count() if args.device == "cuda" else 2)
    warnings.simplefilter("ignore")
    from engine.modules.build import build_module
    from engine.modules.checkpoint import module_weights
    from engine.weightfile import materialize

    cfg = OmegaConf.load(ROOT / "conf" / "model" / f"{MODELS[args.model]}.yaml")
    table = module_weights(build_module(cfg), cfg.name)
    path = Path(args.dir) / f"replicas-{args.model}.safetensors"
    ram_before = used_ram()
    try:
        t0 = time.perf_counter()
        materialize(table, path, seed=0, device=args.device, order=list(table.weights))
        log(f"wrote {path} ({table.model_bytes / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s")
        ram_file = used_ram()
        ctx = mp.get_context("spawn")
        barrier, results = ctx.Barrier(args.replicas), ctx.Queue()
        procs = [ctx.Process(target=replica, args=(r, args, str(path), barrier, results))
                 for r in range(args.replicas)]
        rows = gather(procs, results, "replica process")
    finally:
        path.unlink(missing_ok=True)
    model = table.model_bytes
    peak_ram = max(r["node_used_ram"] for r in rows)
    summary = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "torch": torch.__version__, "date": time.strftime("%F"), "args": vars(args),
               "model_bytes": model, "ram_before": ram_before, "ram_with_file": ram_file,
               "ram_all_running": peak_ram, "replicas": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "node_replicas.json").write_text(json.dumps(summary, indent=1))
    print(f"{args.replicas} replicas of {cfg.name} at budget {args.budget:.0f} MB, {model / 1e9:.2f} GB of weights")
    print("| replica | eviction | set-up s | alone ms | all at once ms | slowdown | H2D GB a step | RSS anon GB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rank']} | {r['eviction']} | {r['setup_s']:.1f} | {r['alone_ms']:.1f} | {r['together_ms']:.1f} | "
              f"{100 * (r['together_ms'] / r['alone_ms'] - 1):+.1f}% | {r['h2d_bytes'] / 1e9:.2f} | "
              f"{r['rss']['RssAnon'] / 1e9:.2f} |")
    print(f"node RAM in use: {ram_before / 1e9:.1f} GB before, {ram_file / 1e9:.1f} GB with the checkpoint "
          f"(+{(ram_file - ram_before) / model:.2f}x the model), {peak_ram / 1e9:.1f} GB with every replica running "
          f"(+{(peak_ram - ram_before) / model:.2f}x the model over before)")


if __name__ == "__main__":
    main()
