"""Us against the offloading libraries people use today: one run, same model, inputs and GPU.

    python benchmarks/peers.py --out DIR                      # LTX-2 48 blocks + FLUX.1, the H100 run
    python benchmarks/peers.py --models ltx --blocks 8 --flux-blocks 4 --no-train
    python benchmarks/peers.py --device cpu --models tiny --budgets 1 --steps 2   # smoke, timings meaningless

(A benchmark script, not a `python -m engine mode=bench`: the peers need
packages the engine does not depend on.)

Inference rows, per model shape (random bf16 weights in a weight file under
/dev/shm, seeded inputs, torch.no_grad):
  resident             every weight on the device beforehand: the compute floor and the reference
  PCIe floor           model bytes / H2D bandwidth (everything streamed once); each of our rows
                       also shows the floor of its own streamed bytes
  ours <eviction>      the spec executor (engine.executor.WeightExecutor) at each budget, weights
                       streamed from the registered weight-file mapping
  nn.Module resident   benchmarks/spec_module.SpecModule with every parameter on the device: the
                       wrapper the peers drive, checked against the reference
  diffusers block/leaf diffusers.hooks.apply_group_offloading(SpecModule, block_level with 1 block
                       per group | leaf_level, use_stream=True)
  accelerate           accelerate.cpu_offload(SpecModule): one step
Each row: step time (median of --steps after --warmup, CUDA events), peak device bytes (torch's
allocator + our pool's used high-water), host RSS (anonymous; file-backed and shared pages
apart) and torch's pinned bytes after the row, set-up time, and max |out - reference| and
max |out - reference| / max |reference| over every output. A row whose output is not bitwise
the reference's is marked WRONG when its relative error exceeds --tolerance, "differs" below it.

Training rows: benchmarks/train_bench.py in a fresh process on the LTX-2 LoRA step (--train-args;
by default 8 blocks at 16384 video tokens): no offload, our watermark and sync-dict modes,
save_on_cpu(pin_memory=True).

Writes bench.json (versions, GPU, date, every row) under --out and prints a markdown table last.

Results: benchmarks/results/peers-h100-2026-11-23.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from engine.executor import WeightExecutor  # noqa: E402
from engine.executor.setup import bitwise_equal, compute_device, forward_order, shared_host_weights  # noqa: E402
from engine.models import build_spec, forward, load_model_config, make_inputs  # noqa: E402
from engine.models.run import DictSource  # noqa: E402
from engine.models.seeded import random_weights  # noqa: E402
from engine.models.spec import ModelSpec  # noqa: E402
from engine.units import MB  # noqa: E402
from engine.weightfile import WeightFile, materialize  # noqa: E402
from executor_bench import choose_dir, h2d_gbps  # noqa: E402
from soak import pinned_bytes  # noqa: E402
from spec_module import SpecModule  # noqa: E402

GB = 1e9


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def workload(tokens: int) -> SimpleNamespace:
    return SimpleNamespace(name="infer", kind="infer", batch=1, video_tokens=tokens, audio_tokens=128,
                           text_tokens=256, context_tokens=0, lora_rank=0)


def shape(model: str, blocks: int | None, tokens: int) -> ModelSpec:
    cfg = load_model_config(model)
    if blocks is not None:
        changes = {"num_layers": blocks}
        if hasattr(cfg, "num_double_layers"):  # FLUX: keep the double/single split's proportion
            changes["num_double_layers"] = max(1, round(blocks * cfg.num_double_layers / cfg.num_layers))
        cfg = dataclasses.replace(cfg, **changes)
    return build_spec(cfg, workload(tokens))


def host_memory() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem"):
                out[key.lower()] = int(value.split()[0]) * 1024
    # torch's pinned host allocator; -1 where this torch's stats lack the key. On the H100 run
    # of 2026-11-22 (torch 2.11) it read 0 in every row, diffusers' included: not trusted there.
    out["pinned"] = pinned_bytes() if torch.cuda.is_available() else 0
    return out


class Timer:
    """CUDA events on the current stream (the host clock on the CPU); median after warm-up."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def run(self, fn: Callable[[], Any], warmup: int, steps: int) -> tuple[list[float], Any]:
        out = None
        for _ in range(warmup):
            out = fn()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out = fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t = time.perf_counter()
                out = fn()
                times.append((time.perf_counter() - t) * 1e3)
        return times, out


def errors(out: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    abs_err = max((out[k].float() - ref[k].float()).abs().max().item() for k in ref)
    scale = max(ref[k].float().abs().max().item() for k in ref)
    return {"bitwise": all(bitwise_equal(out[k], ref[k]) for k in ref), "max_abs_err": abs_err,
            "max_rel_err": abs_err / scale if scale else abs_err,
            "nonfinite": any(not torch.isfinite(out[k]).all().item() for k in ref)}


def peak_device(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated() if device.type == "cuda" else 0


class Bench:
    """One model shape: its weights, inputs, reference and every inference row."""

    def __init__(self, args: argparse.Namespace, spec: ModelSpec, device: torch.device, tokens: int,
                 on_row: Callable[[], None]):
        self.args, self.spec, self.device, self.tokens, self.on_row = args, spec, device, tokens, on_row
        self.timer = Timer(device)
        self.rows: list[dict] = []
        self.info: dict[str, Any] = {"model": spec.name, "kernels": len(spec.kernels),
                                     "model_bytes": spec.model_bytes}
        self.stack = ExitStack()
        self.path: Path | None = None

    def load(self) -> None:
        spec, args = self.spec, self.args
        if self.device.type == "cpu":
            self.tensors = random_weights(spec, seed=0)
            self.inputs = make_inputs(spec, workload(self.tokens), seed=1)
            return
        where = choose_dir(spec.model_bytes, [Path(args.dir)] if args.dir else
                           [Path("/dev/shm/offload-bench"), ROOT / ".bench"])
        if where is None:
            raise SystemExit(f"no room for the {spec.model_bytes / GB:.1f} GB weight file; pass --dir or fewer --blocks")
        self.path = where / f"{spec.name}-{spec.num_layers}.ptd"
        t = time.perf_counter()
        if not self.path.exists():
            materialize(spec, self.path, seed=0)
        self.info["materialize_s"] = time.perf_counter() - t
        wf = WeightFile(self.path, spec)
        self.stack.callback(wf.close)
        self.tensors = shared_host_weights(self.stack, wf, "mmap_registered", "cuda")
        self.info["h2d_gbps"] = h2d_gbps(wf.data_view()[:min(4 << 30, spec.model_bytes)])
        self.inputs = make_inputs(spec, workload(self.tokens), device=self.device, seed=1)
        log(f"{spec.name}: {spec.num_layers} blocks, {spec.model_bytes / GB:.2f} GB in {self.path} "
            f"(materialized in {self.info['materialize_s']:.1f} s); H2D {self.info['h2d_gbps']:.1f} GB/s")

    def close(self) -> None:
        self.tensors = None
        self.stack.close()
        if self.path is not None:
            self.path.unlink()

    def record(self, row: dict, times: list[float], out: dict | None, setup_s: float, peak: int) -> None:
        row.update(step_ms=statistics.median(times), step_ms_all=[round(t, 2) for t in times], setup_s=setup_s,
                   peak_device_bytes=peak, **{f"host_{k}": v for k, v in host_memory().items()})
        if out is not None and getattr(self, "reference", None) is not None:
            row.update(errors(out, self.reference))
        self.rows.append(row)
        self.on_row()
        log(f"{row['row']}: {row['step_ms']:.1f} ms, peak {peak / GB:.2f} GB, set-up {setup_s:.1f} s, "
            f"max abs err {row.get('max_abs_err', 0):.3g}, bitwise {row.get('bitwise')}")

    def failed(self, name: str, err: BaseException) -> None:
        self.rows.append({"row": name, "failed": f"{type(err).__name__}: {str(err)[:300]}"})
        self.on_row()
        log(f"{name}: FAILED {type(err).__name__}: {str(err)[:300]}")

    def resident(self) -> None:
        spec, dev = self.spec, self.device
        t = time.perf_counter()
        weights = {n: w.to(dev, non_blocking=True) for n, w in self.tensors.items()}
        setup = time.perf_counter() - t
        with torch.no_grad():
            times, out = self.timer.run(lambda: forward(spec, DictSource(spec, weights), self.inputs),
                                        self.args.warmup, self.args.steps)
        self.reference = out
        self.resident_ms = statistics.median(times)
        self.record({"row": "resident (compute floor)", "kind": "resident"}, times, out, setup, peak_device(dev))
        del weights
        self.free()

    def pcie_floor(self) -> None:
        bw = self.info.get("h2d_gbps")
        if bw:
            self.rows.append({"row": "PCIe floor (all weights once)", "kind": "floor",
                              "step_ms": self.spec.model_bytes / (bw * GB) * 1e3})

    def ours(self, eviction: str, budget_mb: int) -> None:
        spec, dev = self.spec, self.device
        name = f"ours {eviction} @{budget_mb}"
        try:
            t = time.perf_counter()
            ex = WeightExecutor(forward_order(spec), self.tensors, budget_bytes=budget_mb * MB, eviction=eviction,
                                lookahead=self.args.lookahead, backend=dev.type)
            setup = time.perf_counter() - t

            def step() -> dict:
                with torch.no_grad(), ex.step():
                    return forward(spec, ex, self.inputs)

            times, out = self.timer.run(step, self.args.warmup, self.args.steps)
            tele = ex.telemetry()[-1]
            peak = peak_device(dev) + max(r["peak_device_bytes"] for r in ex.telemetry())
            row = {"row": name, "kind": "ours", "eviction": eviction, "budget_mb": budget_mb,
                   "h2d_bytes": tele["h2d_bytes"]}
            if self.info.get("h2d_gbps"):
                row["pcie_floor_ms"] = tele["h2d_bytes"] / (self.info["h2d_gbps"] * GB) * 1e3
            self.record(row, times, out, setup, peak)
            ex.close()
        except Exception as err:  # a refused budget is a row, not the end of the run
            self.failed(name, err)
        self.free()

    def module_row(self, name: str, apply: Callable[[SpecModule], None] | None, steps: int, warmup: int) -> None:
        """Build the nn.Module over the host weights, let `apply` hook it, run it."""
        spec, dev = self.spec, self.device
        try:
            t = time.perf_counter()
            tensors = self.tensors if apply is not None else {n: w.to(dev) for n, w in self.tensors.items()}
            module = SpecModule(spec, tensors)
            if apply is not None:
                apply(module)
            setup = time.perf_counter() - t
            try:
                times, out = self.timer.run(lambda: module(self.inputs), warmup, steps)
            finally:
                module.close()
            self.record({"row": name, "kind": "peer"}, times, out, setup, peak_device(dev))
            del module, tensors, out
        except Exception as err:
            self.failed(name, err)
        self.free()

    def free(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            if hasattr(torch._C, "_host_emptyCache"):  # a peer's pinned copies, cached by torch's host allocator
                torch._C._host_emptyCache()

    def peers(self) -> None:
        dev, args = self.device, self.args
        self.module_row("nn.Module resident (wrapper check)", None, args.steps, args.warmup)
        if dev.type != "cuda":
            return
        try:
            from diffusers.hooks import apply_group_offloading
        except ImportError as err:
            log(f"diffusers rows skipped: {err}")
        else:
            for kind in ("block_level", "leaf_level"):
                def apply(m: SpecModule, kind: str = kind) -> None:
                    extra = {"num_blocks_per_group": 1} if kind == "block_level" else {}
                    apply_group_offloading(m, onload_device=dev, offload_device=torch.device("cpu"),
                                           offload_type=kind, use_stream=True, **extra)
                self.module_row(f"diffusers {kind.split('_')[0]}-level stream", apply, args.steps, args.warmup)
        try:
            from accelerate import cpu_offload
        except ImportError as err:
            log(f"accelerate row skipped: {err}")
        else:
            self.module_row("accelerate cpu_offload (1 step)", lambda m: cpu_offload(m, execution_device=dev), 1, 0)

    def run(self) -> None:
        args = self.args
        self.load()
        self.resident()
        self.pcie_floor()
        for ev in args.evictions.split(","):
            for b in (int(x) for x in args.budgets.split(",")):
                if b * MB < self.spec.model_bytes:
                    self.ours(ev, b)
        if not args.no_peers:
            self.peers()
        self.close()


def train_rows(args: argparse.Namespace, out_dir: Path) -> dict:
    """benchmarks/train_bench.py as shipped, in a fresh process (its own allocator and GC settings)."""
    path = out_dir / "train_bench.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "train_bench.py"), "--device", args.device,
           "--out", str(path)] + args.train_args.split()
    log("training: " + " ".join(cmd[1:]))
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    (out_dir / "train_bench.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        return {"failed": (done.stdout + done.stderr)[-1500:]}
    return json.loads(path.read_text())


def versions() -> dict[str, str | None]:
    out = {"torch": torch.__version__}
    for name in ("diffusers", "accelerate"):
        try:
            out[name] = importlib.import_module(name).__version__
        except ImportError:
            out[name] = None
    return out


def verdict(r: dict, tolerance: float) -> str:
    if "bitwise" not in r:
        return ""
    if r["bitwise"]:
        return "bitwise"
    return "**WRONG**" if r["nonfinite"] or r["max_rel_err"] > tolerance else "differs"


def table(result: dict) -> str:
    lines = [f"{result['date']}, {result['device']}, torch {result['versions']['torch']}, diffusers "
             f"{result['versions']['diffusers']}, accelerate {result['versions']['accelerate']}; "
             f"`{result['command']}`", ""]
    tol = result["tolerance"]
    for b in result["inference"]:
        ref = next((r["step_ms"] for r in b["rows"] if r.get("kind") == "resident"), None)
        lines += [f"**{b['model']}** ({b['blocks']} blocks, {b['model_bytes'] / GB:.2f} GB bf16, "
                  f"{b['tokens']} video tokens; H2D {b.get('h2d_gbps', 0):.1f} GB/s)", "",
                  "| row | step ms | vs resident | peak device GB | host anon GB | pinned GB | set-up s "
                  "| max abs err | max rel err | output |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in b["rows"]:
            if "failed" in r:
                lines.append(f"| {r['row']} | failed: {r['failed'][:80]} | | | | | | | | |")
                continue
            vs = f"{r['step_ms'] / ref:.2f}x" if ref else ""
            floor = f" (floor {r['pcie_floor_ms']:.0f})" if "pcie_floor_ms" in r else ""
            if r.get("kind") == "floor":
                lines.append(f"| {r['row']} | {r['step_ms']:.1f} | {vs} | | | | | | | |")
                continue
            lines.append(f"| {r['row']} | {r['step_ms']:.1f}{floor} | {vs} | {r['peak_device_bytes'] / GB:.2f} | "
                         f"{r.get('host_rssanon', 0) / GB:.2f} | {r.get('host_pinned', 0) / GB:.2f} | "
                         f"{r['setup_s']:.1f} | {r.get('max_abs_err', 0):.3g} | {r.get('max_rel_err', 0):.3g} | "
                         f"{verdict(r, tol)} |")
        lines.append("")
    t = result.get("training")
    if t and "rows" in t:
        lines += ["**LTX-2 LoRA training step** (benchmarks/train_bench.py)", "",
                  "| row | step ms | overhead | peak device GB | spilled GB | max abs grad err |",
                  "|---|---|---|---|---|---|"]
        for r in t["rows"]:
            lines.append(f"| {r['row']} | {r['step_ms']:.1f} | {r['overhead_pct']:+.1f}% | {r['peak_gb']:.2f} | "
                         f"{r['spilled_gb']:.2f} | {r['max_abs_grad_diff']:.3g} |")
        lines.append(f"(no-offload grad spread step to step: {t.get('spread', float('nan')):.3g})")
    elif t:
        lines.append(f"training failed: {t['failed'][-300:]}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="ltx,flux",
                   help="model shapes, comma-separated (conf/model names); empty: training rows only")
    p.add_argument("--blocks", type=int, default=None, help="blocks of the first model (default: all)")
    p.add_argument("--flux-blocks", type=int, default=None, help="blocks of the other models (default: all)")
    p.add_argument("--tokens", type=int, default=6144, help="video tokens of the first model")
    p.add_argument("--flux-tokens", type=int, default=4096, help="image tokens of the other models (1024x1024)")
    p.add_argument("--budgets", default="8000,16000,24000", help="MB; budgets over the model size are skipped")
    p.add_argument("--evictions", default="lru,belady,priority")
    p.add_argument("--lookahead", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dir", default=None, help="where weight files go (default /dev/shm/offload-bench)")
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--no-train", action="store_true")
    # 16384 video tokens: at 6144 the H100's LoRA step is host-bound (cuBLAS costs 52-100 us of
    # host time a matmul there), and any per-tensor hook cost shows in full.
    p.add_argument("--train-args", default="--layers 8 --video-tokens 16384 --sync-layers 2,3 --spill-factors 1,1.5 "
                                            "--warmup 2 --steps 5")
    p.add_argument("--tolerance", type=float, default=1e-2, help="max rel err above which an output is WRONG")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = p.parse_args()
    device = compute_device(args.device, no_cuda="no CUDA device; run with --device cpu (timings then mean nothing)")
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "versions": versions(), "command": " ".join(["python", *sys.argv]), "tolerance": args.tolerance,
        "inference": []}
    out_path = args.out / "bench.json"

    def save() -> None:
        out_path.write_text(json.dumps(result, indent=1, default=str))

    for i, model in enumerate(m for m in args.models.split(",") if m):
        tokens = args.tokens if i == 0 else args.flux_tokens
        spec = shape(model, args.blocks if i == 0 else args.flux_blocks, tokens)
        bench = Bench(args, spec, device, tokens, save)
        entry = {"model": spec.name, "blocks": spec.num_layers, "model_bytes": spec.model_bytes,
                 "tokens": tokens, "rows": bench.rows}
        result["inference"].append(entry)
        try:
            bench.run()
        finally:
            entry.update(bench.info)
            save()
    if not args.no_train:
        result["training"] = train_rows(args, args.out)
        save()
    text = table(result)
    (args.out / "bench.md").write_text(text + "\n")
    print("\n" + text)


if __name__ == "__main__":
    main()
