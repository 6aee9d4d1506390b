"""engine/policy/schedule.py: the one question schedule, and both drivers held to it.

The simulator's launcher and the executor's offloader must ask the activation
policy the questions `step_questions(trace.records)` lists, in its order, for a
trace recorded from the same model: that is what lets the simulator predict the
executor's decisions and lets the pool be sized from a trace.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.config import ActivationsConfig, HardwareConfig, PoolConfig
from engine.executor.model_hooks import KernelTracking, ResidentWeights
from engine.executor.offloader import ActivationOffloader
from engine.models import forward, load_spec, make_inputs
from engine.models.lora import init_lora
from engine.models.run import DictSource
from engine.models.seeded import random_weights
from engine.policy import ActivationPolicy, Decision, StepCounters
from engine.policy.activations import build_activation_policy
from engine.policy.pool_sizing import exact_pool
from engine.policy.schedule import Question, StepSchedule, step_questions
from engine.policy.weights import WeightResidency
from engine.measure.clocks import CpuClock
from engine.measure.timing import build_trace, time_steps
from engine.models.spec import SavedTensor
from engine.trace import Trace
from sim.simulator import drive

HW = HardwareConfig(name="t", source="t", device_memory_mb=80000, h2d_gbps=50.0, d2h_gbps=50.0, duplex_gbps=80.0,
                    pageable_gbps=7.0, mmap_gbps=7.0, mmap_registered_gbps=50.0, matmul_tflops=500.0,
                    hbm_gbps=2000.0)
WORKLOAD = SimpleNamespace(name="t", kind="train_lora", batch=1, video_tokens=16, audio_tokens=8, text_tokens=8,
                           context_tokens=0, lora_rank=2)


def rec(phase: str, layer: int, needs: tuple[str, ...] = (), saved: tuple[SavedTensor, ...] = ()) -> SimpleNamespace:
    return SimpleNamespace(phase=phase, layer=layer, needs=needs, saved=saved)


def test_the_schedule_orders_boundaries_unpacks_saves_and_the_step_end():
    a, b = SavedTensor("a", 10, 0), SavedTensor("b", 20, 1)
    records = [rec("fwd", -1), rec("fwd", 0, saved=(a,)), rec("fwd", 0), rec("fwd", 1, saved=(b,)),
               rec("bwd", 1, needs=("b",)), rec("bwd", 0, needs=("a",)), rec("bwd", -1)]
    assert step_questions(records, 0) == [
        ("layer_start", "fwd", 0), ("save", "a", 10, 0),  # layer -1 has neither start nor end
        ("layer_end", "fwd", 0), ("layer_start", "fwd", 1), ("save", "b", 20, 1),
        ("layer_end", "fwd", 1), ("layer_start", "bwd", 1), ("unpack", "b"),
        ("layer_end", "bwd", 1), ("layer_start", "bwd", 0), ("unpack", "a"),
        ("layer_end", "bwd", 0), ("step_end",)]
    schedule = StepSchedule()
    assert schedule.kernel(rec("bwd", 2, needs=("x",), saved=(a,))) == (
        [("layer_start", "bwd", 2)], [("unpack", "x")], [("save", "a", 10, 0)], [])
    assert schedule.enter("bwd", 2) == []  # the same layer: no boundary
    assert schedule.end() == [("layer_end", "bwd", 2), ("step_end",)]
    assert schedule.end() == [("step_end",)]  # a new step starts outside every layer


def test_tensors_under_min_tensor_bytes_are_held_unasked():
    """A policy never spills them, so neither driver asks about them; their unpacks are the driver's own."""
    a, b = SavedTensor("a", 10, 0), SavedTensor("b", 20, 0)
    records = [rec("fwd", 0, saved=(a, b)), rec("bwd", 0, needs=("b", "a"))]
    assert step_questions(records, 15) == [
        ("layer_start", "fwd", 0), ("save", "b", 20, 0), ("layer_end", "fwd", 0),
        ("layer_start", "bwd", 0), ("unpack", "b"), ("layer_end", "bwd", 0), ("step_end",)]
    schedule = StepSchedule(15)
    assert schedule.asks(15) and not schedule.asks(14)
    schedule.kernel(records[0])
    assert schedule.kernel(records[1]).held == ["a"]
    schedule.end()
    assert schedule.kernel(records[1]).held == []  # a new step: nothing held yet


class Recording:
    """An activation policy that records the questions the simulator puts to it."""

    def __init__(self, policy: ActivationPolicy):
        self.policy = policy
        self.log = policy.log
        self.min_tensor_bytes = policy.min_tensor_bytes
        self.questions: list[Question] = []

    @property
    def history(self) -> list[StepCounters]:
        return self.policy.history

    def _asked(self, question: Question) -> None:
        self.questions.append(question)

    def on_save(self, tensor: str, nbytes: int, layer: int) -> list[Decision]:
        self._asked(("save", tensor, nbytes, layer))
        return self.policy.on_save(tensor, nbytes, layer)

    def on_unpack(self, tensor: str) -> list[Decision]:
        self._asked(("unpack", tensor))
        return self.policy.on_unpack(tensor)

    def on_layer_start(self, phase: str, layer: int) -> list[Decision]:
        self._asked(("layer_start", phase, layer))
        return self.policy.on_layer_start(phase, layer)

    def on_layer_end(self, phase: str, layer: int) -> list[Decision]:
        self._asked(("layer_end", phase, layer))
        return self.policy.on_layer_end(phase, layer)

    def on_step_end(self) -> None:
        self._asked(("step_end",))
        self.policy.on_step_end()


@pytest.fixture(scope="module")
def tiny():
    """The tiny model and a trace recorded from it on the host clock (autograd's real saves)."""
    spec = load_spec("tiny", WORKLOAD)
    inputs, weights = make_inputs(spec, WORKLOAD), random_weights(spec)
    timing = time_steps(spec, DictSource(spec, weights), inputs, CpuClock(), lora=init_lora(spec, 2, seed=1),
                        warmup=0, steps=1)
    return SimpleNamespace(spec=spec, inputs=inputs, weights=weights,
                           trace=build_trace(spec, timing, {"model": spec.name}))


def config(mode: str, trace: Trace, min_bytes: int = 0) -> ActivationsConfig:
    act = ActivationsConfig(mode=mode, high_watermark_mb=0.01, low_watermark_mb=0.005, num_offload_layers=2,
                            min_tensor_bytes=min_bytes)
    pool = exact_pool(act, step_questions(trace.records, min_bytes), trace.num_layers)
    return ActivationsConfig(**{**act.__dict__, "pool": PoolConfig(**pool)})


def simulator_questions(trace: Trace, act: ActivationsConfig, steps: int) -> list[Question]:
    policy = Recording(build_activation_policy(act, trace.num_layers))
    weights = WeightResidency(trace.access_order(), None, eviction="belady", lookahead=1)
    result = drive(trace, weights, policy, HW, act, 50.0, None, steps)
    assert result.prediction["spilled"] > 0 and result.prediction["pool_misses"] == 0
    return policy.questions


def executor_questions(tiny, act: ActivationsConfig) -> list[Question]:
    spec = tiny.spec
    off = ActivationOffloader(build_activation_policy(act, spec.num_layers), act, "cpu",
                              weights=ResidentWeights(tiny.weights))
    with off.step():
        out = forward(spec, KernelTracking(DictSource(spec, tiny.weights), spec, off), tiny.inputs,
                      init_lora(spec, 2, seed=1))
        sum(o.float().pow(2).mean() for o in out.values()).backward()
    off.close()
    t = off.telemetry()[-1]
    assert t["activations_spilled"] > 0 and t["pool_misses"] == 0
    return off.questions


def in_needs_order(questions: list[Question], trace: Trace) -> list[Question]:
    """`questions` with each run of unpacks of one record in that record's `needs` order.

    Autograd unpacks one backward node's saved tensors in an order of its own;
    across records, boundaries and saves nothing is reordered, so any other
    difference from the schedule still shows.
    """
    where = {n: (i, j) for i, r in enumerate(trace.records) for j, n in enumerate(r.needs)}
    out: list[Question] = []
    run: list[Question] = []

    def flush() -> None:
        out.extend(sorted(run, key=lambda u: where[u[1]]))
        run.clear()

    for q in questions:
        if q[0] != "unpack":
            flush()
            out.append(q)
            continue
        if run and where[q[1]][0] != where[run[0][1]][0]:
            flush()  # the next record's unpacks
        run.append(q)
    flush()
    return out


def median_saved_bytes(trace: Trace) -> int:
    sizes = sorted(s.nbytes for r in trace.records for s in r.saved)
    return sizes[len(sizes) // 2]


@pytest.mark.parametrize("mode", ["watermark", "sync"])
@pytest.mark.parametrize("threshold", ["none", "median"])
def test_simulator_and_executor_ask_the_schedules_questions(tiny, mode, threshold):
    """With min_tensor_bytes at the median saved size, half the saves are held unasked by both drivers alike."""
    trace = tiny.trace
    min_bytes = median_saved_bytes(trace) if threshold == "median" else 0
    act = config(mode, trace, min_bytes)
    schedule = step_questions(trace.records, min_bytes)
    saves = sum(len(r.saved) for r in trace.records)
    assert sum(q[0] == "save" for q in schedule) == (saves if threshold == "none" else
                                                     sum(s.nbytes >= min_bytes for r in trace.records for s in r.saved))
    kinds = {q[0] for q in schedule}
    assert kinds == {"save", "unpack", "layer_start", "layer_end", "step_end"}
    assert simulator_questions(trace, act, steps=2) == schedule * 2
    asked = executor_questions(tiny, act)
    assert in_needs_order(asked, trace) == schedule
    assert asked != schedule  # autograd's own order within a node: the comparison above is not vacuous
