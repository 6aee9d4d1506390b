"""The spec-built models run on the device, for mode=execute and mode=materialize
(engine/modes/execute.py prints them beside the prediction).

    run_execute         workload.steps forwards, the weights streamed from the weight file
                        through the executor; every step's outputs compared bitwise with
                        the all-resident forward when the model fits (resident_outcomes)
    run_train_execute   workload=train_lora: LoRA training steps (engine/executor/training.py),
                        activations spilled by the activation offloader; losses and
                        gradients compared with all-resident steps when they fit
    run_materialize     random weights written to a weight file
"""
from __future__ import annotations

import json
import logging
import math
import statistics
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.errors import ExecutorError
from engine.executor.offloader import ActivationOffloader
from engine.executor.setup import (bitwise_equal, compute_device, end_of_step, fits_resident, open_weight_file,
                                   run_settings, step_times, streamed_executor, weight_counts)
from engine.executor.training import (HOOK_FIELDS, AsManaged, StreamedWeights, check_train_order, match_reference,
                                      max_abs_diff, reference_steps, telemetry_row, to_host, train_step)
from engine.measure.clocks import clock_for
from engine.measure.timing import KernelStamps
from engine.models import forward, make_inputs
from engine.models.lora import init_lora
from engine.models.run import DictSource
from engine.models.spec import ModelSpec
from engine.policy import AccessOrder
from engine.policy.activations import build_activation_policy
from engine.policy.weights import WeightResidency
from engine.units import budget_bytes
from engine.weightfile import materialize

log = logging.getLogger(__name__)

# All-resident forwards run again at most, to find the outcome a streamed step's outputs
# match when the first differs (resident_outcomes).
REFERENCE_RETRIES = 32


def run_materialize(cfg: Any, spec: ModelSpec, out_path: str | Path) -> dict:
    """Write random weights for `spec` (seed cfg.seed) to `out_path`; the GPU generates when there is one."""
    path = materialize(spec, out_path, seed=cfg.seed)
    return {"weights_file": str(path), "model": spec.name, "model_bytes": spec.model_bytes,
            "weights": len(spec.weights), "seed": cfg.seed}


def _start_run(cfg: Any, order: AccessOrder, out_dir: str | Path) -> tuple[int | None, int, Path]:
    """The budget in bytes, the floor, and the output directory (made). The floor
    first: a budget under it fails before any file or device memory is touched."""
    w = cfg.weights
    budget = budget_bytes(cfg.budget)
    floor_bytes = WeightResidency(order, budget, w.eviction, w.lookahead).floor.bytes
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return budget, floor_bytes, out_dir


def _write_telemetry(out_dir: Path, rows: list[dict]) -> None:
    with open(out_dir / "telemetry.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def _check_order(order: AccessOrder, spec: ModelSpec) -> None:
    """The trace must be this spec's forward: same kernels, same weights."""
    if len(order) != len(spec.kernels):
        raise ExecutorError(f"the trace has {len(order)} kernels but model {spec.name} runs {len(spec.kernels)} "
                            "per forward; execute runs inference: use workload=infer and a matching trace")
    for i, k in enumerate(spec.kernels):
        if order.kernels[i] != k.name or tuple(order.reads[i]) != tuple(k.weights):
            raise ExecutorError(f"schedule divergence at kernel position {i}: the trace has {order.kernels[i]}, "
                                f"the model runs {k.name}; record or synthesize the trace for this model")


def _reference(spec: ModelSpec, host: dict, inputs: dict, device: torch.device) -> dict | None:
    """The all-resident forward's outputs, or None when the model does not fit beside the pool."""
    if device.type == "cuda" and not fits_resident(spec.model_bytes, device):
        log.info("the model does not fit on the device all resident: no bitwise reference")
        return None
    weights = {n: t.to(device, copy=True) for n, t in host.items()}
    with torch.no_grad():
        out = forward(spec, DictSource(spec, weights), inputs)
    del weights
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the pool is not torch's: give the reference's memory back
    return out


@dataclass(frozen=True)
class ResidentOutcomes:
    """How a run's outputs compare with the all-resident forward's: `match` (each bitwise one of
    its outcomes, or, where it has several, within their `spread`), `bitwise`, and how many
    different outcomes it gave."""

    match: bool
    bitwise: bool
    count: int
    spread: float


def allocated(device: torch.device) -> int:
    """The bytes torch's allocator holds for tensors on `device` (0 off CUDA)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def outputs_max_diff(a: dict, b: dict) -> float:
    """The largest elementwise |a - b| over two forwards' outputs (inf where a shape differs)."""
    diffs = [(a[k].float() - b[k].float()).abs().max().item() if a[k].shape == b[k].shape else math.inf for k in b]
    return max(diffs, default=0.0)


def resident_outcomes(spec: ModelSpec, host: dict, inputs: dict, device: torch.device, reference: dict,
                      outputs: list[dict], tries: int) -> ResidentOutcomes:
    """Compare `outputs` with the all-resident forward. A forward whose own kernels are not
    deterministic (spec Llama decode's logits: two to four outcomes) is run again, up to
    `tries` times, only while some output matches none seen yet; an output still unmatched
    then passes when it lies within the outcomes' own spread (their largest difference),
    since a finite sample of a non-deterministic forward need not hold every outcome."""
    outcomes = [reference]

    def seen(out: dict) -> bool:
        return any(all(bitwise_equal(out[k], ref[k]) for k in ref) for ref in outcomes)

    pending = [o for o in outputs if not seen(o)]
    if pending:
        weights = {n: t.to(device, copy=True) for n, t in host.items()}
        with torch.no_grad():
            for _ in range(tries):
                out = forward(spec, DictSource(spec, weights), inputs)
                if not seen(out):
                    outcomes.append(out)
                    pending = [o for o in pending if not seen(o)]
                if not pending:
                    break
        del weights
    spread = max((outputs_max_diff(x, y) for i, x in enumerate(outcomes) for y in outcomes[:i]), default=0.0)
    within = all(min(outputs_max_diff(o, ref) for ref in outcomes) <= spread for o in pending) if spread > 0 else False
    return ResidentOutcomes(match=not pending or within, bitwise=not pending, count=len(outcomes), spread=spread)


def run_execute(cfg: Any, spec: ModelSpec, trace: Any, out_dir: str | Path) -> dict:
    """Run cfg.workload.steps forwards through the executor; write telemetry.jsonl; return the measurement."""
    w = cfg.weights
    device = compute_device(w.backend, replica=True)
    order = trace.access_order()
    _check_order(order, spec)
    budget, floor_bytes, out_dir = _start_run(cfg, order, out_dir)
    with ExitStack() as stack:
        wf = open_weight_file(cfg, spec, stack)
        inputs = make_inputs(spec, cfg.workload, device, seed=cfg.seed)
        cuda = device.type == "cuda"
        # Torch's peak within each step, less what the run keeps to compare (the reference's
        # outputs, the earlier steps'), which a deployment does not: the bytes each holds are
        # what torch's allocator counts for it (its blocks, rounded).
        kept = -allocated(device)
        reference = _reference(spec, wf.tensors(), inputs, device)
        kept += allocated(device)
        with ExitStack() as run:  # the executor and its pool, given back before any rerun of the reference
            executor = streamed_executor(run, wf, order, backend=w.backend, source=w.source, budget_bytes=budget,
                                         eviction=w.eviction, lookahead=w.lookahead, keep_steps=None)
            outputs: list[dict] = []
            torch_peak = 0 if cuda else None
            with torch.no_grad():
                for i in range(cfg.workload.steps):
                    wf.check_intact()
                    before = allocated(device)
                    if cuda:
                        torch.cuda.reset_peak_memory_stats(device)
                    with executor.step(timed=i == cfg.workload.steps - 1):  # the steady state, on the timeline
                        outputs.append(forward(spec, executor, inputs))
                    if cuda:
                        torch_peak = max(torch_peak, torch.cuda.max_memory_allocated(device) - kept)
                    kept += allocated(device) - before
                    end_of_step(cfg.workload.loop, device, i)
            telemetry = executor.telemetry()  # waits for the last step
            timeline = executor.step_timeline()
            pool_cap = executor.backend.cap_bytes
            reserved_peak = executor.backend.reserved_peak_bytes()
        compared = None if reference is None else resident_outcomes(
            spec, wf.tensors(), inputs, device, reference, outputs, REFERENCE_RETRIES)
    _write_telemetry(out_dir, telemetry)
    last = telemetry[-1]
    return {
        **run_settings(w),
        "budget_bytes": budget,
        "floor_bytes": floor_bytes,
        "pool_cap_bytes": pool_cap,
        "pool_reserved_peak_bytes": reserved_peak,
        **step_times(telemetry),
        "h2d_bytes": last["h2d_bytes"],
        **weight_counts(last),
        # Pool refusals under the budget (fragmentation): answered by releasing the pool's
        # unused reserve, or else by copying the resident weights in again; the simulator
        # models neither.
        "reserve_releases": sum(row["reserve_releases"] for row in telemetry),
        "relocations": sum(row["relocations"] for row in telemetry),
        # those in the steps the median step is taken over: their stalls are in it
        "warm_relocations": sum(row["relocations"] for row in telemetry[1:]),
        "peak_device_bytes": max(row["peak_device_bytes"] for row in telemetry),
        "peak_pool_torch_bytes": None if torch_peak is None else
        max(row["held_device_bytes"] for row in telemetry) + torch_peak,
        "peak_torch_bytes": torch_peak,  # torch's allocator's part: activations, outputs, inputs
        "peak_resident_bytes": max(row["peak_resident_bytes"] for row in telemetry),
        "outputs_match_reference": None if compared is None else compared.match,
        "outputs_bitwise": None if compared is None else compared.bitwise,
        "reference_outcomes": 0 if compared is None else compared.count,
        "reference_outcomes_spread": None if compared is None else compared.spread,
        "weights_file": w.file,  # None: a temporary file, gone now
        "timeline": timeline,
    }


def run_train_execute(cfg: Any, spec: ModelSpec, trace: Any, out_dir: str | Path) -> dict:
    """Run cfg.workload.steps LoRA training steps; write telemetry.jsonl; return the measurement.

    When the model and its saved activations fit the device beside nothing else,
    the same steps run first with every weight resident and no hooks, and every
    step's loss and gradients are compared with that reference."""
    w, act = cfg.weights, cfg.activations
    if cfg.workload.kind != "train_lora" or cfg.workload.lora_rank < 1:
        raise ExecutorError(f"training execute needs workload.kind=train_lora with lora_rank >= 1 (got "
                            f"{cfg.workload.kind}, rank {cfg.workload.lora_rank}); use workload=train_lora")
    device = compute_device(w.backend, replica=True)
    order = trace.access_order()
    check_train_order(order, spec)
    budget, floor_bytes, out_dir = _start_run(cfg, order, out_dir)
    policy = build_activation_policy(act, spec.num_layers)  # a bad activations config fails here too
    saved_bytes = sum(s.nbytes for r in trace.records for s in r.saved)
    steps = cfg.workload.steps
    with ExitStack() as stack:
        wf = open_weight_file(cfg, spec, stack)
        inputs = make_inputs(spec, cfg.workload, device, seed=cfg.seed)
        lora = init_lora(spec, cfg.workload.lora_rank, device=device, seed=cfg.seed + 1)
        compare = fits_resident(spec.model_bytes + saved_bytes, device)
        # The kernels run as a training script (and mode=record) runs them, not torch's
        # deterministic ones, whose time differs; a second reference run measures the spread.
        reference = reference_steps(spec, wf.tensors(), inputs, lora, steps, device) if compare else None
        spread = None
        if reference is not None and device.type == "cuda":
            # Some CUDA kernels (cuDNN's attention backward) are not deterministic: a second
            # reference run measures that spread, so a difference within it is not called wrong.
            spread = max_abs_diff(reference, reference_steps(spec, wf.tensors(), inputs, lora, steps, device))
        executor = streamed_executor(stack, wf, order, backend=w.backend, source=w.source, budget_bytes=budget,
                                     eviction=w.eviction, lookahead=w.lookahead, keep_steps=None)
        streamed = StreamedWeights(executor, len(spec.kernels))
        offloader = None
        if policy is not None:
            offloader = ActivationOffloader(policy, act, device, weights=AsManaged(streamed), keep_steps=None)
            stack.callback(offloader.close)
        results, peaks = [], []
        # The last step's waits on streamed weights, stamped around each fetch, forward and backward.
        stamps = KernelStamps(executor, clock_for(device)) if budget is not None else None
        for i in range(steps):
            wf.check_intact()
            last = i == steps - 1
            executor.time_steps = last  # the steady state, on the timeline
            with streamed.fetches_through(stamps if last else None):
                results.append(to_host(train_step(spec, executor, streamed, offloader, inputs, lora, device)))
            end_of_step(cfg.workload.loop, device, i)
            peaks.append(torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)
        weight_rows = executor.telemetry()  # waits for the last step
        weight_stall = stamps.stall_ms() if stamps is not None else 0.0
        timeline = executor.step_timeline()
        act_rows = offloader.telemetry() if offloader is not None else [None] * steps
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the results' copies to the host have landed
    rows = [telemetry_row(wr, ar, peak) for wr, ar, peak in zip(weight_rows, act_rows, peaks)]
    _write_telemetry(out_dir, rows)
    losses = grads = None
    if reference is not None:
        losses, grads = match_reference(results, reference, spread)
    last = rows[-1]
    return {
        **run_settings(w),
        "activations": act.mode,
        "budget_bytes": budget,
        "floor_bytes": floor_bytes,
        **step_times(rows),
        # The simulator's h2d_bytes counts every host-to-device copy: weights and activation restores.
        "h2d_bytes": last["weight_h2d_bytes"] + last["restore_bytes"],
        "weight_h2d_bytes": last["weight_h2d_bytes"],
        "reserve_releases": sum(r["weight_reserve_releases"] for r in rows),
        "relocations": sum(r["weight_relocations"] for r in rows),
        "warm_relocations": sum(r["weight_relocations"] for r in rows[1:]),
        **weight_counts(last, "weight_"),
        "peak_device_bytes": max(r["peak_device_bytes"] for r in rows),
        # On CUDA a row's held bytes are the weights' plus torch's allocator's peak (telemetry_row).
        "peak_pool_torch_bytes": max(r["held_device_bytes"] for r in rows) if device.type == "cuda" else None,
        "spill_bytes": last["spill_bytes"],
        "restore_bytes": last["restore_bytes"],
        "pool_hits": last["pool_hits"],
        "pool_misses": last["pool_misses"],
        # The compute stream's waits on copies, as the simulator's: the activation restores' (the
        # median of the steps after the first) and the streamed weights' (the last step's).
        "stall_ms": statistics.median(r["stall_time_ms"] for r in rows[1:] or rows) + weight_stall,
        "weight_stall_ms": weight_stall,
        # The offloader's hooks, host us a call (median over the steps after the first).
        **({k: statistics.median(r[k] for r in rows[1:] or rows) for k in HOOK_FIELDS} if offloader is not None
           else {}),
        "loss_match_reference": losses,
        "grads_match_reference": grads,
        "weights_file": w.file,  # None: a temporary file, gone now
        "reference_spread": spread,  # 0 or None: compared bitwise
        "timeline": timeline,
    }
