"""How far a LoRA step's host runs ahead of the GPU, without a profiler: measured against simulated.

    python benchmarks/train_lead.py --rows "off,sync-2,watermark-0.8" -- +model=ltx model.num_layers=8 \\
        workload=train_lora workload.video_tokens=16384 trace=data/traces/ltx2_train_lora.jsonl.gz

On a CUDA machine: the spec's weights random on the device, each of `--rows` (the training rows
of mode=validate: off, watermark-0.8, watermark-0.6, sync-2, sync-3) run as mode=validate
measures it, --steps steps. In the last step the host stamps each record as it starts it:
perf_counter, a CUDA event (which the GPU passes once it has run everything launched before)
and torch's allocated bytes (the caching allocator hands memory out at the host's pace).
Forward records are stamped at their weight fetch, backward ones where autograd fetches a
frozen weight again through the offloader (the first of each kernel's), or without one where
it first unpacks a tensor the kernel saved. From the stamps, per record: how many
records the host had launched that the GPU had not reached (its lead), and the allocated
bytes, the step's peak and where it fell; the simulator's run of the same trace and row gives
the same figures from its own host and compute tracks. Writes OUT/train_lead.json; prints a
table last.
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def lead(host: list[float], gpu: list[float]) -> list[int]:
    """At each record's host stamp: records stamped so far whose GPU stamp is later (not yet reached)."""
    reached = sorted(gpu)
    return [i + 1 - bisect.bisect_right(reached, h) for i, h in enumerate(host)]


def simulated(trace: Any, row: dict, hardware: Any) -> dict:
    from engine.config import WeightsConfig
    from engine.validation import activations_config
    from sim import simulate

    act = activations_config(row["activations"], trace)
    r = simulate(trace, WeightsConfig(eviction="belady", lookahead=1), act, hardware, None, 3, allow_below_floor=False)
    n = len(trace.records)
    s0 = r.step_ends_ns[-2]
    host = [t for t, track, what in r.events if track == "host" and what.startswith("start ")][-n:]
    gpu = [t for t, track, what in r.events if track == "compute" and what.startswith("start ")][-n:]
    times = [t for t, _ in r.device_bytes]
    peak_t, peak = max(((t, b) for t, b in r.device_bytes if t >= s0), key=lambda z: z[1])
    at = bisect.bisect_right(host, peak_t) - 1
    return {"lead": lead([h - s0 for h in host], [g - s0 for g in gpu]), "peak_bytes": peak,
            "peak_at_record": at, "peak_ms": (peak_t - s0) / 1e6, "step_ms": r.prediction["step_ms"],
            "bytes_at_host": [r.device_bytes[max(0, bisect.bisect_right(times, h) - 1)][1] for h in host]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="off,sync-2,watermark-0.8")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    import torch
    from hydra import compose, initialize_config_dir

    from engine.config import load_hardware, register
    from engine.executor.model_hooks import ResidentWeights
    from engine.executor.offloader import ActivationOffloader
    from engine.executor.training import lora_step
    from engine.job import prepare
    from engine.models import make_inputs
    from engine.models.lora import init_lora
    from engine.models.run import TORCH_DTYPES, DictSource
    from engine.policy.activations import build_activation_policy
    from engine.config import hardware_of
    from engine.validation import activations_config, grid

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[o.removeprefix("+") if o.startswith("+model=") else o
                                           for o in args.overrides])
    job = prepare(cfg, Path("/tmp/train-lead"))
    spec, trace = job.spec, job.trace
    device = torch.device("cuda")
    weights = {n: torch.randn(w.shape, dtype=TORCH_DTYPES[w.dtype], device=device) * 0.02
               for n, w in spec.weights.items()}
    inputs = make_inputs(spec, cfg.workload, device, seed=cfg.seed)
    lora = init_lora(spec, cfg.workload.lora_rank, device=device, seed=cfg.seed + 1)
    first_reader = {}
    for i, k in enumerate(spec.kernels):
        for w in k.weights:
            first_reader.setdefault(w, i)
    n = len(spec.kernels)
    hardware = hardware_of(load_hardware(cfg.hardware.name))
    rows = {r["id"].removeprefix("train "): r for r in grid(trace)}
    stamps: list[tuple[int, int, Any, int]] = []  # (position, perf_counter ns, event, allocated bytes)
    seen: set[int] = set()

    def stamp(position: int) -> None:
        if position in seen:
            return
        seen.add(position)
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        stamps.append((position, time.perf_counter_ns(), e, torch.cuda.memory_allocated(device)))

    current = [0]

    class Stamped(DictSource):
        def fetch(self, i: int) -> Any:
            stamp(i)
            current[0] = i
            return super().fetch(i)

    def pack(t: Any) -> tuple[int, Any]:  # without an offloader: the backward stamped at each first unpack
        return current[0], t

    def unpack(packed: tuple[int, Any]) -> Any:
        stamp(2 * n - 1 - packed[0])
        return packed[1]

    class StampedWeights(ResidentWeights):
        def fetch(self, handle: Any) -> Any:
            stamp(2 * n - 1 - first_reader[handle[0]])  # the backward record mirroring its first reader
            return super().fetch(handle)

    out = []
    for name in args.rows.split(","):
        row = rows[name]
        act = activations_config(row["activations"], trace)
        offloader = None
        if act is not None:
            offloader = ActivationOffloader(build_activation_policy(act, spec.num_layers), act, device,
                                            weights=StampedWeights(weights), keep_steps=None)
        for step in range(args.steps):
            last = step == args.steps - 1
            stamps.clear()
            seen.clear()
            for t in lora.values():
                t.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter_ns()
            e0 = torch.cuda.Event(enable_timing=True)
            e0.record()
            source = Stamped(spec, weights) if last else DictSource(spec, weights)
            if offloader is not None:
                with offloader.step():
                    lora_step(spec, source, inputs, lora, offloader)
            else:
                with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                    lora_step(spec, source, inputs, lora)
            e1 = torch.cuda.Event(enable_timing=True)
            e1.record()
            torch.cuda.synchronize()
        peak = spec.model_bytes + torch.cuda.max_memory_allocated(device)
        stamps.sort(key=lambda s: s[1])
        host = [(h - t0) / 1e6 for _, h, _, _ in stamps]
        gpu = [e0.elapsed_time(e) for _, _, e, _ in stamps]
        measured_lead = lead(host, gpu)
        alloc = [spec.model_bytes + b for _, _, _, b in stamps]
        at = max(range(len(alloc)), key=alloc.__getitem__)
        first_bwd = next(i for i, s in enumerate(stamps) if s[0] >= n)
        sim = simulated(trace, row, hardware)
        half = len(sim["lead"]) // 2
        res = {"row": name, "step_ms": e0.elapsed_time(e1), "peak_bytes": peak, "stamped": len(stamps),
               "lead_forward_median": statistics.median(measured_lead[:first_bwd]),
               "lead_forward_max": max(measured_lead[:first_bwd]),
               "lead_at_backward_start": measured_lead[first_bwd],
               "lead_backward_median": statistics.median(measured_lead[first_bwd:]),
               "allocated_peak_at": [stamps[at][0], host[at]],
               "host_forward_ms": host[first_bwd], "gpu_forward_ms": gpu[first_bwd],
               "sim": {"step_ms": sim["step_ms"], "peak_bytes": sim["peak_bytes"],
                       "lead_forward_median": statistics.median(sim["lead"][:half]),
                       "lead_at_backward_start": sim["lead"][half],
                       "lead_backward_median": statistics.median(sim["lead"][half:]),
                       "peak_at_record": sim["peak_at_record"], "peak_ms": sim["peak_ms"]},
               "measured_lead": measured_lead, "positions": [s[0] for s in stamps], "host_ms": host, "gpu_ms": gpu,
               "allocated": alloc}
        out.append(res)
        if offloader is not None:
            offloader.close()
        print(f"{name}: step {res['step_ms']:.1f} ms (sim {sim['step_ms']:.1f}), peak {peak / 1e9:.3f} GB "
              f"(sim {sim['peak_bytes'] / 1e9:.3f}); lead fwd median {res['lead_forward_median']} "
              f"(sim {res['sim']['lead_forward_median']}), at bwd start {res['lead_at_backward_start']} "
              f"(sim {res['sim']['lead_at_backward_start']}), bwd median {res['lead_backward_median']} "
              f"(sim {res['sim']['lead_backward_median']}); host fwd {res['host_forward_ms']:.1f} ms, "
              f"gpu fwd {res['gpu_forward_ms']:.1f} ms; allocated peak at record {stamps[at][0]} "
              f"(sim's peak at {sim['peak_at_record']})", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "train_lead.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
