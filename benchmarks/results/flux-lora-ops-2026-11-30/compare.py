"""profile_blocks.py's measured kernels beside the synthesized step of the same model (one double
and one single block), on a CPU: each phase's kernel time, matmul and attention apart from the rest;
then the backward's matmuls shape by shape (m, n, k), measured (the step's less twice the
forward's: the forward and its recompute) and priced (each linear core's grad-input, each
adapter's weight gradient).

    python benchmarks/results/flux-lora-ops-2026-11-30/compare.py flux_blocks.json
"""
import ast
import collections
import json
import sys

from hydra import compose, initialize_config_module

import torch

from engine.config import register
from engine.kernel_time import ExecutionTimePredictor
from engine.modules.adapters import add_lora, enable_checkpointing
from engine.modules.build import plain_config
from engine.modules.synthesize import meta_forward, on_meta, priced_trace

OVERRIDES = ["model=flux_diffusers", "workload=train_lora", "workload.video_tokens=4096", "workload.text_tokens=256",
             "workload.checkpointing=true", "+model.module.num_layers=2", "+model.module.num_single_layers=2",
             "hardware=h200"]
# The profiled model has one block of each kind; synthesized with two of each (one is not a
# repeated block), the second of each kind stands for it.
LEFT_OUT = ("transformer_blocks.0", "single_transformer_blocks.0")
MATMUL = ("aten::mm", "aten::addmm", "aten::bmm")
ATTENTION = ("aten::_flash_attention_forward", "aten::_flash_attention_backward",
             "aten::_efficient_attention_forward", "aten::_efficient_attention_backward")


def measured(rows: list) -> dict:
    ops = [r for r in rows if "::" in r["op"] and not r["op"].startswith("void")]
    parts = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for r in ops:
        kind = "matmul" if r["op"] in MATMUL else "attention" if r["op"] in ATTENTION else "other"
        parts[kind] += r["self_us"] / 1e3
    return parts


def matmuls(rows: list) -> dict:
    """(m, n, k): [calls, us] of the matmul ops among `rows`."""
    out = collections.defaultdict(lambda: [0, 0.0])
    for r in rows:
        if r["op"] not in MATMUL[:2]:
            continue
        shapes = ast.literal_eval(r["shapes"])
        a, b = shapes[:2] if r["op"] == "aten::mm" else shapes[1:3]
        out[(a[0], b[1], a[1])][0] += r["calls"]
        out[(a[0], b[1], a[1])][1] += r["self_us"]
    return out


def backward_linears(census) -> list:
    """The linear cores whose gradient by their input the backward makes (census.py)."""
    return [s for j, (op, s) in enumerate(census.cores) if op == "linear" and j not in set(census.frozen_inputs)]


def priced_backward_matmuls(trace, census: dict, p) -> dict:
    out = collections.defaultdict(lambda: [0, 0.0])
    reached = {r.name.removesuffix(".bwd") for r in trace.records if r.phase == "bwd" and r.compute_ns > 1}
    for r in trace.records:
        if r.phase != "fwd" or r.name.startswith(LEFT_OUT) or r.name not in reached:
            continue
        for m, n, k in backward_linears(census[r.name]):
            out[(m, k, n)][0] += 1
            out[(m, k, n)][1] += p.backward_core_ns("linear", (m, n, k)) / 1e3
        for m, n, k in census[r.name].trained:  # an adapter: its weight's gradient
            out[(n, k, m)][0] += 1
            out[(n, k, m)][1] += p.core_ns("linear", (n, k, m)) / 1e3
    return out


def synthesized() -> tuple[dict, dict]:
    """engine.modules.synthesize.synthesize_module's steps, keeping the census beside the trace."""
    register()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=OVERRIDES)
    module, inputs = on_meta(cfg.model, cfg.workload)
    add_lora(module, cfg.workload.lora_rank, list(cfg.model.lora_targets), device=torch.device("meta"))
    enable_checkpointing(module)
    seen = meta_forward(module, inputs, "block", None, training=True)
    trace = priced_trace(seen, cfg.hardware, cfg.model.name, plain_config(cfg.workload))
    census = dict(zip(seen.order.kernels, seen.recording.census))
    p = ExecutionTimePredictor(cfg.hardware)
    out = {"forward": {"matmul": 0.0, "attention": 0.0, "other": 0.0},
           "backward": {"matmul": 0.0, "attention": 0.0, "other": 0.0, "recompute": 0.0}}
    fwd = {r.name: r for r in trace.records if r.phase == "fwd"}
    for r in trace.records:
        if r.name.removesuffix(".bwd") in LEFT_OUT:
            continue
        if r.phase == "fwd":
            mm = sum(p.core_ns(op, s, True) for op, s in r.cores if op == "linear") / 1e6
            at = sum(p.core_ns(op, s, True) for op, s in r.cores if op != "linear") / 1e6
            out["forward"]["matmul"] += mm
            out["forward"]["attention"] += at
            out["forward"]["other"] += r.compute_ns / 1e6 - mm - at
        else:
            f = fwd[r.name.removesuffix(".bwd")]
            if r.compute_ns <= 1:
                continue
            c = census[f.name]
            mm = sum(p.backward_core_ns("linear", s) for s in backward_linears(c))
            mm += sum(p.core_ns("linear", (n, k, m)) for m, n, k in c.trained)  # the adapters' weight gradients
            at = sum(p.backward_core_ns(op, s, True) for op, s in f.cores if op != "linear")
            out["backward"]["recompute"] += f.compute_ns / 1e6
            out["backward"]["matmul"] += mm / 1e6
            out["backward"]["attention"] += at / 1e6
            out["backward"]["other"] += (r.compute_ns - f.compute_ns - mm - at) / 1e6
    return out, priced_backward_matmuls(trace, census, p)


def main(path: str) -> None:
    data = json.load(open(path))
    fwd, step = measured(data["forward"]["ops"]), measured(data["step"]["ops"])
    bwd = {k: step[k] - 2 * fwd[k] for k in fwd}  # less the forward and its recompute
    syn, priced = synthesized()
    print(f"{'ms':24s} {'measured':>9s} {'synthesized':>12s}")
    for k in fwd:
        print(f"forward {k:16s} {fwd[k]:9.3f} {syn['forward'][k]:12.3f}")
    for k in bwd:
        print(f"backward {k:15s} {bwd[k]:9.3f} {syn['backward'][k]:12.3f}")
    print(f"backward recompute       {sum(fwd.values()):9.3f} {syn['backward']['recompute']:12.3f}")
    print(f"step                     {sum(step.values()):9.3f} "
          f"{sum(syn['forward'].values()) + sum(syn['backward'].values()):12.3f}")
    mf, ms = matmuls(data["forward"]["ops"]), matmuls(data["step"]["ops"])
    zero = [0, 0.0]
    measured_bwd = {k: (ms.get(k, zero)[0] - 2 * mf.get(k, zero)[0], ms.get(k, zero)[1] - 2 * mf.get(k, zero)[1])
                    for k in set(ms) | set(mf)}
    measured_bwd = {k: v for k, v in measured_bwd.items() if v[0] > 0}  # not the embedders' forward
    print("\nbackward matmuls (m, n, k)  measured: calls, us   priced: calls, us")
    keys = set(measured_bwd) | set(priced)
    for k in sorted(keys, key=lambda k: -max(measured_bwd.get(k, (0, 0))[1], priced.get(k, (0, 0))[1])):
        (mc, mu), (pc, pu) = measured_bwd.get(k, (0, 0.0)), priced.get(k, (0, 0.0))
        print(f"{str(k):26s} {mc:4d} {mu:9.1f}        {pc:4d} {pu:9.1f}")


if __name__ == "__main__":
    main(sys.argv[1])
