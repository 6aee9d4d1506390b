"""host_steps.py's measured host beside the synthesized step's, on a CPU: each run's forward and
backward host time, the synthesized one with offload's hooks taken off as a bound step runs
(plain_host_factor), and the simulated all-resident step.

    python benchmarks/results/host-pace-2026-11-30/compare.py RUN.json...
"""
import json
import sys
from pathlib import Path

from hydra import compose, initialize_config_module

from engine.config import register
from engine.modules.synthesize import synthesize_module
from engine.validation.report import predict

RESIDENT = {"budget_mb": None, "eviction": "priority", "lookahead": 2, "activations": {"mode": "off"},
            "kind": "train_lora"}


def main(paths: list[str]) -> None:
    register()
    print(f"{'run (its lease)':78s} {'host fwd':>9s} {'syn':>7s} {'host bwd':>9s} {'syn':>7s} {'step':>7s} {'sim':>7s}")
    for path in paths:
        run = json.load(open(path))
        with initialize_config_module(config_module="conf", version_base="1.3"):
            cfg = compose(config_name="config", overrides=[f"model={run['model']}", "workload=train_lora",
                                                           "workload.checkpointing=true", "hardware=h200",
                                                           *run["overrides"]])
        trace = synthesize_module(cfg.model, cfg.workload, cfg.hardware)
        plain = trace.header["plain_host_factor"]
        fwd = sum(r.host_ns for r in trace.records if r.phase == "fwd") * plain / 1e6
        bwd = sum(r.host_ns for r in trace.records if r.phase == "bwd") * plain / 1e6
        sim = predict(trace, RESIDENT, cfg.hardware, "mmap_registered")["step_ms"]
        m = run["median"]
        label = f"{run['model']} {' '.join(run['overrides'])} ({Path(path).parent.name})"
        print(f"{label:78s} {m['host_fwd_ms']:9.2f} {fwd:7.2f} "
              f"{m['host_bwd_ms']:9.2f} {bwd:7.2f} {m['step_ms']:7.2f} {sim:7.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
