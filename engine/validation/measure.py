"""mode=validate's measured side on the device: a spec model's rows through the spec executor
(`measure`), the timing loop a real module's rows run too (`time_inference_row`), the measured row
and the measurements file's header."""
from __future__ import annotations

import itertools
import statistics
from contextlib import ExitStack, nullcontext
from datetime import datetime, timezone
from typing import Any, Callable, Sequence

from engine.errors import ConfigError
from engine.measure.spread import enough
from engine.trace import Trace
from engine.units import MB
from engine.validation.grid import (MAX_TIMED_STEPS, SETTLE_MS, STALL_STEPS, TIMED_STEPS, activations_config, row_bytes,
                                    saved_bytes)
from engine.validation.report import MEASUREMENTS, POOL_EVENTS

NO_CUDA = ("mode=validate needs a CUDA GPU to measure and none is visible; put the measurements beside "
           "the trace (X.measurements.json) to validate without one")


def measure(cfg: Any, spec: Any, trace: Trace, rows: Sequence[dict]) -> dict:
    """Run every configuration that fits the device (`row_bytes`) on the GPU; the
    measurements JSON (the package docstring), the others listed under "skipped"."""
    from engine.executor.setup import compute_device, open_weight_file, shared_host_weights
    from engine.models import make_inputs
    from engine.measure.clocks import clock_for

    device = compute_device(cfg.weights.backend, no_cuda=NO_CUDA, replica=True)
    clock = clock_for(device)
    rows, skipped = fitting(rows, trace, device)
    out = []
    with ExitStack() as stack:
        wf = open_weight_file(cfg, spec, stack)
        inputs = make_inputs(spec, cfg.workload, device, seed=cfg.seed)
        host = None  # registered for DMA once, not once a row (seconds for a whole model)
        if any(_streams(row) for row in rows):
            host = shared_host_weights(stack, wf, cfg.weights.source, cfg.weights.backend)
        for row in rows:
            if row["kind"] == "infer":
                meas = _measure_streamed(spec, trace, wf, host, inputs, row, cfg.weights, clock)
            else:
                meas = _measure_training(spec, trace, wf, host, inputs, row, cfg, device, clock)
            out.append(measured_row(row, meas))
    return {**measurements_header(spec.name, spec.num_layers, trace, device, cfg.weights, "pool"),
            "rows": out, "skipped": skipped}


def _streams(row: dict) -> bool:
    """Whether a row's weights go through a WeightExecutor (else a training step holds them all)."""
    return row["kind"] == "infer" or row["budget_mb"] is not None


def fitting(rows: Sequence[dict], trace: Trace, device: Any) -> tuple[list[dict], list[str]]:
    """The grid's rows that fit the device beside a run (`row_bytes`), and the ids of those
    that do not (each said on stdout); none fitting is a ConfigError."""
    from engine.executor.setup import fits_resident

    model_bytes = sum(trace.weight_sizes.values())
    saved = saved_bytes(trace)
    held = {row["id"]: row_bytes(row, model_bytes, saved) for row in rows}
    skipped = [row["id"] for row in rows if not fits_resident(held[row["id"]], device)]
    if len(skipped) == len(rows):
        raise ConfigError(f"mode=validate: no configuration of the grid fits this device (the smallest holds "
                          f"{min(held.values()) / 1e9:.2f} GB); validate on a device with more memory")
    for row_id in skipped:
        print(f"  skipped {row_id}: {held[row_id] / 1e9:.2f} GB on the device would leave no room for a run",
              flush=True)
    return [row for row in rows if row["id"] not in skipped], skipped


def measured_row(row: dict, meas: dict) -> dict:
    """A grid row with its measurement, said on stdout as it lands."""
    stall = "" if meas["stall_ms"] is None else f", stall {meas['stall_ms']:.2f} ms"
    print(f"  measured {row['id']}: step {meas['step_ms']:.2f} ms{stall}, "
          f"peak {meas['peak_device_bytes'] / 1e9:.3f} GB", flush=True)
    return {**row, "measured": meas}


def measurements_header(model: str, num_layers: int | None, trace: Trace, device: Any, weights: Any,
                        peak: str) -> dict:
    """A measurements file's keys but its rows: what was measured, where and how, and the
    link's rates there (`link_rates`)."""
    import torch

    from engine.executor.setup import device_name

    return {"format": MEASUREMENTS, "version": 1, "model": model, "num_layers": num_layers,
            "workload": trace.header.get("workload"), "device": device_name(device), "torch": torch.__version__,
            "cuda": torch.version.cuda if device.type == "cuda" else None, "source": weights.source,
            "backend": weights.backend, "peak": peak,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "min_timed_steps": TIMED_STEPS,
            "link": link_rates(device)}


def link_rates(device: Any) -> dict | None:
    """The link's pinned copy rates on `device` now, GB/s each way (the largest probe copy's,
    as calibrate fits h2d_gbps): a profile's rates come from another lease, and link-bound
    rows move with the difference. None off a GPU."""
    if device.type != "cuda":
        return None
    from engine.calibrate import copy_rates
    from engine.measure.probes import probe_copies

    copies, _ = probe_copies(device)
    rates = {d: copy_rates([copies], d) for d in ("h2d", "d2h")}
    return {f"{d}_gbps": round(r[max(r)], 3) for d, r in rates.items()}


def timed_enough(times_ms: Sequence[float]) -> bool:
    """Whether the timed steps (after the warm-up) are enough: the package docstring's rule."""
    return enough(times_ms, min_steps=TIMED_STEPS, max_steps=MAX_TIMED_STEPS, max_total=SETTLE_MS)


def stamped_stall_ms(step: Callable[[Any], object], executor: Any, clock: Any) -> float:
    """A streamed training row's stall: the compute stream's waits on weight copies, forward and
    backward, timed by KernelStamps around `executor` in STALL_STEPS steps after the timed ones,
    `step(stamps)` running one to its end with its fetches through them (the median, ms)."""
    from engine.measure.timing import KernelStamps

    stalls = []
    for _ in range(STALL_STEPS):
        stamps = KernelStamps(executor, clock)
        step(stamps)
        stamps.close()
        stalls.append(stamps.stall_ms())
    return statistics.median(stalls)


def time_synced_steps(step: Callable[[], tuple[float, int]]) -> tuple[list[float], list[int]]:
    """A training row's steps: `step()` runs one to its end and gives its ms and peak bytes,
    run after one warm-up until `timed_enough`; every step's (the warm-up's first)."""
    times: list[float] = []
    peaks: list[int] = []
    while len(times) < 1 + TIMED_STEPS or not timed_enough(times[1:]):
        ms, peak = step()
        times.append(ms)
        peaks.append(peak)
    return times, peaks


def _measure_streamed(spec: Any, trace: Trace, wf: Any, host: Any, inputs: dict, row: dict, weights_cfg: Any,
                      clock: Any) -> dict:
    from engine.executor.setup import streamed_executor
    from engine.models import forward

    budget = None if row["budget_mb"] is None else int(row["budget_mb"] * MB)
    with ExitStack() as stack:
        executor = streamed_executor(stack, wf, trace.access_order(), backend=weights_cfg.backend,
                                     source=weights_cfg.source, budget_bytes=budget, eviction=row["eviction"],
                                     lookahead=row["lookahead"], keep_steps=None, shared=host)

        def step(source: Any) -> None:
            with executor.step():
                forward(spec, source, inputs)
        steps, stalls = time_inference_row(step, executor, clock)
    return inference_measurement(steps, stalls, max(t["peak_device_bytes"] for t in steps))


def time_inference_row(step: Callable[[Any], None], executor: Any, clock: Any) -> tuple[list[dict], list[float]]:
    """An inference row's steps by the package docstring's rule, `step(source)` running one
    forward whose kernels fetch from `source` (`executor`, or KernelStamps around it in the
    STALL_STEPS stamped steps after the timed ones): the telemetry of the cold first step and
    of the timed ones, and the stamped steps' stalls (ms)."""
    import torch

    from engine.executor.setup import end_of_step
    from engine.measure.timing import KernelStamps

    stalls: list[float] = []
    done = itertools.count()

    def run(steps: int, stamped: bool = False) -> list[dict]:
        """`steps` more steps, free-running; their telemetry (which waits for them)."""
        stamps = []
        with torch.no_grad():
            for _ in range(steps):
                source = KernelStamps(executor, clock) if stamped else executor
                step(source)
                if stamped:
                    source.close()
                    stamps.append(source)
                end_of_step("free", clock.device, next(done))
        rows = executor.telemetry()[-steps:]
        stalls.extend(s.stall_ms() for s in stamps)  # read once the steps ended
        return rows

    cold, *timed = run(1 + TIMED_STEPS)
    while not timed_enough([t["step_ms"] for t in timed]):
        # The host waited to read the times: the next step starts on an idle GPU, a warm-up again.
        timed += run(1 + TIMED_STEPS)[1:]
    run(STALL_STEPS, stamped=True)
    return [cold, *timed], stalls


def inference_measurement(steps: Sequence[dict], stalls: Sequence[float], peak_bytes: int) -> dict:
    """A measured inference row from `time_inference_row`'s steps and stalls, and its peak."""
    cold, *timed = steps
    return {"step_ms": statistics.median(t["step_ms"] for t in timed), "first_step_ms": cold["step_ms"],
            "stall_ms": statistics.median(stalls), "peak_device_bytes": peak_bytes,
            "h2d_bytes": timed[-1]["h2d_bytes"], "steps_ms": [t["step_ms"] for t in steps],
            **{k: sum(t[k] for t in timed) for k in POOL_EVENTS}}


def _measure_training(spec: Any, trace: Trace, wf: Any, host: Any, inputs: dict, row: dict, cfg: Any,
                      device: Any, clock: Any) -> dict:
    """A LoRA step, synced, until timed enough after one warm-up: every weight resident
    (`_resident_training`) or its frozen weights streamed at the row's budget
    (`_streamed_training`)."""
    from engine.models.lora import init_lora

    lora = init_lora(spec, cfg.workload.lora_rank, device=device, seed=cfg.seed + 1)
    act = activations_config(row["activations"], trace)
    if row["budget_mb"] is None:
        return _resident_training(spec, wf, inputs, lora, act, device, clock)
    return _streamed_training(spec, trace, wf, host, inputs, lora, act, row, cfg.weights, device, clock)


def _resident_training(spec: Any, wf: Any, inputs: dict, lora: dict, act: Any, device: Any, clock: Any) -> dict:
    import torch

    from engine.executor.model_hooks import ResidentWeights
    from engine.executor.offloader import ActivationOffloader
    from engine.executor.training import HOOK_FIELDS, lora_step
    from engine.models.run import DictSource
    from engine.policy.activations import build_activation_policy

    weights = {n: t.to(device, copy=True) for n, t in wf.tensors().items()}
    offloader = None
    if act is not None:
        offloader = ActivationOffloader(build_activation_policy(act, spec.num_layers), act, device,
                                        weights=ResidentWeights(weights), keep_steps=None)

    def step() -> tuple[float, int]:
        for t in lora.values():
            t.grad = None
        clock.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        start = clock.stamp()
        with offloader.step() if offloader is not None else nullcontext():
            lora_step(spec, DictSource(spec, weights), inputs, lora, offloader)
        end = clock.stamp()
        clock.synchronize()
        return clock.ns(start, end) / 1e6, spec.model_bytes + torch.cuda.max_memory_allocated(device) - before

    try:
        times, peaks = time_synced_steps(step)
        rows = offloader.telemetry()[1:] if offloader is not None else []
        stall = [t["stall_time_ms"] for t in rows] or [0.0]
        # The offloader's hooks, host us a call: what the profile's offload_kernel_us,
        # pack_hook_us and unpack_hook_us are taken from.
        hooks = {k: statistics.median(t[k] for t in rows) for k in HOOK_FIELDS} if rows else {}
    finally:
        if offloader is not None:
            offloader.close()
        weights.clear()  # the device copies go before empty_cache
        torch.cuda.empty_cache()
    return {"step_ms": statistics.median(times[1:]), "first_step_ms": times[0],
            "stall_ms": statistics.median(stall), "peak_device_bytes": max(peaks[1:]), "steps_ms": times, **hooks}


def _streamed_training(spec: Any, trace: Trace, wf: Any, host: Any, inputs: dict, lora: dict, act: Any, row: dict,
                       weights_cfg: Any, device: Any, clock: Any) -> dict:
    """The frozen weights through a WeightExecutor at the row's budget, as `execute` trains:
    each step's time the executor's (its events around the step), its peak the pool's and
    torch's allocator's above what was allocated before the step; its stall
    `stamped_stall_ms`'s."""
    import torch

    from engine.executor.offloader import ActivationOffloader
    from engine.executor.setup import streamed_executor
    from engine.executor.training import AsManaged, StreamedWeights, train_step
    from engine.policy.activations import build_activation_policy

    with ExitStack() as stack:
        executor = streamed_executor(stack, wf, trace.access_order(), backend=weights_cfg.backend,
                                     source=weights_cfg.source, budget_bytes=int(row["budget_mb"] * MB),
                                     eviction=row["eviction"], lookahead=row["lookahead"], keep_steps=None,
                                     shared=host)
        streamed = StreamedWeights(executor, len(spec.kernels))
        offloader = None
        if act is not None:
            offloader = ActivationOffloader(build_activation_policy(act, spec.num_layers), act, device,
                                            weights=AsManaged(streamed), keep_steps=None)
            stack.callback(offloader.close)
        cuda = device.type == "cuda"

        def step(through: Any = None) -> tuple[float, int]:
            for t in lora.values():
                t.grad = None
            before = torch.cuda.memory_allocated(device) if cuda else 0
            with streamed.fetches_through(through):
                train_step(spec, executor, streamed, offloader, inputs, lora, device)
            done = executor.telemetry()[-1]  # waits for the step's end: the steps run synced
            return done["step_ms"], done["peak_device_bytes"] + (torch.cuda.max_memory_allocated(device) - before
                                                                 if cuda else 0)

        times, peaks = time_synced_steps(step)
        timed = executor.telemetry()[1:]
        stall = stamped_stall_ms(step, executor, clock)
    if cuda:
        torch.cuda.empty_cache()
    return {"step_ms": statistics.median(times[1:]), "first_step_ms": times[0], "stall_ms": stall,
            "peak_device_bytes": max(peaks[1:]), "h2d_bytes": timed[-1]["h2d_bytes"], "steps_ms": times,
            **{k: sum(t[k] for t in timed) for k in POOL_EVENTS}}
