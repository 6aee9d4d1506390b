"""A recording's all-resident steps: the module with every weight on the device, timed whole.

After a second of warm-up (the clocks a GPU settles to under sustained load; an inference's
first warm-up step runs under torch's sync debug mode: `host_syncs`, the kernels before which
its host waits for the device), the steps run back to back until their median is known
(`until_settled`: a host-bound step on a shared host moves by tens of percent from one step to
the next, engine/measure/spread.py). Where the host bounds the step, the plain module's steps
(its weights bound, the hooks off, as offload runs a module whose weights all fit and as a
training step runs without offload) are timed in turns with them (`in_turns`), so the host's
drift falls on both. An inference on CUDA then runs pairs of a step alone and one beside a
stream of H2D copies, in turns, for the module's own slowdown under copies. engine/modules/
record.py fits the kernel-by-kernel times to what these steps measure (`Pipelined`).

    pipelined_step_ns  the all-resident steps, timed whole -> Pipelined
    host_syncs         where a forward's host waits for the device
"""
from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from engine.compute import slowdown_under_copy
from engine.executor.runtime import WeightExecutor
from engine.executor.training import RECOMPUTE, StreamedWeights, train_order, weight_handles
from engine.measure.clocks import Clock
from engine.measure.probes import copy_stream_beside
from engine.measure.spread import enough
from engine.trace import host_bound
from engine.modules.streamed import StreamedModule

LossFn = Callable[[Any], torch.Tensor]  # a forward's output -> the scalar loss backward starts from

PIPELINED_STEPS = 3  # all-resident steps timed whole, at least: odd, so one slow step does not move the median
PIPELINED_NS = 500_000_000  # and until their time adds up to this: a host-bound decode step is a few ms
# Then on until their median is known (engine/measure/spread.py: a host-bound step on a shared
# host moves by tens of percent from step to step), for at most this long and this many steps.
SETTLE_NS = 8_000_000_000
MAX_PIPELINED_STEPS = 10 * PIPELINED_STEPS
TURN_STEPS = 3  # where the host bounds the step: steps a turn, through the hooks, then of the plain module
# All-resident warm-up steps: at least one, and until this long. Under sustained load the GPU
# settles at its power limit within about a second; a step timed sooner runs at higher clocks.
WARMUP_NS = 1_000_000_000
SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's sync debug mode, per synchronizing call


def trainable_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def clear_grads(params: Sequence[torch.nn.Parameter]) -> None:
    """Drop the last step's gradients. Called before a timed step's first stamp, on a list
    taken once: walking a peft model's parameters (thousands of submodules) takes the host
    tens of ms, which the GPU would idle through inside the first kernel's time."""
    for p in params:
        p.grad = None


@dataclass
class Pipelined:
    """What the all-resident steps of `pipelined_step_ns` measured."""

    step_ns: int  # the median step
    # On CUDA: the peak of torch's allocations in a step (activations, inputs, resident
    # parameters and buffers; the streamed weights live in the executor's pool) and the
    # device bytes the process holds outside both.
    memory: tuple[int, int] | None = None
    syncs: tuple[int, ...] | None = None  # inference on CUDA: host_syncs
    slowdown: float | None = None  # inference on CUDA: its slowdown beside H2D copies
    plain_ns: int | None = None  # where the host bounds the step: the plain module's median step, weights bound


def resident_executor(streamed: StreamedModule, backend: str, training: bool = False) -> WeightExecutor:
    """An executor with no budget over the module's order (training: the training order):
    each weight is copied in on first use and stays."""
    order = train_order(streamed.order) if training else streamed.order
    return WeightExecutor(order, streamed.host, budget_bytes=None, eviction="priority", backend=backend)


def until_settled(step: Callable[[], int], settle_ns: int = SETTLE_NS) -> list[int]:
    """Times of `step` (ns), run back to back: at least PIPELINED_STEPS and until
    PIPELINED_NS, then until their median is known (`settled`) or `settle_ns` or
    MAX_PIPELINED_STEPS is reached."""
    times: list[int] = []
    while _unsettled(times, settle_ns):
        times.append(step())
    return times


def in_turns(step: Callable[[], int], plain_turn: Callable[[int], list[int]],
             settle_ns: int = SETTLE_NS) -> tuple[list[int], list[int]]:
    """Times of `step` and of the plain module's steps (`plain_turn(n)`: n of them, bound for
    the turn), in turns of TURN_STEPS each, so a host whose pace drifts slows both alike (the
    recording's plain_host_factor is their ratio), until both are known as `until_settled`
    asks."""
    times: list[int] = []
    plain: list[int] = []
    while _unsettled(times, settle_ns) or _unsettled(plain, settle_ns):
        times += [step() for _ in range(TURN_STEPS)]
        plain += plain_turn(TURN_STEPS)
    return times, plain


def _unsettled(times: Sequence[int], settle_ns: int) -> bool:
    return not enough(times, min_steps=PIPELINED_STEPS, max_steps=MAX_PIPELINED_STEPS, max_total=settle_ns,
                      min_total=PIPELINED_NS)


def pipelined_step_ns(streamed: StreamedModule, clock: Clock, backend: str, loss_fn: LossFn | None = None,
                      executor: WeightExecutor | None = None, kernels_ns: int = 0) -> Pipelined:
    """The median step of the module with every weight resident (`executor`, or one made
    here and closed after: `resident_executor`; `loss_fn`: a training step), and what more
    these steps measure (`Pipelined`). Warm-up steps until WARMUP_NS (an inference's first:
    the `host_syncs` forward), then steps back to back until their median is known
    (`until_settled`). An inference on CUDA then runs
    PIPELINED_STEPS pairs of a step alone and one beside H2D copies, for their ratio only: a
    step after one beside copies starts at clocks the copies let rise, so the pairs' steps
    alone run faster than back-to-back steps. A step whose last warm-up the host bounded
    (against `kernels_ns`, its kernels' time) is timed in turns with the plain module's steps,
    its weights bound for each turn (`in_turns`)."""
    training = loss_fn is not None
    own = executor is None
    executor = resident_executor(streamed, backend, training) if own else executor
    weights = StreamedWeights(executor, len(streamed.order))
    trainable = trainable_params(streamed.module) if training else []
    if training:
        index = {name: i for i, name in enumerate(streamed.order.kernels)}
        streamed.hooks.recompute = lambda name: weights.mirror(index[name], f"{RECOMPUTE} {name}")
    cuda = streamed.device.type == "cuda"

    def bound_step() -> int:
        """A step of the plain module, its weights bound (KernelHooks.bound): an inference as
        offload runs a module whose weights all fit, a training step as the module runs
        without offload."""
        clear_grads(trainable)
        clock.synchronize()
        start = clock.stamp()
        if training:
            with executor.step(bound=True):
                loss_fn(streamed.run()).backward()
        else:
            with torch.no_grad(), executor.step(bound=True):
                streamed.run()
        end = clock.stamp()
        clock.synchronize()
        return clock.ns(start, end)

    def one_step(copies: Callable[[], None] | None = None) -> int:
        clear_grads(trainable)
        clock.synchronize()  # the device's: a step beside copies ends with its copies
        if copies is not None:
            copies()
        start = clock.stamp()
        if training:
            with executor.step():  # nothing is evicted
                weights.start_step()
                # As the user's step (TrainingHandle.step): saved weights are handles fetched
                # again at their mirror, not the placeholders the hooks leave behind.
                with weight_handles(weights):
                    with streamed.hooks.forward(weights):
                        out = streamed.run()
                    loss = loss_fn(out)
                    # The output goes once the loss's backward has used it, as in a training loop
                    # (an LM's logits are a large share of the step's peak).
                    del out
                    loss.backward()
                weights.finish()
                streamed.hooks.release_recomputed()
        else:
            with torch.no_grad(), executor.step(), streamed.hooks.forward(executor):
                streamed.run()
        end = clock.stamp()
        clock.synchronize()
        return clock.ns(start, end)

    try:
        beside: list[int] = []  # inference on CUDA: steps beside copies, each after one alone
        plain: list[int] = []  # where the host bounds the step: steps of the plain module, in turns
        copies, copies_bytes = None, 0
        warm, warm_ns, last_warm = 0, 0, 0
        syncs = None
        if cuda and not training:  # the first warm-up step: its forward under sync debug mode
            t0 = time.perf_counter_ns()
            syncs = host_syncs(streamed, executor)  # ends synchronized with the device
            warm, warm_ns = 1, time.perf_counter_ns() - t0
            last_warm = warm_ns
        while warm == 0 or (warm_ns < WARMUP_NS and warm < MAX_PIPELINED_STEPS):
            last_warm = one_step()
            warm, warm_ns = warm + 1, warm_ns + last_warm
        if cuda:
            if not training:
                held = torch.cuda.memory_allocated(streamed.device)
                copies = copy_stream_beside(last_warm, streamed.device)
                copies_bytes = torch.cuda.memory_allocated(streamed.device) - held
            torch.cuda.reset_peak_memory_stats(streamed.device)
        settle_ns = SETTLE_NS if cuda else 0  # the CPU backend's steps, the tests', are not timed for their pace

        def bound_turn(n: int) -> list[int]:
            # Bound for the turn, as offload binds; its first step untimed: binding slows the step after it.
            with streamed.bind(executor):
                bound_step()
                return [bound_step() for _ in range(n)]
        if host_bound(kernels_ns, last_warm):
            times, plain = in_turns(one_step, bound_turn, settle_ns)
        else:
            times = until_settled(one_step, settle_ns)
        alone: list[int] = []
        if copies is not None:  # in turns with steps alone, so drift falls on both
            for _ in range(PIPELINED_STEPS):
                alone.append(one_step())
                beside.append(one_step(copies))
        peak = None
        if cuda:
            free, total = torch.cuda.mem_get_info(streamed.device)
            # What this process holds outside torch's allocator and the pool: the context, library
            # workspaces, the registration's bookkeeping (hardware.context_mb's measured stand-in).
            outside = total - free - torch.cuda.memory_reserved(streamed.device) - executor.backend.reserved_bytes()
            peak = (torch.cuda.max_memory_allocated(streamed.device) - copies_bytes, max(0, outside))
        step = round(statistics.median(times))
        plain_ns = round(statistics.median(plain)) if plain else None
        if training or not cuda:
            return Pipelined(step, peak, plain_ns=plain_ns)
        return Pipelined(step, peak, syncs, slowdown_under_copy(statistics.median(alone), statistics.median(beside)),
                         plain_ns)
    finally:
        streamed.hooks.recompute = None
        streamed.hooks.release_recomputed()  # after a step that failed: nothing left viewing the executor's blocks
        if own:
            executor.close()


class _Counted:
    """A kernel source that counts the kernels fetched through it."""

    def __init__(self, source: WeightExecutor):
        self.source, self.fetched = source, 0

    def fetch(self, position: int) -> Any:
        self.fetched = position + 1
        return self.source.fetch(position)


def host_syncs(streamed: StreamedModule, executor: WeightExecutor) -> tuple[int, ...]:
    """The positions before which one forward of `streamed` through `executor` (every weight
    resident) synchronized the host with the device (torch's sync debug mode: a `.item()`, a
    tensor made on the device from a Python list): the host gets there only once every kernel
    launched before has run. A sync after the last kernel counts at position 0 (the next step's
    start)."""
    counted = _Counted(executor)
    found: list[int] = []
    mode = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *rest, **kw: (
            found.append(counted.fetched % len(streamed.order)) if SYNC_WARNING in str(message) else None)
        with torch.no_grad(), executor.step(), streamed.hooks.forward(counted):
            torch.cuda.set_sync_debug_mode("warn")  # the module's forward only: not the step's own work
            try:
                streamed.run()
            finally:
                torch.cuda.set_sync_debug_mode(mode)
    torch.cuda.synchronize(streamed.device)
    return tuple(sorted(set(found)))
