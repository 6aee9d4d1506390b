"""Each torch op of a real model's forward timed on the device, with the layout of every tensor it
reads and writes: the data the op census's memory-bound pricing is fitted and checked against.

    python benchmarks/census_ops.py --out ops.json                       # the shipped set below (GPU)
    python benchmarks/census_ops.py --cases sd35:4096:333 --out ops.json
    python benchmarks/census_ops.py --report ops.json.gz --hardware h200  # each op priced as the census does (CPU)

A case is MODEL:VIDEO_TOKENS:TEXT_TOKENS (a diffusers model, inference) or MODEL:decode:CONTEXT /
MODEL:prefill:TOKENS (a causal LM). Each model is built with two blocks (one of each kind where it
has two), random bf16 weights on the device. One forward warms up (cuDNN's plans, cuBLAS's
heuristics); the next is timed op by op: every CHUNK ops (and after an op that hands the host a
value) the host waits for the GPU and queues a sleep kernel, so it has queued the next ops before
the GPU reaches them, and a pair of CUDA events around each op times its kernels back to back,
without the host's launch gaps. A third forward without the events times the whole.

Per op the file holds its aten name, each tensor it reads ("in") and writes ("out") as
[role, shape, stride, dtype], and its time in ns.

--report reads such a file on any machine: each memory-bound op as the census makes it a memory
pass (engine/modules/census.py memory_pass, on meta tensors of the same layouts), the rate each
kind ran at against the profile's probed pass cost, and per case the ops' summed time against
their passes priced; then each case's cores (its linears, its attention, masked or not) against
the profile's kernel table. An op's time includes its pair of events (about 1.4 us on the H200), so
the ops under 20 us are left out of the rates.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from omegaconf import OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.compute import MATMUL_OPS  # noqa: E402
from engine.modules.build import build_module, example_inputs  # noqa: E402
from engine.modules.census import (CORE_PACKETS, MATMULS, attention_core,  # noqa: E402
                                   launches_kernel, matmul_core, memory_pass)

# model config name, the overrides that cut it to two blocks
MODELS = {
    "sd35": ("sd35_large_diffusers", ["module.num_layers=2"]),
    "flux": ("flux_diffusers", ["module.num_layers=1", "module.num_single_layers=1"]),
    "wan14b": ("wan14b_diffusers", ["module.num_layers=2"]),
    "ltx2": ("ltx2_diffusers", ["module.num_layers=2"]),
    "hunyuan": ("hunyuan_video_diffusers", ["module.num_layers=1", "module.num_single_layers=1"]),
    "qwen_image": ("qwen_image_diffusers", ["module.num_layers=2"]),
    "llama8b": ("llama8b_hf", ["module.config.num_hidden_layers=2"]),
    "qwen14b": ("qwen25_14b_hf", ["module.config.num_hidden_layers=2"]),
}
CASES = ("sd35:4096:333", "sd35:9216:333", "flux:4096:512", "flux:4080:512", "wan14b:6144:512",
         "wan14b:32760:512", "ltx2:6144:256", "hunyuan:6144:256", "qwen_image:4096:256",
         "llama8b:decode:4096", "llama8b:prefill:2048", "qwen14b:decode:4096")
CHUNK = 32
SLEEP_CYCLES = 20_000_000  # about 10 ms at the H200's clock: the host queues the next CHUNK ops meanwhile


class OpTimer(TorchDispatchMode):
    """Each op run inside: its tensors' layouts and a pair of CUDA events around it."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict] = []
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._queued = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self._queued % CHUNK == 0:
            torch.cuda.synchronize()
            torch.cuda._sleep(SLEEP_CYCLES)
        self._queued += 1
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = func(*args, **kwargs)
        end.record()
        tensors = [["in", t] for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        tensors += [["out", t] for t in outs]
        if not all(t.is_cuda for t in outs) or func is torch.ops.aten._local_scalar_dense.default:
            self._queued = 0  # the host waited for this op: queue a sleep before the next
        self.rows.append({"op": str(func), "view": bool(func.is_view), "tensors": [
            [role, list(t.shape), list(t.stride()), str(t.dtype).removeprefix("torch.")] for role, t in tensors]})
        self.events.append((start, end))
        return out

    def finish(self) -> list[dict]:
        torch.cuda.synchronize()
        for row, (start, end) in zip(self.rows, self.events):
            row["ns"] = round(start.elapsed_time(end) * 1e6)
        return self.rows


def on_device(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """`module` (parameters on the meta device) with random parameters on `device`, buffers moved."""
    g = torch.Generator(device=device).manual_seed(0)
    for name, p in list(module.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        holder = module.get_submodule(owner) if owner else module
        data = torch.randn(p.shape, generator=g, device=device, dtype=torch.float32).mul_(0.02).to(p.dtype)
        holder._parameters[leaf] = torch.nn.Parameter(data, requires_grad=False)
    for name, b in list(module.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        holder = module.get_submodule(owner) if owner else module
        holder._buffers[leaf] = b.to(device)
    return module


def workload(kind: str, a: str, b: str) -> SimpleNamespace:
    if a == "decode":
        return SimpleNamespace(kind="decode", batch=1, video_tokens=0, audio_tokens=0, text_tokens=0,
                               context_tokens=int(b))
    if a == "prefill":
        return SimpleNamespace(kind="infer", batch=1, video_tokens=0, audio_tokens=0, text_tokens=int(b),
                               context_tokens=0)
    return SimpleNamespace(kind="infer", batch=1, video_tokens=int(a), audio_tokens=128 if kind == "ltx2" else 0,
                           text_tokens=int(b), context_tokens=0)


def run_case(case: str, device: torch.device) -> dict:
    key, a, b = case.split(":")
    config, overrides = MODELS[key]
    cfg = OmegaConf.merge(OmegaConf.load(ROOT / "conf" / "model" / f"{config}.yaml"), OmegaConf.from_dotlist(overrides))
    module = on_device(build_module(cfg), device, torch.bfloat16)
    w = workload(key, a, b)
    inputs = example_inputs(cfg, module, w, device)
    with torch.no_grad():
        module(**inputs)  # warm-up
        torch.cuda.synchronize()
        inputs = example_inputs(cfg, module, w, device)  # a decode cache is read afresh
        timer = OpTimer()
        with timer:
            module(**inputs)
        rows = timer.finish()
        inputs = example_inputs(cfg, module, w, device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES * 20)
        start.record()
        module(**inputs)
        end.record()
        torch.cuda.synchronize()
    whole = round(start.elapsed_time(end) * 1e6)
    del module, inputs
    torch.cuda.empty_cache()
    return {"case": case, "config": config, "overrides": overrides, "workload": vars(w), "forward_ns": whole,
            "ops": rows}


# The fused attention kernels: the census counts SDPA as one core where the model calls it.
ATTENTION = ("aten._scaled_dot_product", "aten._flash_attention", "aten._efficient_attention",
             "aten._cudnn_attention")
BIG_NS = 20_000


def _on_meta(row: dict) -> tuple[Any, list[torch.Tensor], list[torch.Tensor]]:
    """A row's aten op and meta tensors of the layouts it read ("in") and wrote ("out")."""
    _, base, overload = row["op"].split(".")
    tensors: dict[str, list[torch.Tensor]] = {"in": [], "out": []}
    for role, shape, stride, dtype in row["tensors"]:
        tensors[role].append(torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device="meta"))
    return getattr(getattr(torch.ops.aten, base), overload), tensors["in"], tensors["out"]


def priced_ops(case: dict) -> list[tuple[str, int, int]]:
    """(kind, amount, ns) of each memory-bound op of a case, as the census makes it a pass."""
    out = []
    for row in case["ops"]:
        func, ins, outs = _on_meta(row)
        if row["op"].startswith(ATTENTION) or not launches_kernel(func) or func._overloadpacket in CORE_PACKETS:
            continue
        out.append((*memory_pass(func._overloadpacket, ins, outs), row["ns"]))
    return out


# The fused attention kernels whose fourth tensor argument, where given, is the mask.
MASKABLE = ("aten._efficient_attention", "aten._scaled_dot_product_efficient", "aten._cudnn_attention",
            "aten._scaled_dot_product_cudnn")


def timed_cores(case: dict) -> list[tuple[str, tuple[int, ...], int]]:
    """(op, shape, ns) of each matmul-bound op of a case, as the census makes it a core."""
    out = []
    for row in case["ops"]:
        func, ins, _ = _on_meta(row)
        if func._overloadpacket in MATMULS:
            op, shape = matmul_core(func._overloadpacket, ins)
        elif row["op"].startswith(ATTENTION):
            op, shape = attention_core(ins[0], ins[1], ins[3] if row["op"].startswith(MASKABLE) and len(ins) > 3 else None)
        else:
            continue
        out.append((op, shape, row["ns"]))
    return out


def report(path: Path, hardware: str) -> None:
    from engine.compute import PASSES
    from engine.config import load_hardware
    from engine.kernel_time import ExecutionTimePredictor

    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    predictor = ExecutionTimePredictor(load_hardware(hardware))
    cost = predictor.table.pass_cost
    cases = [(c["case"], priced_ops(c)) for c in data["cases"]]
    print(f"{data['device']}, hardware={hardware}: memory-bound ops of {BIG_NS // 1000} us or more\n")
    print("| kind | ops | ms | measured GB/s | probed GB/s |\n|---|---|---|---|---|")
    for kind in PASSES:
        big = [(a, ns) for _, ops in cases for k, a, ns in ops if k == kind and ns >= BIG_NS]
        if big:
            moved, ns = sum(a for a, _ in big), sum(n for _, n in big)
            print(f"| {kind} | {len(big)} | {ns / 1e6:.2f} | {moved / ns:.0f} | {1 / cost.ns_per_byte[kind]:.0f} |")
    print("\n| case | memory-bound ops | their time ms (ops of 20 us or more) | priced ms | error |\n|---|---|---|---|---|")
    for name, ops in cases:
        big = [(k, a, ns) for k, a, ns in ops if ns >= BIG_NS]
        measured, priced = sum(ns for *_, ns in big), cost.ns([(k, a) for k, a, _ in big])
        if measured:
            print(f"| {name} | {len(ops)} | {measured / 1e6:.3f} | {priced / 1e6:.3f} | {100 * (priced / measured - 1):+.1f}% |")
    print("\n| case | core | ops | their time ms (with their events) | priced ms | error |\n|---|---|---|---|---|---|")
    for c in data["cases"]:
        cores = timed_cores(c)
        for op in MATMUL_OPS:
            mine = [(shape, ns) for o, shape, ns in cores if o == op]
            if mine:
                measured, priced = sum(ns for _, ns in mine), sum(predictor.core_ns(op, shape) for shape, _ in mine)
                print(f"| {c['case']} | {op} | {len(mine)} | {measured / 1e6:.3f} | {priced / 1e6:.3f} | "
                      f"{100 * (priced / measured - 1):+.1f}% |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--report", type=Path, help="a file --out wrote: print its ops priced (no GPU)")
    ap.add_argument("--hardware", default="h200", help="the profile whose pass cost --report prices by")
    args = ap.parse_args()
    if args.report:
        report(args.report, args.hardware)
        return
    if args.out is None:
        ap.error("give --out FILE (or --report FILE)")
    device = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "cases": []}
    print("| case | ops | sum of ops ms | forward ms |\n|---|---|---|---|")
    for case in args.cases.split(","):
        began = time.perf_counter()
        result = run_case(case, device)
        out["cases"].append(result)
        args.out.write_text(json.dumps(out))
        total = sum(r["ns"] for r in result["ops"])
        print(f"| {case} | {len(result['ops'])} | {total / 1e6:.3f} | {result['forward_ns'] / 1e6:.3f} |"
              f" ({time.perf_counter() - began:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
