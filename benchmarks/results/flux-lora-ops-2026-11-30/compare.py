"""profile_blocks.py's measured kernels beside the synthesized step of the same model (one double
and one single block), on a CPU: each phase's kernel time, matmul and attention apart from the rest.

    python benchmarks/results/flux-lora-ops-2026-11-30/compare.py flux_blocks.json
"""
import json
import sys

from hydra import compose, initialize_config_module

from engine.config import register
from engine.kernel_time import ExecutionTimePredictor
from engine.modules.synthesize import synthesize_module

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


def synthesized() -> dict:
    register()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=OVERRIDES)
    trace = synthesize_module(cfg.model, cfg.workload, cfg.hardware)
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
            mm = sum(p.backward_core_ns(op, s, True) for op, s in f.cores if op == "linear")
            mm += sum(p.core_ns("linear", (s[1], s[2], s[0])) for op, s in f.cores
                      if op == "linear" and 32 in s[1:])  # the adapters' weight gradients
            at = sum(p.backward_core_ns(op, s, True) for op, s in f.cores if op != "linear")
            out["backward"]["recompute"] += f.compute_ns / 1e6
            out["backward"]["matmul"] += mm / 1e6
            out["backward"]["attention"] += at / 1e6
            out["backward"]["other"] += (r.compute_ns - f.compute_ns - mm - at) / 1e6
    return out


def main(path: str) -> None:
    data = json.load(open(path))
    fwd, step = measured(data["forward"]["ops"]), measured(data["step"]["ops"])
    bwd = {k: step[k] - 2 * fwd[k] for k in fwd}  # less the forward and its recompute
    syn = synthesized()
    print(f"{'ms':24s} {'measured':>9s} {'synthesized':>12s}")
    for k in fwd:
        print(f"forward {k:16s} {fwd[k]:9.3f} {syn['forward'][k]:12.3f}")
    for k in bwd:
        print(f"backward {k:15s} {bwd[k]:9.3f} {syn['backward'][k]:12.3f}")
    print(f"backward recompute       {sum(fwd.values()):9.3f} {syn['backward']['recompute']:12.3f}")
    print(f"step                     {sum(step.values()):9.3f} "
          f"{sum(syn['forward'].values()) + sum(syn['backward'].values()):12.3f}")


if __name__ == "__main__":
    main(sys.argv[1])
