"""`offload(module, ...)`: stream any torch.nn.Module's weights through the executor,
and `record(module, ...)`: the trace of its forward, for the simulator.

Both make the module streamable (engine/modules/streamed.py: kernels, host
copies or a checkpoint's registered mappings, the recorded order). `offload`
then runs every forward through a WeightExecutor under the budget.
`eviction="auto"` records the module's kernels (engine/modules/record.py),
simulates every eviction policy on that trace and the hardware profile, and
keeps the fastest; `handle.prediction` holds the simulator's figures beside
`handle.telemetry()`'s measured ones.

Where every streamed weight fits the budget as the backend places it
(engine/policy/placement.py `all_resident`), nothing would ever be evicted: the
weights are fetched once at set-up and bound for good, and the module's hooks come off
(`KernelHooks.bound`), so each forward is the plain module's; the executor only
times it (`WeightExecutor.step(bound=True)`).
"""
from __future__ import annotations

import math
import traceback
import warnings
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from omegaconf import OmegaConf
from torch import nn

from engine.choice import DEFAULT_LOOKAHEAD, LOOKAHEADS, choose
from engine.config import ActivationsConfig, WeightsConfig, load_hardware
from engine.errors import BelowFloorError, ConfigError, ExecutorError, WeightFileError
from engine.executor.runtime import WeightExecutor, backend_granule
from engine.executor.setup import compute_device
from engine.modules.kernels import GROUPINGS
from engine.modules.record import record_module
from engine.modules.streamed import StreamedModule, stage
from engine.modules.synthesize import priced_trace, seen_forward
from engine.modules.training import TrainingHandle, activations_config, sized_for
from engine.modules.untouched import untouched
from engine.policy import LOOPS
from engine.policy.placement import all_resident, place, residency
from engine.policy.eviction import EVICTIONS
from engine.policy.weights import WeightResidency
from engine.trace import Trace
from engine.units import MB, budget_bytes

_OFFLOADED = "_offload_engine_handle"  # set in an offloaded module's __dict__
NO_CUDA = "no CUDA device; use backend='cpu' to exercise the executor on the CPU"
DEFAULT_HARDWARE = "h100_pcie5"
CHOOSE_BY = ("recording", "census")  # what eviction="auto" simulates: a timed recording, or the census priced


class OffloadHandle:
    """What `offload` returns: the executor, the recorded order and trace, the
    prediction, the set-up's seconds by stage, telemetry, `reconfigure()` and `remove()`.
    `bound`: every weight resident and bound, the forward the plain module's (module docstring)."""

    def __init__(self, streamed: StreamedModule, executor: WeightExecutor, trace: Trace | None,
                 prediction: dict | None, binding: ExitStack | None = None, backend: str = "cuda"):
        self.module = streamed.module
        self.backend = backend
        self.streamed = streamed
        self.order = streamed.order
        self.resident_params = streamed.resident_params
        self.grouping = streamed.grouping
        self.trace = trace  # the recorded trace (eviction="auto" or hardware given), else None
        # eviction="auto": {"eviction", "step_ms", "candidates": {policy: step_ms}, ...} the simulator's
        self.prediction = prediction
        self.setup_s = streamed.setup_s  # seconds per set-up stage (StreamedModule.setup_s)
        self._through: Any = None  # what forwards fetch through instead of the executor (fetches_through)
        self._attach(executor, binding)

    def _attach(self, executor: WeightExecutor, binding: ExitStack | None) -> None:
        self.executor = executor
        self.eviction = executor.policy.eviction
        self.lookahead = executor.policy.lookahead
        self.bound = binding is not None
        self._binding = binding

    def telemetry(self) -> list[dict]:
        return self.executor.telemetry()

    def reconfigure(self, *, budget_mb: float | None, eviction: str, lookahead: int) -> None:
        """Run later forwards under another budget, eviction policy and lookahead on the same
        set-up (the kernels, the checkpoint's registered mapping, the recording): the executor
        is replaced and its telemetry starts afresh; `prediction` is dropped (it was the old
        configuration's). A bad value or a budget under the floor raises and leaves the
        handle as it was."""
        _check_budget(budget_mb)
        _check_eviction(eviction, auto=False)
        _check_lookahead(lookahead, auto=False)
        budget = budget_bytes(budget_mb)
        # Under the floor as this backend places the weights: BelowFloorError now, nothing closed.
        residency(place(self.order, budget, backend_granule(self.backend)), eviction, lookahead)
        self._detach()
        executor, binding = _executor(self.streamed, budget, eviction, lookahead, self.backend)
        self._attach(executor, binding)
        self.prediction = None

    @contextmanager
    def fetches_through(self, source: Any) -> Iterator[None]:
        """Forwards inside fetch each kernel through `source`, a wrapper of `executor` (a
        timer such as engine.measure.timing.KernelStamps); a bound forward fetches nothing."""
        self._through = source
        try:
            yield
        finally:
            self._through = None

    def forward_source(self) -> Any:
        """What a streamed forward fetches its kernels from now."""
        return self._through if self._through is not None else self.executor

    def _detach(self) -> None:
        if self._binding is not None:
            self._binding.close()
            self._binding = None
        self.executor.close()

    def remove(self) -> None:
        """Close the executor and put every parameter back where it was."""
        self.module.__dict__.pop("forward", None)
        self.module.__dict__.pop(_OFFLOADED, None)
        self._detach()
        self.streamed.remove()


def _check_budget(budget_mb: float | None) -> None:
    if budget_mb is not None and (isinstance(budget_mb, bool) or not isinstance(budget_mb, (int, float))
                                  or not math.isfinite(budget_mb) or budget_mb < 0):
        raise ConfigError(f"budget_mb={budget_mb!r}: give MB of GPU memory as a finite number >= 0, or None")


def _check_eviction(eviction: str, auto: bool) -> None:
    """One of EVICTIONS, or "auto" where the caller lets the simulator choose."""
    choices = (*EVICTIONS, "auto") if auto else EVICTIONS
    if eviction not in choices:
        raise ConfigError(f"eviction={eviction!r} is not one of {', '.join(choices)}; pick one of those")


def _check_lookahead(lookahead: int | str, auto: bool) -> None:
    """Kernels to prefetch ahead (an integer >= 0), or "auto" where the caller allows it."""
    if auto and lookahead == "auto":
        return
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
        raise ConfigError(f"lookahead={lookahead!r}: give kernels to prefetch ahead (an integer >= 0)"
                          + (" or 'auto'" if auto else ""))


def _executor(streamed: StreamedModule, budget: int | None, eviction: str, lookahead: int,
              backend: str) -> tuple[WeightExecutor, ExitStack | None]:
    """The executor over `streamed`'s order, and where every weight fits as it places them,
    the weights bound for good (the binding to close before the executor)."""
    executor = WeightExecutor(streamed.order, streamed.host, budget_bytes=budget, eviction=eviction,
                              lookahead=lookahead, backend=backend)
    try:
        return executor, streamed.bind(executor) if all_resident(executor.placement) else None
    except BaseException:
        executor.close()
        raise


def _check_common(module: nn.Module, budget_mb: float | None, backend: str) -> torch.device:
    if _OFFLOADED in module.__dict__:
        raise ExecutorError(f"this {type(module).__name__} is already offloaded; call remove() on its handle "
                            "before offloading or recording it again")
    _check_budget(budget_mb)
    return compute_device(backend, no_cuda=NO_CUDA)


def offload(module: nn.Module, *, budget_mb: float | None, example_inputs: Any = None, eviction: str = "auto",
            lookahead: int | str | None = None, backend: str = "cuda", grouping: str = "block",
            blocks: Sequence[str] | None = None, checkpoint: str | Path | None = None,
            source: str = "mmap_registered", hardware: Any = None, training: bool = False,
            activations: Any = None, loss_fn: Callable[[Any], torch.Tensor] | None = None,
            loop: str = "free", choose_by: str = "recording") -> OffloadHandle | TrainingHandle:
    """Stream `module`'s parameters through a pool capped at `budget_mb` (None: all resident).

    `example_inputs` (a tuple of positional arguments, a dict of keyword arguments,
    or one tensor as the only argument) drive the recording forward; later forwards
    must run the same kernels in the same order (else ExecutorError naming the first
    divergent kernel). Forwards run under torch.no_grad() (inference).
    `grouping="block"` fetches each repeated block whole (`blocks` names them, else
    they are found); "leaf" fetches each leaf module; "auto" records both and keeps the
    one the simulator predicts fastest (set-up records twice; `handle.prediction`'s
    "groupings_ms" has both). `checkpoint` (a .safetensors
    file or a diffusers/transformers directory) supplies the weights, mapped and
    registered (`source`), so the module may be built on the meta device.
    `eviction="auto"` picks the policy the simulator predicts fastest on the recorded
    trace and `hardware` (a conf/hardware name, path or mapping; default h100_pcie5);
    `lookahead="auto"` picks the lookahead with it, among LOOKAHEADS; None (the default)
    is "auto" where the simulator chooses (eviction="auto" or `hardware` given), else
    DEFAULT_LOOKAHEAD. `loop` says how the caller runs its steps, for the simulator's pick:
    "free" (back to back) or "synced" (each step's output read on the host first, as a
    decode loop sampling its tokens does). `choose_by` says what the simulator runs:
    "recording" (each kernel timed on the device, seconds of set-up; `handle.prediction` as
    `engine.record`'s trace predicts) or "census" (the set-up's order forward priced by the
    kernel table, as `engine.synthesize` prices a module: no timing, the prediction a
    synthesized one's).
    `backend`: "cuda" (the capped pool), "vmm" (chunks mapped on demand: never
    relocates) or "cpu" (the test backend).
    A budget under the floor raises BelowFloorError with the exact minimum in MB;
    on any error the module is left as it was.

    `training=True` returns a TrainingHandle instead (engine/modules/training.py):
    `with h.step(): loss.backward()` spills saved activations by the `activations`
    policy (a mapping of ActivationsConfig fields); with a budget the frozen weights
    stream too, and with a checkpoint and no budget they come from it, all resident.
    There `eviction="auto"` records one training step with `loss_fn` (the forward's
    output -> the loss) and keeps the policy the simulator predicts fastest for it and
    the activations policy (`h.prediction`); without `loss_fn` it is priority.
    """
    if loop not in LOOPS:
        raise ConfigError(f"loop={loop!r} is not one of {', '.join(LOOPS)}; pick one of those")
    if choose_by not in CHOOSE_BY:
        raise ConfigError(f"choose_by={choose_by!r} is not one of {', '.join(CHOOSE_BY)}; pick one of those")
    if training:
        if choose_by != "recording":
            raise ConfigError("choose_by='census' prices inference forwards; training=True chooses on a recorded "
                              "step (loss_fn): leave choose_by='recording'")
        return _offload_training(module, budget_mb, example_inputs, eviction, lookahead, backend, grouping, blocks,
                                 checkpoint, source, hardware, activations, loss_fn, loop)
    if example_inputs is None:
        raise ConfigError("example_inputs is required: the arguments of one forward, to record its order")
    device = _check_common(module, budget_mb, backend)
    _check_eviction(eviction, auto=True)
    if lookahead is None:
        lookahead = "auto" if eviction == "auto" or hardware is not None else DEFAULT_LOOKAHEAD
    if lookahead == "auto" and eviction != "auto" and hardware is None:
        raise ConfigError("lookahead='auto' is chosen by simulation: give eviction='auto' or a hardware profile")
    _check_lookahead(lookahead, auto=True)
    hw = load_hardware(hardware or DEFAULT_HARDWARE) if (eviction == "auto" or hardware is not None) else None
    if grouping == "auto" and hw is None:
        raise ConfigError("grouping='auto' is chosen by simulation: give eviction='auto' or a hardware profile")
    with untouched(module) as baseline:  # set-up's forwards leave buffers and the random generators as they were
        setup = _SetUp(module, example_inputs, device, backend, blocks, checkpoint, source, budget_bytes(budget_mb),
                       lookahead, eviction, hw, loop, choose_by, baseline.take_buffers)
        streamed, trace, prediction = setup.choose_grouping() if grouping == "auto" else setup.streamed(grouping)
        try:
            if prediction is not None:
                eviction, lookahead = prediction["eviction"], prediction["lookahead"]
            with stage(streamed.setup_s, "executor"):
                executor, binding = _executor(streamed, setup.budget, eviction, lookahead, backend)
        except BaseException as err:
            traceback.clear_frames(err.__traceback__)  # its frames hold views of the checkpoint's mapping
            streamed.remove()
            raise
    if streamed.resident_bytes:
        warnings.warn(f"offload keeps {len(streamed.resident_params)} parameters "
                      f"({streamed.resident_bytes / MB:.1f} MB) resident outside the budget: read by modules "
                      "with children or outside their own kernel (handle.resident_params lists them)",
                      stacklevel=2)
    handle = OffloadHandle(streamed, executor, trace, prediction, binding, backend)
    _wrap_forward(handle)
    return handle



class _SetUp:
    """offload's set-up for inference: the module made streamable by a grouping, recorded and
    its policy chosen by simulation where there is a hardware profile (`hw`)."""

    def __init__(self, module: nn.Module, example_inputs: Any, device: torch.device, backend: str,
                 blocks: Sequence[str] | None, checkpoint: str | Path | None, source: str, budget: int | None,
                 lookahead: int | str, eviction: str, hw: Any, loop: str, choose_by: str,
                 loaded: Callable[[], None]):
        self.module, self.example_inputs, self.device, self.backend = module, example_inputs, device, backend
        self.blocks, self.checkpoint, self.source, self.budget = blocks, checkpoint, source, budget
        self.lookahead, self.eviction, self.hw, self.loop = lookahead, eviction, hw, loop
        self.choose_by, self.loaded = choose_by, loaded  # loaded: StreamedModule's

    def build(self, grouping: str) -> StreamedModule:
        return StreamedModule(self.module, self.example_inputs, device=self.device, backend=self.backend,
                              grouping=grouping, blocks=self.blocks, checkpoint=self.checkpoint, source=self.source,
                              loaded=self.loaded)

    def streamed(self, grouping: str) -> tuple[StreamedModule, Trace | None, dict | None]:
        """The module streamed by `grouping`, its recording and the simulator's choice (None
        without `hw`). Under the floor (of the smallest lookahead tried) it fails before recording."""
        streamed = self.build(grouping)
        try:
            WeightResidency(streamed.order, self.budget, "priority",
                            min(LOOKAHEADS) if self.lookahead == "auto" else self.lookahead)
            if self.hw is None:
                return streamed, None, None
            name = type(self.module).__name__
            if self.choose_by == "census":
                with stage(streamed.setup_s, "price"):
                    trace = census_trace(streamed, self.hw, name)
            else:
                with stage(streamed.setup_s, "record"):
                    trace = record_module(streamed, name=name, backend=self.backend)
            with stage(streamed.setup_s, "simulate"):
                prediction = predict(trace, self.hw, self.budget, self.lookahead, self.eviction, self.source,
                                     self.backend, loop=self.loop)
            return streamed, trace, {**prediction, "grouping": grouping}
        except BaseException as err:
            traceback.clear_frames(err.__traceback__)  # its frames hold views of the checkpoint's mapping
            streamed.remove()
            raise

    def choose_grouping(self) -> tuple[StreamedModule, Trace, dict]:
        """grouping="auto" (`fastest_grouping`): the last grouping tried stays built; an
        earlier winner is built again, its recording kept."""
        built: list[StreamedModule] = []

        def attempt(grouping: str) -> tuple[tuple[Trace, float], dict]:
            streamed, trace, prediction = self.streamed(grouping)
            if grouping == GROUPINGS[-1]:
                built.append(streamed)
            else:
                streamed.remove()
            return (trace, sum(streamed.setup_s.values())), prediction

        best, tried = fastest_grouping(attempt)
        kept = built[0] if built else None
        if kept is None or kept.grouping != best:
            if kept is not None:
                kept.remove()
            kept = self.build(best)
        (trace, _), prediction = tried[best]
        # The other groupings' set-up (built, recorded, simulated) is this one's too.
        kept.setup_s["other_groupings"] = sum(s for g, ((_, s), _) in tried.items() if g != best)
        return kept, trace, prediction


def census_trace(streamed: StreamedModule, hardware: Any, name: str) -> Trace:
    """The trace of `streamed`'s order forward priced from its census, as a synthesized
    module's is (engine/modules/synthesize.py): what `choose_by="census"` simulates."""
    return priced_trace(seen_forward(streamed), hardware, name, {})


def fastest_grouping(attempt: Callable[[str], tuple[Any, dict]]) -> tuple[str, dict[str, tuple[Any, dict]]]:
    """grouping="auto": each of GROUPINGS through `attempt` (-> what it made, the simulator's
    prediction for it); the one predicted fastest, and every one tried, each prediction given
    "grouping" and "groupings_ms". A grouping whose floor the budget is under (BelowFloorError)
    is passed over; under every one's, the error of the lowest floor, the budget to give, is raised."""
    tried: dict[str, tuple[Any, dict]] = {}
    refused: BelowFloorError | None = None
    for grouping in GROUPINGS:
        try:
            tried[grouping] = attempt(grouping)
        except BelowFloorError as err:
            refused = err if refused is None or err.floor_bytes < refused.floor_bytes else refused
    if not tried:
        raise refused
    steps = {g: p["step_ms"] for g, (_, p) in tried.items()}
    return min(steps, key=steps.get), {g: (made, {**p, "grouping": g, "groupings_ms": steps})
                                        for g, (made, p) in tried.items()}


def _offload_training(module: nn.Module, budget_mb: float | None, example_inputs: Any, eviction: str,
                      lookahead: int | str | None, backend: str, grouping: str, blocks: Sequence[str] | None,
                      checkpoint: str | Path | None, source: str, hardware: Any, activations: Any,
                      loss_fn: Callable[[Any], torch.Tensor] | None, loop: str) -> TrainingHandle:
    """offload(training=True): the TrainingHandle, its policy chosen by simulation when it can be."""
    device = _check_common(module, budget_mb, backend)
    if grouping == "auto":
        raise ConfigError("grouping='auto' chooses by simulating inference steps; training=True takes "
                          f"one of {', '.join(GROUPINGS)}")
    if budget_mb is None and checkpoint is None:
        return TrainingHandle(module, activations, blocks)
    if example_inputs is None:
        raise ConfigError("training=True with a budget or a checkpoint streams the weights: give "
                          "example_inputs (one forward's arguments) to record the order")
    _check_eviction(eviction, auto=True)
    choose = eviction == "auto" and loss_fn is not None and budget_mb is not None
    if lookahead is None:
        lookahead = "auto" if choose else DEFAULT_LOOKAHEAD
    if lookahead == "auto" and not choose:
        raise ConfigError("lookahead='auto' under training=True is chosen by simulating a recorded step: give "
                          "eviction='auto', a budget and loss_fn")
    with untouched(module) as baseline:  # the recorded steps leave no gradients behind
        streamed = StreamedModule(module, example_inputs, device=device, backend=backend, grouping=grouping,
                                  blocks=blocks, checkpoint=checkpoint, source=source, training=True,
                                  loaded=baseline.take_buffers)
        try:
            budget = budget_bytes(budget_mb)
            trace = prediction = None
            if choose:
                trace = record_module(streamed, name=type(module).__name__, backend=backend, loss_fn=loss_fn)
                act = sized_for(activations_config(activations), trace) if activations is not None else None
                prediction = predict(trace, load_hardware(hardware or DEFAULT_HARDWARE), budget, lookahead, "auto",
                                     source, backend, act, loop)
                eviction, lookahead = prediction["eviction"], prediction["lookahead"]
                activations = act
            elif eviction == "auto":
                eviction = "priority"  # no training step to record and choose by
            handle = TrainingHandle(module, activations, blocks, streamed=streamed, budget_bytes=budget,
                                    eviction=eviction, lookahead=lookahead, backend=backend)
        except BaseException as err:
            _remove_after(streamed, err)
            raise
    handle.trace, handle.prediction = trace, prediction
    return handle


def predict(trace: Trace, hardware: Any, budget: int | None, lookahead: int | str, eviction: str,
            source: str = "mmap_registered", backend: str = "cuda", activations: Any = None,
            loop: str = "free") -> dict:
    """The simulator on `trace`: every candidate's step (ms, keyed "eviction/lookahead") and
    the fastest one's prediction, as engine.choice.choose picks it (eviction and lookahead
    each a value or "auto"), the steps run as `loop` runs them (engine.policy.LOOPS).
    `activations` (an ActivationsConfig; default off) spills a training trace's saved tensors."""
    from sim.prediction import steps_vary

    act = activations if activations is not None else OmegaConf.structured(ActivationsConfig)
    weights = OmegaConf.merge(OmegaConf.structured(WeightsConfig), {
        "eviction": eviction, "lookahead": lookahead, "source": source, "backend": backend})
    choice = choose(trace, weights, act, hardware, budget, loop=loop)
    p = choice.result.prediction
    return {"eviction": choice.eviction, "lookahead": choice.lookahead, "step_ms": p["mean_step_ms"],
            "step_ms_range": p["step_ms_range"], "steps_vary": steps_vary(p), "h2d_bytes": p["mean_h2d_bytes"],
            "d2h_bytes": p["d2h_bytes"], "stall_ms": p["stall_ms"], "overlap": p["overlap"],
            "host_ms": p["host_ms"], "bound_by": p["bound_by"],
            "peak_device_bytes": p["peak_device_bytes"], "peak_process_bytes": p["peak_process_bytes"],
            "device_bound_bytes": p["device_bound_bytes"],
            "peak_pool_torch_bytes": p["peak_pool_torch_bytes"],
            "hardware": hardware.name, "loop": loop, "candidates": choice.candidates_ms}


def _wrap_forward(handle: OffloadHandle) -> None:
    module = handle.module
    inner = module.forward
    hooks = handle.streamed.hooks

    def forward(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            raise ExecutorError("an offloaded module runs inference only (its weights are freed after each "
                                "kernel, autograd would keep them); call it under torch.no_grad()")
        if handle.bound:
            with handle.executor.step(bound=True):
                return inner(*args, **kwargs)
        with handle.executor.step(), hooks.forward(handle.forward_source()):
            return inner(*args, **kwargs)

    module.forward = forward
    module.__dict__[_OFFLOADED] = True


def record(module: nn.Module, example_inputs: Any, *, backend: str = "cuda", grouping: str = "block",
           blocks: Sequence[str] | None = None, checkpoint: str | Path | None = None,
           source: str = "mmap_registered", name: str | None = None,
           workload: dict | None = None, loss_fn: Callable[[Any], torch.Tensor] | None = None) -> Trace:
    """The trace of one forward of `module` on `example_inputs`, each kernel timed on
    the device (write it with engine.trace.write_trace; replay it with
    `python -m engine trace=PATH`). With `loss_fn` (the forward's output -> a scalar
    loss), one training step: the module's trainable parameters (its adapters) stay
    resident, the frozen ones stream, and the trace holds the backward and what autograd
    saved. The module is left as it was."""
    device = _check_common(module, None, backend)
    training = loss_fn is not None
    if training and not any(p.requires_grad for p in module.parameters()):
        raise ConfigError(f"this {type(module).__name__} has no trainable parameters to record a training step "
                          "of; add the adapters (peft) before recording")
    with untouched(module) as baseline:
        streamed = StreamedModule(module, example_inputs, device=device, backend=backend, grouping=grouping,
                                  blocks=blocks, checkpoint=checkpoint, source=source, training=training,
                                  loaded=baseline.take_buffers)
        try:
            trace = record_module(streamed, name=name or type(module).__name__, backend=backend, workload=workload,
                                  loss_fn=loss_fn)
        except BaseException as err:
            _remove_after(streamed, err)
            raise
    streamed.remove()
    return trace


def _remove_after(streamed: StreamedModule, err: BaseException) -> None:
    """Put the module back after `err`; a checkpoint still held by what failed must not hide `err`."""
    traceback.clear_frames(err.__traceback__)  # its frames hold views of the checkpoint's mapping
    try:
        streamed.remove()
    except WeightFileError as close:
        err.add_note(f"({close})")
