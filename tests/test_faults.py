"""Injected faults: the run stops with the cause, nothing is freed twice or leaked,
and a new run in the same process gives bitwise the reference outputs.

Faults are injected from outside the product: a backend's methods are wrapped
on the instance (the wrapper also keeps its own ledger of every block handed
out and freed), or, on CUDA, a runtime binding is made to return a CUDA error,
so the backend's own error path runs. Each fault runs on the cpu backend in
CI and on the CUDA backend on a GPU (`cuda` marker).
"""
from __future__ import annotations

import logging
import os

# Bitwise LoRA gradients on a GPU need deterministic cuBLAS (docs/DESIGN.md); set
# before cuBLAS starts in this process.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from collections import Counter  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import Any, Callable  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from engine.config import ActivationsConfig, PoolConfig  # noqa: E402
from engine.errors import ExecutorError, PlacementError  # noqa: E402
from engine.executor import WeightExecutor, host_weights, make_backend  # noqa: E402
from engine.executor.model_hooks import KernelTracking  # noqa: E402
from engine.executor.offloader import ActivationOffloader  # noqa: E402
from engine.executor.cpu import CpuBackend  # noqa: E402
from engine.models import forward, load_spec, make_inputs  # noqa: E402
from engine.models.lora import init_lora  # noqa: E402
from engine.models.run import DictSource  # noqa: E402
from engine.models.seeded import random_weights  # noqa: E402
from engine.modes.spec_run import run_execute  # noqa: E402
from engine.policy import AccessOrder  # noqa: E402
from engine.policy.activations import build_activation_policy  # noqa: E402
from engine.policy.floor import floor  # noqa: E402
from engine.policy.weights import WeightResidency  # noqa: E402
from engine.weightfile import WeightFile, materialize  # noqa: E402

GPU = pytest.param("cuda", marks=[pytest.mark.cuda,
                                  pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")])
WORKLOAD = dict(name="infer", kind="infer", batch=1, video_tokens=8, audio_tokens=4, text_tokens=3,
                context_tokens=0, lora_rank=0, steps=2, loop="free")
STEPS = 3


@pytest.fixture(scope="module", params=["cpu", GPU])
def env(request, tmp_path_factory):
    backend = request.param
    if backend == "cuda":
        pytest.importorskip("cuda.bindings.runtime", reason="needs cuda-python")
    device = "cuda" if backend == "cuda" else "cpu"
    spec = load_spec("tiny", SimpleNamespace(**WORKLOAD))
    path = materialize(spec, tmp_path_factory.mktemp("w") / "tiny.ptd", seed=1, device="cpu")
    inputs = make_inputs(spec, SimpleNamespace(**WORKLOAD), device=device, seed=2)
    with WeightFile(path, spec) as wf, torch.no_grad():
        weights = {n: t.to(device, copy=True) for n, t in wf.tensors().items()}
        reference = forward(spec, DictSource(spec, weights), inputs)
        del weights
    order = AccessOrder(tuple(k.name for k in spec.kernels), tuple(k.weights for k in spec.kernels),
                        {n: w.nbytes for n, w in spec.weights.items()})
    budget = floor(order, 2).bytes  # the tightest budget: every step evicts and copies
    return SimpleNamespace(backend=backend, spec=spec, path=path, inputs=inputs, reference=reference,
                           order=order, budget=budget)


class Ledger:
    """Wraps a backend's methods on the instance: counts calls, keeps its own
    books of the blocks handed out and freed, and runs a fault in place of calls
    `at` .. `at + times - 1` of a method (`fault(original, *args)`)."""

    def __init__(self, backend: Any):
        self.backend = backend
        self.live: dict[int, int] = {}  # address -> nbytes, by the wrapper's own count
        self.frees = 0
        self.allocs = 0
        self.calls: Counter[str] = Counter()
        self._faults: dict[str, tuple[range, Callable[..., Any]]] = {}
        self.injected = 0
        for name in ("alloc", "free_after", "copy_in", "register"):
            setattr(backend, name, self._wrap(name, getattr(backend, name)))

    def fail(self, method: str, at: int, fault: Callable[..., Any], times: int = 1) -> None:
        self._faults[method] = (range(at, at + times), fault)

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            self.calls[name] += 1
            at, fault = self._faults.get(name, (range(0), None))
            run = original
            if self.calls[name] in at:
                self.injected += 1
                run = lambda *a: fault(original, *a)  # noqa: E731
            out = run(*args)
            if name == "alloc":
                assert out.address not in self.live, "the pool handed out a live block"
                self.live[out.address] = out.nbytes
                self.allocs += 1
            elif name == "free_after":
                # The backend's own guard raises before a second free; reaching here twice is a bug.
                assert self.live.pop(args[0].address, None) is not None, "a block was freed twice"
                self.frees += 1
            return out
        return call

    def assert_balanced(self) -> None:
        assert self.live == {}, f"{len(self.live)} blocks never freed"
        assert self.allocs == self.frees > 0


def executor(env, backend: Any = None) -> WeightExecutor:
    backend = backend or make_backend(env.backend, env.budget, max(env.order.sizes.values()))
    with WeightFile(env.path, env.spec) as wf:
        host = {n: t.clone() for n, t in wf.tensors().items()}  # pageable copies: the file may close
    return WeightExecutor(env.order, host, budget_bytes=env.budget, eviction="belady", lookahead=2,
                          backend=backend)


def run_steps(env, ex: WeightExecutor, steps: int = STEPS, source: Any = None) -> list[dict]:
    outs = []
    with torch.no_grad():
        for _ in range(steps):
            with ex.step():
                outs.append(forward(env.spec, source or ex, env.inputs))
    return outs


def assert_a_new_run_matches(env) -> None:
    """The process is fine: a new executor's outputs are bitwise the reference, with the bare policy's log."""
    ex = executor(env)
    for out in run_steps(env, ex):
        assert out.keys() == env.reference.keys()
        assert all(torch.equal(out[k], env.reference[k]) for k in out)
    bare = WeightResidency(env.order, env.budget, "belady", 2)
    for _ in range(STEPS):
        for i in range(len(env.order)):
            bare.issue(i)
    assert ex.log == bare.log
    ex.close()


def assert_stopped_and_clean(ex: WeightExecutor, ledger: Ledger) -> None:
    with pytest.raises(ExecutorError, match="stopped after an earlier failure"):
        with ex.step():
            pass
    ex.close()  # raises if a block leaked
    ledger.assert_balanced()


def copies_in_first_step(env) -> int:
    policy = WeightResidency(env.order, env.budget, "belady", 2)
    return sum(d.action in ("fetch", "prefetch") for i in range(len(env.order)) for d in policy.issue(i))


# ----- the weight executor: copy, allocation, divergence


def _copy_fault(backend_name: str, monkeypatch) -> tuple[Callable[..., Any], str]:
    if backend_name == "cpu":
        def fault(original, block, src):
            raise RuntimeError("injected: the host copy failed")
        return fault, "injected: the host copy failed"
    from engine.executor import cuda

    def fault(original, block, src):  # cudaMemcpyAsync answers an error: the backend's own path
        with monkeypatch.context() as m:
            m.setattr(cuda.cudart, "cudaMemcpyAsync",
                      lambda *a: (cuda.cudart.cudaError_t.cudaErrorInvalidValue,))
            return original(block, src)
    return fault, r"cudaMemcpyAsync of \d+ bytes host to device failed: cudaErrorInvalidValue"


@pytest.mark.parametrize("when", ["first step", "third step"])
def test_a_copy_that_fails(env, when, monkeypatch):
    ex = executor(env)
    ledger = Ledger(ex.backend)
    fault, cause = _copy_fault(env.backend, monkeypatch)
    at = 5 if when == "first step" else 2 * copies_in_first_step(env) + 5
    ledger.fail("copy_in", at, fault)
    with pytest.raises((RuntimeError, ExecutorError), match=cause):
        run_steps(env, ex)
    assert ledger.injected == 1 and len(ex.steps) == (0 if when == "first step" else 2)
    assert_stopped_and_clean(ex, ledger)
    assert_a_new_run_matches(env)


def _refusal(backend_name: str, monkeypatch) -> tuple[Callable[..., Any], str]:
    if backend_name == "cpu":
        def fault(original, nbytes, backend):  # the arena really refuses: the cap shrinks for this call
            backend.trim()  # a kept block of this size would be reused without asking the arena
            cap, backend.cap_bytes = backend.cap_bytes, backend.used_bytes()
            try:
                return original(nbytes)
            finally:
                backend.cap_bytes = cap
        return fault, r"host arena refused \d+ bytes"
    from engine.executor import cuda

    def fault(original, nbytes, backend):
        backend.trim()  # a kept block of this size would be reused without asking the pool
        # The cap shrinks for this call as on the host, so the refusal is over the cap (a
        # refusal under it is a placement failure, relocated: the test after this one).
        cap, backend.cap_bytes = backend.cap_bytes, backend.used_bytes()
        with monkeypatch.context() as m:
            m.setattr(cuda.cudart, "cudaMallocFromPoolAsync",
                      lambda *a: (cuda.cudart.cudaError_t.cudaErrorMemoryAllocation, 0))
            try:
                return original(nbytes)
            finally:
                backend.cap_bytes = cap
    return fault, r"cudaMallocFromPoolAsync\(\d+\) with \d+ bytes in use .* cudaErrorMemoryAllocation"


def _fragmented(backend_name: str, monkeypatch) -> Callable[..., Any]:
    """A refusal of a block the budget allows. The host arena is a byte counter
    that never fragments, so there it is raised as is; on CUDA the pool answers
    out-of-memory and the backend's own check names it a placement failure."""
    if backend_name == "cpu":
        def fault(original, nbytes, backend):
            raise PlacementError("injected: the pool's free bytes are split")
        return fault
    from engine.executor import cuda

    def fault(original, nbytes, backend):
        backend.trim()
        with monkeypatch.context() as m:
            m.setattr(cuda.cudart, "cudaMallocFromPoolAsync",
                      lambda *a: (cuda.cudart.cudaError_t.cudaErrorMemoryAllocation, 0))
            return original(nbytes)
    return fault


def test_a_refusal_the_released_reserve_answers_moves_no_weight(env, monkeypatch):
    """The pool first gives back the reserve no live block uses; a refusal that this
    answers moves nothing."""
    ex = executor(env)
    ledger = Ledger(ex.backend)
    fault = _fragmented(env.backend, monkeypatch)
    ledger.fail("alloc", copies_in_first_step(env) + 7, lambda original, n: fault(original, n, ex.backend))
    for out in run_steps(env, ex):
        assert all(torch.equal(out[k], env.reference[k]) for k in env.reference)
    assert ledger.injected == 1
    rows = ex.telemetry()
    assert [r["reserve_releases"] for r in rows] == [0, 1, 0]
    assert [r["relocations"] for r in rows] == [0, 0, 0]
    ex.close()
    ledger.assert_balanced()


def test_a_fragmented_pool_is_relocated_and_the_step_goes_on(env, monkeypatch, caplog):
    ex = executor(env)
    ledger = Ledger(ex.backend)
    fault = _fragmented(env.backend, monkeypatch)
    ledger.fail("alloc", copies_in_first_step(env) + 7, lambda original, n: fault(original, n, ex.backend), times=2)
    with caplog.at_level(logging.WARNING, logger="engine.executor.runtime"):
        for out in run_steps(env, ex):
            assert all(torch.equal(out[k], env.reference[k]) for k in env.reference)
    assert ledger.injected == 2  # refused again after the reserve was released
    rows = ex.telemetry()
    assert [r["reserve_releases"] for r in rows] == [0, 1, 0]
    assert [r["relocations"] for r in rows] == [0, 1, 0]
    assert 0 < rows[1]["relocated_bytes"] <= env.budget
    # The user hears of it once, with the backend that never relocates.
    [warned] = [r.getMessage() for r in caplog.records if "relocated" in r.getMessage()]
    assert "in step 1" in warned and "vmm" in warned
    bare = WeightResidency(env.order, env.budget, "belady", 2)
    for _ in range(STEPS):
        for i in range(len(env.order)):
            bare.issue(i)
    assert ex.log == bare.log  # the policy's decisions do not change
    ex.close()
    ledger.assert_balanced()


def test_a_pool_still_fragmented_after_relocation_stops_the_run(env, monkeypatch):
    ex = executor(env)
    fault, at = _fragmented(env.backend, monkeypatch), copies_in_first_step(env) + 7
    original, calls = ex.backend.alloc, [0]

    def alloc(nbytes):
        calls[0] += 1
        return original(nbytes) if calls[0] < at else fault(original, nbytes, ex.backend)
    ex.backend.alloc = alloc
    ledger = Ledger(ex.backend)
    with pytest.raises(PlacementError):
        run_steps(env, ex)
    assert len(ex.steps) == 1
    assert_stopped_and_clean(ex, ledger)
    assert_a_new_run_matches(env)


def test_an_allocation_the_pool_refuses(env, monkeypatch):
    ex = executor(env)
    ledger = Ledger(ex.backend)
    fault, cause = _refusal(env.backend, monkeypatch)
    ledger.fail("alloc", copies_in_first_step(env) + 7, lambda original, n: fault(original, n, ex.backend))
    with pytest.raises(ExecutorError, match=cause):
        run_steps(env, ex)
    assert ledger.injected == 1 and len(ex.steps) == 1
    assert_stopped_and_clean(ex, ledger)
    assert_a_new_run_matches(env)


class SkipsAKernel:
    """A forward that skips kernel `at` of its second step: the schedule diverges mid-step."""

    def __init__(self, ex: WeightExecutor, at: int):
        self.ex, self.at, self.fetches = ex, at, 0

    def fetch(self, i: int) -> dict:
        self.fetches += 1
        if self.fetches == len(self.ex.order) + self.at + 1:
            self.ex.fetch(i + 1)
        return self.ex.fetch(i)


def test_a_schedule_that_diverges_mid_step(env):
    ex = executor(env)
    ledger = Ledger(ex.backend)
    at = len(env.order) // 2
    with pytest.raises(ExecutorError, match=rf"schedule divergence at kernel position {at}: expected "
                                            rf"{env.order.kernels[at]}, got {env.order.kernels[at + 1]} \(position {at + 1}\)"):
        run_steps(env, ex, source=SkipsAKernel(ex, at))
    assert len(ex.steps) == 1
    assert_stopped_and_clean(ex, ledger)
    assert_a_new_run_matches(env)


def test_a_double_free_is_refused_before_the_pool_sees_it(env):
    ex = executor(env)
    run_steps(env, ex, steps=1)
    resident = next(iter(ex._resident.values())).block
    ex.backend.free_after(resident, None)
    with pytest.raises(ExecutorError, match=r"block 0x[0-9a-f]+ freed twice or never allocated"):
        ex.backend.free_after(resident, None)
    with pytest.raises(ExecutorError, match="freed twice"):
        ex.close()  # the executor frees its residents; the one freed behind its back is refused
    assert ex.backend.live_blocks() == 0


# ----- registration


def test_a_registration_that_fails(env):
    backend = make_backend(env.backend, env.budget, max(env.order.sizes.values()))
    wf = WeightFile(env.path, env.spec)
    first = host_weights(wf, "mmap_registered", backend)
    ranges = dict(backend.registered)
    # The same mapping again: refused by the backend (the CUDA driver on a GPU).
    with pytest.raises(ExecutorError, match=r"already registered|cudaErrorHostMemoryAlreadyRegistered"):
        host_weights(wf, "mmap_registered", backend)
    assert backend.registered == ranges  # the failed registration left nothing behind
    ex = WeightExecutor(env.order, first.tensors, budget_bytes=env.budget, backend=backend)
    out = run_steps(env, ex, steps=1)[-1]
    assert all(torch.equal(out[k], env.reference[k]) for k in out)
    ex.close()
    first.close()
    assert backend.registered == {}
    del out
    wf.close()  # no view of the mapping outlived the failure


def test_a_failed_registration_leaves_the_file_closable(env, monkeypatch):
    backend = make_backend(env.backend, env.budget, max(env.order.sizes.values()))
    ledger = Ledger(backend)

    def refuse(original, address, nbytes):
        raise ExecutorError("cudaHostRegister of the weight file failed: injected; check `ulimit -l`")

    ledger.fail("register", 1, refuse)
    wf = WeightFile(env.path, env.spec)
    with pytest.raises(ExecutorError, match="ulimit -l"):
        host_weights(wf, "mmap_registered", backend)
    assert backend.registered == {}
    wf.close()  # raises if a view of the mapping was left referenced
    backend.close()
    assert_a_new_run_matches(env)


# ----- a whole run (mode=execute) on the cpu backend


def _cfg(path) -> Any:
    weights = {"eviction": "belady", "lookahead": 2, "source": "mmap_registered", "file": str(path),
               "backend": "cpu"}
    return OmegaConf.create({"weights": weights, "workload": WORKLOAD, "budget": 1.0, "seed": 0})


class _Trace:
    def __init__(self, order: AccessOrder):
        self.order = order

    def access_order(self) -> AccessOrder:
        return self.order


def _copy_fails(original, block, src):
    raise RuntimeError("injected: the host copy failed")


def _register_refused(original, address, nbytes):
    raise ExecutorError("cudaHostRegister of the weight file failed: injected; check `ulimit -l`")


@pytest.mark.parametrize("method, at, fault, cause", [
    ("copy_in", 30, _copy_fails, "injected: the host copy failed"),
    ("register", 1, _register_refused, "check `ulimit -l`"),
])
def test_a_failed_run_stops_with_its_cause_and_the_next_run_matches(env, tmp_path, monkeypatch, method, at,
                                                                     fault, cause):
    if env.backend != "cpu":
        pytest.skip("run_execute's cleanup is the same on both backends; checked on the host")
    made: list[CpuBackend] = []
    ledgers: list[Ledger] = []

    def tracked(name: str, capacity: int, largest: int) -> CpuBackend:
        backend = CpuBackend(capacity)
        made.append(backend)
        ledgers.append(Ledger(backend))
        if len(made) == 1:  # the first run fails
            ledgers[-1].fail(method, at, fault)
        return backend

    monkeypatch.setattr("engine.executor.setup.make_backend", tracked)
    # The cause, not a later cleanup error (the weight file refusing to close, say).
    with pytest.raises((RuntimeError, ExecutorError), match=cause):
        run_execute(_cfg(env.path), env.spec, _Trace(env.order), tmp_path / "failed")
    assert ledgers[0].injected == 1
    assert not (tmp_path / "failed" / "telemetry.jsonl").exists()  # nothing that looks like a result
    assert made[0].registered == {} and made[0].live_blocks() == 0
    assert ledgers[0].live == {}
    result = run_execute(_cfg(env.path), env.spec, _Trace(env.order), tmp_path / "next")
    assert result["outputs_match_reference"] is True
    assert made[1].registered == {}
    ledgers[1].assert_balanced()


# ----- activations: a corrupted byte in a spilled activation


TRAIN = SimpleNamespace(kind="train_lora", batch=1, video_tokens=12, audio_tokens=4, text_tokens=3,
                        context_tokens=5, lora_rank=4)


def _act_cfg() -> ActivationsConfig:
    return ActivationsConfig(mode="watermark", high_watermark_mb=0.05, low_watermark_mb=0.03, min_tensor_bytes=0,
                             pool=PoolConfig(class_sizes_mb=[0.002, 0.01, 0.05], slabs_per_class=[300, 200, 20]),
                             debug_checksums=True)


def _lora_step(spec, weights, inputs, off: ActivationOffloader | None):
    lora = init_lora(spec, 4, seed=3, device=inputs_device(inputs))
    source = DictSource(spec, weights)
    if off is not None:
        source = KernelTracking(source, spec, off)
    out = forward(spec, source, inputs, lora)
    loss = sum(o.float().pow(2).mean() for o in out.values())
    loss.backward()
    return loss.detach(), {k: t.grad for k, t in lora.items()}


def inputs_device(inputs: dict) -> torch.device:
    return next(t.device for t in inputs.values() if isinstance(t, torch.Tensor))


@pytest.fixture
def deterministic():
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("device", ["cpu", GPU])
def test_a_corrupted_byte_in_a_spilled_activation_is_caught_and_named(device, deterministic):
    spec = load_spec("tiny", TRAIN)
    weights = {n: t.to(device) for n, t in random_weights(spec, seed=0).items()}
    inputs = make_inputs(spec, TRAIN, device=device, seed=1)
    reference = _lora_step(spec, weights, inputs, None)
    act = _act_cfg()
    off = ActivationOffloader(build_activation_policy(act, spec.num_layers), act, device)
    spill = off._copies.spill
    corrupted: list[torch.Tensor] = []

    def flip_a_byte(dst, src, after):  # the copy lands, then one byte of the host copy goes bad
        done = spill(dst, src, after)
        if not corrupted:
            off._copies.wait_host(done)
            dst[len(dst) // 2] ^= 0x10
            corrupted.append(dst)
        return done

    off._copies.spill = flip_a_byte
    with pytest.raises(ExecutorError, match=r"checksum mismatch for saved tensor \S+ \(layer -?\d+\): CRC32 ") as err:
        with off.step():
            _lora_step(spec, weights, inputs, off)
    first_spill = next(d.target for d in off.log if d.action == "spill")
    assert f"saved tensor {first_spill} " in str(err.value)  # the corrupted one is named
    assert len(corrupted) == 1
    with pytest.raises(ExecutorError, match="stopped after an earlier failure"):
        with off.step():
            pass
    off.close()
    # A new offloader (and policy) in the same process: bitwise the step without offload.
    again = ActivationOffloader(build_activation_policy(act, spec.num_layers), act, device)
    with again.step():
        got = _lora_step(spec, weights, inputs, again)
    assert torch.equal(got[0], reference[0])
    assert all(torch.equal(got[1][k], reference[1][k]) for k in reference[1])
    assert again.telemetry()[-1]["activations_spilled"] > 0
    again.close()
