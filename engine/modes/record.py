"""mode=record: one step on the GPU, timed kernel by kernel -> trace.jsonl (engine/measure/)."""
from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from engine.executor.setup import compute_device, device_memory_mb, device_name, fits_resident, open_weight_file
from engine.compute import slowdown_under_copy, sustained_slowdown
from engine.job import Job, Outcome, config_summary
from engine.models import make_inputs
from engine.models.lora import init_lora
from engine.models.run import DictSource
from engine.measure.clocks import clock_for
from engine.measure.compute import probe_compute
from engine.measure.probes import (copy_stream_beside, probe_copies, probe_vmm, resident_steps,
                                   streamed_forward)
from engine.measure.timing import TIMED_STEPS, build_trace, count_launches, host_scale, time_steps
from engine.report import launches_cell, table
from engine.models.spec import ModelSpec
from engine.trace import Trace, host_bound, write_trace
from engine.units import budget_bytes

log = logging.getLogger(__name__)

NO_CUDA = ("mode=record needs a CUDA GPU and none is visible; predict without one with "
           "mode=simulate (or weights.backend=cpu to exercise the recorder on the CPU)")


def record_mode(job: Job) -> Outcome:
    if job.spec is None:  # a real module (engine/modules)
        from engine.modes.module import record_module_mode

        return record_module_mode(job)
    path, trace = record(job.cfg, job.spec, job.out_dir)
    h = trace.header
    probes = h["probes"]
    rows = [["trace", str(path)], ["records", f"{len(trace.records):,}"],
            ["step (GPU, resident)", f"{h['step_ns'] / 1e6:.3f} ms"],
            ["kernel compute, sum", f"{sum(r.compute_ns for r in trace.records) / 1e6:.3f} ms"],
            ["saved for backward", f"{sum(s.nbytes for r in trace.records for s in r.saved) / 1e9:.3f} GB"],
            ["weight copies observed", f"{sum(len(r.copies) for r in trace.records):,}"],
            ["CUDA launches a step", launches_cell([r.launches for r in trace.records])],
            ["device", f"{h['device']} (torch {h['torch']}, CUDA {h['cuda']})"]]
    if "compute_under_copy" in probes:
        c = probes["compute_under_copy"]
        rows.append(["step beside H2D copies", f"{c['with_copy_ns'] / 1e6:.3f} ms"])
    md = f"## Recorded {h['model']} ({job.cfg.workload.name})\n\n" + table(["what", "value"], rows)
    report = {"config": config_summary(job), "trace": str(path), "records": len(trace.records),
              "step_ns": h["step_ns"], "device": h["device"]}
    return Outcome(report, md + f"\n\nreplay it: python -m engine +model=... trace={path}")


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def record(cfg: Any, spec: ModelSpec, out_dir: str | Path) -> tuple[Path, Trace]:
    """Record one step of `spec` under cfg.workload; writes out_dir/trace.jsonl."""
    device = compute_device(cfg.weights.backend, no_cuda=NO_CUDA, replica=True)
    clock = clock_for(device)
    training = cfg.workload.kind == "train_lora"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        wf = open_weight_file(cfg, spec, stack)
        weights = {n: t.to(device, copy=True) for n, t in wf.tensors().items()}
        inputs = make_inputs(spec, cfg.workload, device, seed=cfg.seed)
        lora = init_lora(spec, cfg.workload.lora_rank, device=device, seed=cfg.seed + 1) if training else None
        source = DictSource(spec, weights)
        timing = time_steps(spec, source, inputs, clock, lora=lora)
        counted = count_launches(spec, source, inputs, clock, lora=lora)
        if counted is not None:
            timing = replace(timing, launches=counted.forward, backward_launches=counted.backward)
        log.info("recorded %s: step %.3f ms", spec.name, timing.step_ns / 1e6)
        probes: dict[str, Any] = {"host": {"resident_fetch_ns": timing.fetch_ns}}
        if timing.backward_host_ns is not None:
            probes["host"]["backward_kernel_ns"] = timing.backward_host_ns
        if device.type == "cuda":  # held; a GPU-bound step's at the pipelined pace below
            beside = time_steps(spec, source, inputs, clock, lora=lora, warmup=1, steps=3,
                                beside=copy_stream_beside(timing.step_ns, device))
            probes["compute_under_copy"] = {"alone_ns": timing.step_ns, "with_copy_ns": beside.step_ns}
        del weights, source
        if device.type == "cuda":
            torch.cuda.empty_cache()
        pipelined = None
        if fits_resident(spec.model_bytes + sum(sum(v) for v in timing.saved.values()), device):
            resident = resident_steps(spec, wf, inputs, cfg, clock, lora)
            pipelined = resident.step_ns
            if resident.host_ns is not None:  # the executor's host work, not the stamped steps'
                timing = replace(timing, host_ns=resident.host_ns)
                probes["host"]["kernel_stream"] = "held"
            if resident.under_copy is not None and not host_bound(timing.step_ns, pipelined):
                probes["compute_under_copy"] = dict(zip(("alone_ns", "with_copy_ns"), resident.under_copy))
        probes["host"]["kernel_ns"] = timing.host_ns
        # The cpu backend's clock times the host itself: its kernel times already hold it.
        scale = host_scale(spec, timing, pipelined) if device.type == "cuda" else 1.0
        budget = budget_bytes(cfg.budget)
        copies, fetch, alloc_ns = streamed_forward(spec, wf, inputs, cfg, clock, budget)
        probes["host"]["fetch"] = fetch
        probes["alloc_ns"] = alloc_ns
        probes["weight_source"] = cfg.weights.source
        copied = [c for cs in copies.values() for c in cs]
        probes["weight_gbps"] = (sum(c["nbytes"] for c in copied) / max(1, sum(c["ns"] for c in copied))
                                 if copied else None)
        if device.type == "cuda":
            probes["copies"], probes["duplex"] = probe_copies(device)
            probes["vmm"] = probe_vmm(device)
            # A training recording also probes attention as a training step runs it.
            probes["compute"] = probe_compute(device, training=cfg.workload.kind == "train_lora")
        header = {
            "model": spec.name, "num_layers": spec.num_layers, "workload": _plain(cfg.workload),
            "hardware": cfg.hardware.name, "device": device_name(device),
            "device_memory_mb": device_memory_mb(device), "torch": torch.__version__,
            "cuda": torch.version.cuda if device.type == "cuda" else None,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "clock": "cuda events" if device.type == "cuda" else "perf_counter (cpu backend)",
            "timed_steps": TIMED_STEPS, "step_ns": timing.step_ns,
            "pipelined_step_ns": pipelined, "host_scale": round(scale, 6),
            **({"compute_slowdown_under_copy": round(slowdown_under_copy(**probes["compute_under_copy"]), 4)}
               if "compute_under_copy" in probes else {}),
            # A GPU-bound inference's kernels run slower back to back than held (the clocks under
            # load). A training step's pipelined run also updates its adapters and waits on the
            # host's backward: not the kernels' pace.
            **({"compute_sustained_slowdown": round(sustained_slowdown(timing.step_ns, pipelined), 4)}
               if pipelined is not None and not training and not host_bound(timing.step_ns, pipelined) else {}),
            "streamed": {"budget_bytes": budget, "eviction": cfg.weights.eviction,
                         "lookahead": cfg.weights.lookahead, "source": cfg.weights.source},
            "probes": probes,
        }
    trace = build_trace(spec, timing, header, copies, scale)
    path = out_dir / "trace.jsonl"
    write_trace(path, trace)
    return path, trace
