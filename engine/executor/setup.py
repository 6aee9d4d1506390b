"""Setting up a run on the executor, the same way for every mode and benchmark.

    compute_device       where the model computes for a backend name (cuda | vmm | cpu)
    device_name          that device in a report
    fits_resident        room for an all-resident reference run
    open_weight_file     cfg.weights.file, or a temporary file of seeded random weights
    forward_order        the access order of one forward of a spec-built model
    streamed_executor    backend (the capped pool) -> host weights -> WeightExecutor
    shared_host_weights  host weights that several executors, each with a pool of its own, read
    run_settings, step_times, weight_counts   the measurement's rows from the telemetry

Everything opened here is closed by the caller's ExitStack, last opened first.
"""
from __future__ import annotations

import logging
import os
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from engine.errors import ExecutorError
from engine.executor.backend import Backend
from engine.executor.runtime import WeightExecutor, backend_granule, host_registrar, make_backend
from engine.policy.placement import held_bytes, round_up
from engine.executor.sources import host_weights
from engine.measure.spread import typical_step_ms
from engine.policy import KEEP_STEPS, AccessOrder, waits_for_step
from engine.models.spec import ModelSpec
from engine.weightfile import WeightFile, materialize

log = logging.getLogger(__name__)

NO_CUDA = ("no CUDA device; use mode=simulate (or weights.backend=cpu to exercise the executor "
           "on the CPU)")
TEMP_FILE_MAX_BYTES = 2_000_000_000  # models up to this size get a temporary weight file
# A run compares with an all-resident reference when the model takes under this much free memory.
REFERENCE_FRACTION = 0.6
# ... and when the step's own allocations are known, the most of it they may take together
# (the rest: the allocator's rounding, library workspaces).
RUN_FRACTION = 0.9


def compute_device(backend: str, no_cuda: str = NO_CUDA, replica: bool = False) -> torch.device:
    """The current CUDA device for backend "cuda" (ExecutorError `no_cuda` without one), the CPU for "cpu".
    `replica` (the CLI's runs): under torchrun, one process per GPU, the process's GPU is
    its LOCAL_RANK, made current here."""
    if backend == "cpu":
        return torch.device("cpu")
    if backend not in ("cuda", "vmm"):
        raise ExecutorError(f"backend={backend!r} is not one of cuda, vmm, cpu; pick one of those")
    if not torch.cuda.is_available():
        raise ExecutorError(no_cuda)
    if replica and "LOCAL_RANK" in os.environ:
        rank = int(os.environ["LOCAL_RANK"])
        if rank >= torch.cuda.device_count():
            raise ExecutorError(f"LOCAL_RANK={rank} but this host shows {torch.cuda.device_count()} GPU(s); start "
                                "at most one replica per GPU (torchrun --nproc-per-node)")
        torch.cuda.set_device(rank)
    return torch.device("cuda", torch.cuda.current_device())


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (cpu backend)"


def device_memory_mb(device: torch.device) -> int | None:
    """The device's total memory as CUDA reports it, in MB (hardware.device_memory_mb)."""
    return round(torch.cuda.mem_get_info(device)[1] / 1e6) if device.type == "cuda" else None


def fits_resident(nbytes: int, device: torch.device, transient_bytes: int | None = None) -> bool:
    """Whether `nbytes` all resident leave room for a run beside them: with the bytes a step
    allocates beside them measured (`transient_bytes`), their sum within RUN_FRACTION of the
    free memory where the model computes; unmeasured, `nbytes` within REFERENCE_FRACTION of
    it. On CUDA, the blocks torch's allocator caches from earlier work are given back first:
    the weight pool cannot use them."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if transient_bytes is not None:
        return nbytes + transient_bytes <= RUN_FRACTION * free
    return nbytes <= REFERENCE_FRACTION * free


def open_weight_file(cfg: Any, spec: ModelSpec, stack: ExitStack) -> WeightFile:
    """cfg.weights.file opened for `spec`; without one, a model of up to
    TEMP_FILE_MAX_BYTES gets its random weights (seed cfg.seed) in a temporary
    file that lives as long as `stack`."""
    if cfg.weights.file is not None:
        path = Path(cfg.weights.file).expanduser()
    elif spec.model_bytes > TEMP_FILE_MAX_BYTES:
        raise ExecutorError(
            f"weights.file is not set and model {spec.name} is {spec.model_bytes / 1e9:.2f} GB; write its "
            f"weights once with mode=materialize out=PATH, then pass weights.file=PATH")
    else:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="offload-weights-")))
        log.info("weights.file is not set: materializing %s (%d bytes) into a temporary file", spec.name,
                 spec.model_bytes)
        path = materialize(spec, tmp / f"{spec.name}.ptd", seed=cfg.seed)
    wf = WeightFile(path, spec)
    stack.callback(wf.close)
    return wf


def forward_order(spec: ModelSpec) -> AccessOrder:
    """The access order of one forward of `spec`: its kernels and the weights each reads."""
    return AccessOrder(tuple(k.name for k in spec.kernels), tuple(k.weights for k in spec.kernels),
                       {n: w.nbytes for n, w in spec.weights.items()})


def streamed_executor(stack: ExitStack, wf: WeightFile, order: AccessOrder, *, backend: str, source: str,
                      budget_bytes: int | None, eviction: str, lookahead: int,
                      keep_steps: int | None = KEEP_STEPS,
                      wrap: Callable[[Backend], Backend] | None = None,
                      shared: Mapping[str, torch.Tensor] | None = None) -> WeightExecutor:
    """A WeightExecutor streaming `wf`'s weights in `order`: a `backend` pool that
    holds the budget (every weight of the file when there is none), the host side
    of the weights as `source` says (or `shared`, from shared_host_weights: a file
    registered once for many executors), closed by `stack`. `wrap`, if given, wraps
    the backend the executor sees (the recorder times its copies so)."""
    granule = backend_granule(backend)
    placed = [round_up(n, granule) for n in order.sizes.values()]
    capacity = held_bytes(budget_bytes if budget_bytes is not None else sum(placed), placed)
    pool = make_backend(backend, capacity, max(order.sizes.values(), default=0))
    stack.callback(pool.close)
    if shared is None:
        host = host_weights(wf, source, pool)
        stack.callback(host.close)
        shared = host.tensors
    executor = WeightExecutor(order, shared, budget_bytes=budget_bytes, eviction=eviction,
                              lookahead=lookahead, backend=pool if wrap is None else wrap(pool),
                              keep_steps=keep_steps)
    stack.callback(executor.close)
    return executor


def shared_host_weights(stack: ExitStack, wf: WeightFile, source: str, backend: str) -> Mapping[str, torch.Tensor]:
    """The host side of `wf`'s weights as `source` says, for executors that each
    make a pool of their own: a `backend` pool that holds nothing keeps the
    registration (source=mmap_registered) until `stack` closes."""
    holder = host_registrar(backend)
    stack.callback(holder.close)
    host = host_weights(wf, source, holder)
    stack.callback(host.close)
    return host.tensors


def run_settings(weights: Any) -> dict:
    """The weights config a measurement ran under."""
    return {"backend": weights.backend, "source": weights.source, "eviction": weights.eviction,
            "lookahead": weights.lookahead}


def step_times(rows: list[dict]) -> dict:
    """Steps run, their median step time, the first one's and every step's. Times are noisy:
    the median of the steps after the first, which fills the pool and the caches (a run whose
    policy's steps differ by design takes their mean instead: engine.measure.spread)."""
    times = [r["step_ms"] for r in rows]
    return {"steps": len(rows), "step_ms": typical_step_ms(times, len(rows), varies=False),
            "first_step_ms": times[0], "steps_ms": times}


def end_of_step(loop: str, device: torch.device, step: int) -> None:
    """The end of step `step` as `loop` (engine.policy.LOOPS) runs it: where
    `waits_for_step` says so, the host waits for the step's last kernel (the current
    stream), as reading its output would."""
    if waits_for_step(loop, step) and device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def weight_counts(last: dict, prefix: str = "") -> dict:
    """The weight pool's counts in the last step's telemetry row (its keys under
    `prefix`). Counts are deterministic but settle over a few steps: the last
    step's are the steady state, the simulator's too."""
    return {"weight_copies": last[f"{prefix}fetches"] + last[f"{prefix}prefetches"],
            "weight_hits": last[f"{prefix}hits"],  # reads that found the weight resident
            "weight_misses": last[f"{prefix}fetches"],  # reads that had to fetch on demand
            "evictions": last[f"{prefix}evictions"]}


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaN equals the same NaN; +0.0 and -0.0 differ)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.detach().contiguous().reshape(-1).view(torch.uint8),
                       b.detach().contiguous().reshape(-1).view(torch.uint8))
