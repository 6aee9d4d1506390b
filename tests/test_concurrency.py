"""Concurrency: a second forward on a busy executor fails at once (and leaves the
first one's run intact); executors and offloaded modules with separate pools
run side by side, also from two threads at once. The cpu backend in CI, CUDA on a
GPU (`cuda` marker).
"""
from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch
from torch import nn

import engine
from engine.errors import ExecutorError
from engine.executor import WeightExecutor
from engine.models import forward, load_spec, make_inputs
from engine.models.run import DictSource
from engine.models.seeded import random_weights
from engine.policy import AccessOrder
from engine.policy.floor import floor

GPU = pytest.param("cuda", marks=[pytest.mark.cuda,
                                  pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")])
WORKLOAD = SimpleNamespace(kind="infer", batch=1, video_tokens=8, audio_tokens=4, text_tokens=3, context_tokens=0,
                           lora_rank=0)
STEPS = 3
WAIT_S = 20  # the most any thread here waits for another; a failure "at once" takes milliseconds


@pytest.fixture(scope="module", params=["cpu", GPU])
def env(request):
    backend = request.param
    if backend == "cuda":
        pytest.importorskip("cuda.bindings.runtime", reason="needs cuda-python")
    device = "cuda" if backend == "cuda" else "cpu"
    spec = load_spec("tiny", WORKLOAD)
    host = random_weights(spec, seed=0)
    inputs = make_inputs(spec, WORKLOAD, device=device, seed=1)
    with torch.no_grad():
        reference = forward(spec, DictSource(spec, {n: t.to(device) for n, t in host.items()}), inputs)
    order = AccessOrder(tuple(k.name for k in spec.kernels), tuple(k.weights for k in spec.kernels),
                        {n: w.nbytes for n, w in spec.weights.items()})
    return SimpleNamespace(backend=backend, device=device, spec=spec, host=host, inputs=inputs,
                           reference=reference, order=order)


def executor(env, budget_factor: float = 1.0, eviction: str = "belady") -> WeightExecutor:
    budget = int(floor(env.order, 2).bytes * budget_factor)
    return WeightExecutor(env.order, env.host, budget_bytes=budget, eviction=eviction, lookahead=2,
                          backend=env.backend)


def assert_reference(env, out: dict) -> None:
    assert out.keys() == env.reference.keys()
    assert all(torch.equal(out[k], env.reference[k]) for k in out)


class Paused:
    """A weight source that stops inside kernel `at` of the step until released."""

    def __init__(self, ex: WeightExecutor, at: int):
        self.ex, self.at = ex, at
        self.inside, self.release = threading.Event(), threading.Event()

    def fetch(self, i: int) -> dict:
        weights = self.ex.fetch(i)
        if i == self.at:
            self.inside.set()
            assert self.release.wait(WAIT_S)
        return weights


def in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, list]:
    """Run `target` in a thread; the list gets its result or its exception."""
    result: list = []

    def run() -> None:
        try:
            result.append(target())
        except BaseException as err:  # noqa: BLE001 -- handed to the test thread
            result.append(err)

    t = threading.Thread(target=run)
    t.start()
    return t, result


def failing_at_once(call: Callable[[], Any]) -> tuple[BaseException, float]:
    start = time.perf_counter()
    with pytest.raises(ExecutorError) as err:
        call()
    return err.value, time.perf_counter() - start


# ----- one executor, two threads


def test_a_second_step_from_another_thread_fails_at_once(env):
    ex = executor(env)
    paused = Paused(ex, at=len(env.order) // 2)

    def first() -> dict:
        with torch.no_grad(), ex.step():
            return forward(env.spec, paused, env.inputs)

    t, result = in_thread(first)
    assert paused.inside.wait(WAIT_S)

    def second_step() -> None:
        with torch.no_grad(), ex.step():
            forward(env.spec, ex, env.inputs)

    err, seconds = failing_at_once(second_step)
    assert "another forward is already running on this executor (concurrent execute" in str(err)
    err, _ = failing_at_once(lambda: ex.fetch(0))  # a fetch into the other thread's step
    assert "fetch from another thread while a forward runs" in str(err)
    err, _ = failing_at_once(ex.close)
    assert "close() while a forward runs" in str(err)
    paused.release.set()
    t.join(WAIT_S)
    assert seconds < WAIT_S / 4  # it did not wait for the first forward
    assert not isinstance(result[0], BaseException), result[0]
    assert_reference(env, result[0])  # the refused attempts did not disturb the running forward
    with torch.no_grad(), ex.step():  # and the executor goes on
        assert_reference(env, forward(env.spec, ex, env.inputs))
    assert len(ex.steps) == 2
    ex.close()


def test_a_step_inside_a_step_on_the_same_thread_is_named(env):
    ex = executor(env)
    with pytest.raises(ExecutorError, match="step\\(\\) inside a step of the same executor"):
        with ex.step():
            with ex.step():
                pass
    ex.close()


class Net(nn.Module):
    def __init__(self, d: int = 32, n: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def offloaded(env, seed: int) -> tuple[Net, Any, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    net = Net().eval().to(env.device)
    x = torch.randn(3, 32, device=env.device)
    with torch.no_grad():
        ref = net(x)
    layer_bytes = 32 * 33 * 4  # weight and bias, fp32
    # The floor (two kernels, and two more in flight for lookahead 2): half the model streams.
    handle = engine.offload(net, budget_mb=4 * layer_bytes / 1e6, example_inputs=(x,), backend=env.backend)
    return net, handle, x, ref


def test_a_second_forward_through_an_offload_handle_fails_at_once(env):
    net, handle, x, ref = offloaded(env, seed=0)
    inside, release = threading.Event(), threading.Event()

    def pause(module: nn.Module, inputs: Any) -> None:
        inside.set()
        assert release.wait(WAIT_S)

    hook = net.layers[2].register_forward_pre_hook(pause)

    def first() -> torch.Tensor:
        with torch.no_grad():
            return net(x)

    t, result = in_thread(first)
    assert inside.wait(WAIT_S)
    hook.remove()  # the second attempt must not pause

    def second() -> None:
        with torch.no_grad():
            net(x)

    err, seconds = failing_at_once(second)
    assert "concurrent execute" in str(err) and seconds < WAIT_S / 4
    release.set()
    t.join(WAIT_S)
    assert torch.equal(result[0], ref)
    with torch.no_grad():
        assert torch.equal(net(x), ref)
    handle.remove()


# ----- separate pools side by side


def test_two_executors_with_separate_pools_in_one_process(env):
    a, b = executor(env, 1.0, "belady"), executor(env, 1.5, "lru")
    with torch.no_grad():
        for _ in range(STEPS):  # interleaved steps: neither disturbs the other's pool
            with a.step():
                out_a = forward(env.spec, a, env.inputs)
            with b.step():
                out_b = forward(env.spec, b, env.inputs)
            assert_reference(env, out_a)
            assert_reference(env, out_b)
    assert a.backend is not b.backend
    assert a.backend.reserved_peak_bytes() <= a.backend.cap_bytes
    assert b.backend.reserved_peak_bytes() <= b.backend.cap_bytes
    a.close()
    b.close()


def test_two_threads_each_with_its_own_executor(env):
    start = threading.Barrier(2)

    def run(budget_factor: float, eviction: str) -> list[dict]:
        # Created in its thread, on its own stream on a GPU: the two really overlap.
        stream = torch.cuda.Stream() if env.device == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            ex = executor(env, budget_factor, eviction)
            start.wait(WAIT_S)
            outs = []
            with torch.no_grad():
                for _ in range(STEPS):
                    with ex.step():
                        outs.append(forward(env.spec, ex, env.inputs))
            if stream is not None:
                stream.synchronize()
            ex.close()
        return outs

    threads = [in_thread(lambda: run(1.0, "belady")), in_thread(lambda: run(2.0, "priority"))]
    for t, _ in threads:
        t.join(4 * WAIT_S)
    for _, result in threads:
        assert not isinstance(result[0], BaseException), result[0]
        for out in result[0]:
            assert_reference(env, out)


def test_two_threads_each_with_its_own_offloaded_module(env):
    start = threading.Barrier(2)

    def run(seed: int) -> bool:
        net, handle, x, ref = offloaded(env, seed)
        start.wait(WAIT_S)
        with torch.no_grad():
            same = all(torch.equal(net(x), ref) for _ in range(10))
        handle.remove()
        return same

    threads = [in_thread(lambda: run(1)), in_thread(lambda: run(2))]
    for t, _ in threads:
        t.join(4 * WAIT_S)
    assert [r[0] for _, r in threads] == [True, True]

