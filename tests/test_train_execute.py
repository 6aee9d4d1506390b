"""mode=execute for train_lora on the cpu backend: LoRA steps with streamed or
resident base weights and watermark / sync / no activation spill; losses and
gradients bitwise equal to plain steps with every weight resident."""
from __future__ import annotations

import gc
import json
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from torch.multiprocessing.reductions import StorageWeakRef

from engine.config import ActivationsConfig, HardwareConfig, PoolConfig, WeightsConfig
from engine.errors import ExecutorError
from engine.executor import WeightExecutor
from engine.executor.cpu import CpuBackend
from engine.executor.training import ACTIVATION_FIELDS, StreamedWeights, weight_handles
from engine.models import forward, load_spec, make_inputs
from engine.models.lora import init_lora, lora_loss
from engine.modes.spec_run import run_train_execute
from engine.models.synthesize import synthesize
from engine.weightfile import WeightFile, materialize
from split_pool import SplitPool

WORKLOAD = dict(name="train_lora", kind="train_lora", batch=1, video_tokens=24, audio_tokens=6, text_tokens=5,
                context_tokens=0, lora_rank=4, steps=2, loop="free")
HW = HardwareConfig(
    name="test", source="test", device_memory_mb=80000, h2d_gbps=50.0, d2h_gbps=50.0, duplex_gbps=80.0,
    pageable_gbps=7.0, mmap_gbps=7.0, mmap_registered_gbps=50.0, matmul_tflops=500.0, hbm_gbps=2000.0)
POOL = PoolConfig(class_sizes_mb=[0.002, 0.01, 0.05], slabs_per_class=[600, 400, 40])
BUDGET_MB = 1.0  # the tiny model is 2.0 MB: streamed, its weights evicted and fetched again in backward


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    workload = SimpleNamespace(**WORKLOAD)
    spec = load_spec("tiny", workload)
    path = materialize(spec, tmp_path_factory.mktemp("w") / "tiny.ptd", seed=0, device="cpu")
    return SimpleNamespace(spec=spec, path=path, trace=synthesize(spec, OmegaConf.create(WORKLOAD), HW), workload=workload)


def cfg(tiny, mode: str, budget: float | None) -> object:
    act = ActivationsConfig(mode=mode, high_watermark_mb=0.05, low_watermark_mb=0.03, min_tensor_bytes=0,
                            pool=POOL, num_offload_layers=2)
    return OmegaConf.create({"weights": WeightsConfig(backend="cpu", source="pinned", file=str(tiny.path)),
                             "activations": act, "workload": WORKLOAD, "budget": budget, "seed": 0})


@pytest.mark.parametrize("budget", [None, BUDGET_MB], ids=["resident", "streamed"])
@pytest.mark.parametrize("mode", ["watermark", "sync", "off"])
def test_training_steps_are_bitwise_the_plain_steps(tiny, tmp_path, mode, budget):
    m = run_train_execute(cfg(tiny, mode, budget), tiny.spec, tiny.trace, tmp_path)
    assert m["loss_match_reference"] is True and m["grads_match_reference"] is True
    assert m["steps"] == 2 and m["activations"] == mode
    rows = [json.loads(line) for line in (tmp_path / "telemetry.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and set(ACTIVATION_FIELDS) | {"vram_peak_mb", "weight_h2d_bytes"} <= rows[0].keys()
    if mode == "off":
        assert m["spill_bytes"] == 0
    else:
        assert m["spill_bytes"] > 0 and m["restore_bytes"] == m["spill_bytes"] and m["pool_misses"] == 0
        assert rows[-1]["weight_handles"] > 0  # autograd held base weights as handles
    kernels = [t for t in m["timeline"] if t[0] == "compute"]  # the last step, measured
    assert len(kernels) == len(tiny.trace.records) and all(a <= b for _, _, a, b in kernels)
    # the stall: the activation restores' waits and, streamed, the last step's waits on its weights
    assert m["weight_stall_ms"] >= 0 and m["stall_ms"] >= m["weight_stall_ms"]
    if budget is None:
        assert m["evictions"] == 0 and rows[-1]["weight_h2d_bytes"] == 0 and m["weight_stall_ms"] == 0
    else:
        assert m["evictions"] > 0 and m["peak_device_bytes"] >= rows[-1]["weight_peak_device_bytes"]
        assert m["weight_stall_ms"] > 0  # the cpu backend copies inside the fetch: its stamps time it
        assert rows[-1]["weight_peak_device_bytes"] <= BUDGET_MB * 1e6


class _TrackedBackend(CpuBackend):
    """Host arena that remembers every block's memory it handed out (weakly)."""

    def __init__(self, cap_bytes: int):
        super().__init__(cap_bytes)
        self.blocks: list[StorageWeakRef] = []

    def alloc(self, nbytes: int):
        block = super().alloc(nbytes)
        self.blocks.append(StorageWeakRef(block.data.untyped_storage()))
        return block


@pytest.mark.parametrize("handles", [True, False])
def test_autograd_holds_no_evicted_weight(tiny, handles):
    """With handles, after the forward only the resident blocks are alive; without
    them autograd keeps evicted weights' memory (what would be reused on a GPU)."""
    order = tiny.trace.access_order()
    wf = WeightFile(tiny.path, tiny.spec)
    backend = _TrackedBackend(int(BUDGET_MB * 1e6))
    ex = WeightExecutor(order, wf.tensors(), budget_bytes=int(BUDGET_MB * 1e6), backend=backend)
    streamed = StreamedWeights(ex, len(tiny.spec.kernels))
    lora = init_lora(tiny.spec, 4, seed=1)
    inputs = make_inputs(tiny.spec, tiny.workload, seed=0)
    try:
        with ex.step():
            streamed.start_step()
            with weight_handles(streamed) if handles else torch.autograd.graph.saved_tensors_hooks(
                    lambda t: t, lambda t: t):
                loss = lora_loss(forward(tiny.spec, streamed, inputs, lora))
                backend.trim()  # freed blocks kept for reuse are not what this counts
                gc.collect()
                alive = len({r.cdata for r in backend.blocks if not r.expired()})  # a reused block once
                live = backend.live_blocks()
                loss.backward()
            streamed.finish()
        assert (alive == live) is handles and alive >= live
        assert (streamed.handles > 0) is handles
    finally:
        ex.close()
        wf.close()


class _Counting:
    """A wrapper of the executor that notes each position fetched through it."""

    def __init__(self, executor: WeightExecutor):
        self.executor, self.positions = executor, []

    def fetch(self, position: int):
        self.positions.append(position)
        return self.executor.fetch(position)


def test_a_training_steps_fetches_go_through_the_wrapper_forward_and_backward(tiny):
    """StreamedWeights.fetches_through: every position of the step's order, the forward's and the
    backward's (issued by the saved weights' handles, and by finish), through the wrapper in order;
    a step after it fetches from the executor again. The gradients are the unwrapped step's."""
    from engine.executor.training import train_step

    wf = WeightFile(tiny.path, tiny.spec)
    ex = WeightExecutor(tiny.trace.access_order(), wf.tensors(), budget_bytes=int(BUDGET_MB * 1e6), backend="cpu")
    streamed = StreamedWeights(ex, len(tiny.spec.kernels))
    inputs = make_inputs(tiny.spec, tiny.workload, seed=0)
    counting, grads = _Counting(ex), []
    try:
        for through in (counting, None):
            lora = init_lora(tiny.spec, 4, seed=1)
            with streamed.fetches_through(through):
                grads.append(train_step(tiny.spec, ex, streamed, None, inputs, lora, torch.device("cpu"))[1])
    finally:
        ex.close()
        wf.close()
    assert counting.positions == list(range(2 * len(tiny.spec.kernels)))  # the first step's, none of the second's
    assert grads[0].keys() == grads[1].keys() and all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_backward_out_of_order_is_a_divergence(tiny):
    order = tiny.trace.access_order()
    wf = WeightFile(tiny.path, tiny.spec)
    ex = WeightExecutor(order, wf.tensors(), budget_bytes=None, backend="cpu")
    streamed = StreamedWeights(ex, len(tiny.spec.kernels))
    try:
        with pytest.raises(ExecutorError, match="schedule divergence"):
            with ex.step():
                streamed.start_step()
                for i in range(len(tiny.spec.kernels)):
                    w = streamed.fetch(i)
                    if w:
                        last = streamed.handle(next(iter(w.values())))
                streamed.finish()
                streamed.fetch_handle(last)  # the last kernel's backward came first, long passed
    finally:
        ex.close()
        wf.close()


def test_a_pool_sized_from_the_executors_own_questions_misses_nothing(tiny, tmp_path):
    """exact_pool is exact for the questions it is given: a recorded step's (mode=record
    traces hold autograd's real saves; a synthesized trace only approximates them)."""
    from engine.executor.model_hooks import KernelTracking, ResidentWeights
    from engine.executor.offloader import ActivationOffloader
    from engine.models.run import DictSource
    from engine.policy.activations import build_activation_policy
    from engine.policy.pool_sizing import exact_pool

    weights = {n: t for n, t in WeightFile(tiny.path, tiny.spec).tensors().items()}
    lora = init_lora(tiny.spec, tiny.workload.lora_rank, seed=1)
    keep = ActivationsConfig(mode="watermark", high_watermark_mb=1e9, low_watermark_mb=1e9, min_tensor_bytes=0,
                             pool=PoolConfig([1.0], [1]))
    with ActivationOffloader(build_activation_policy(keep, tiny.spec.num_layers), keep, "cpu",
                             weights=ResidentWeights(weights)) as off:
        with off.step():
            out = forward(tiny.spec, KernelTracking(DictSource(tiny.spec, weights), tiny.spec, off),
                          make_inputs(tiny.spec, tiny.workload, seed=0), lora)
            sum(o.float().pow(2).mean() for o in out.values()).backward()
        questions = list(off.questions)
    c = cfg(tiny, "watermark", BUDGET_MB)
    c.activations.pool = PoolConfig(**exact_pool(c.activations, questions, tiny.spec.num_layers))
    m = run_train_execute(c, tiny.spec, tiny.trace, tmp_path)
    assert m["spill_bytes"] > 0 and m["pool_misses"] == 0
    assert m["loss_match_reference"] is True and m["grads_match_reference"] is True


def test_a_run_matches_the_reference_bitwise_or_within_the_spread_or_its_noise() -> None:
    from engine.executor.training import NOISE_RTOL, match_reference

    ref = [(torch.tensor(2.0), {"a": torch.tensor([1.0, -4.0])})]
    same = [(torch.tensor(2.0), {"a": torch.tensor([1.0, -4.0])})]
    assert match_reference(same, ref, None) == (True, True)
    nudged = [(torch.tensor(2.0 + 1e-6), {"a": torch.tensor([1.0, -4.0 + 1e-6])})]
    assert match_reference(nudged, ref, None) == (False, False)  # no spread measured: bitwise
    assert match_reference(nudged, ref, 1e-6) == (True, True)  # within twice the spread
    # A scalar loss past twice the pair's spread, yet within its noise: 2^-7 of its magnitude.
    noisy = [(torch.tensor(2.0 + NOISE_RTOL), {"a": torch.tensor([1.0, -4.0])})]
    assert match_reference(noisy, ref, 1e-6) == (True, True)
    wrong = [(torch.tensor(2.0), {"a": torch.tensor([1.0, -3.0])})]  # a wrong weight: off by its size
    assert match_reference(wrong, ref, 1e-6) == (True, False)


@pytest.mark.parametrize("mode", ["off", "watermark"])
def test_a_training_step_relocates_and_stays_bitwise(tiny, tmp_path, monkeypatch, mode):
    """A refusal the released reserve does not answer relocates the resident weights
    inside a training step, in its forward and in its backward; autograd holds saved
    weight views as handles, so no moved block is read again: the losses and
    gradients equal the plain steps' bitwise."""
    from engine.executor import setup

    # Without refusals the pool's calls 1-19 warm it, 20-361 are the first step's
    # forward, 362-455 its backward; a relocation's own allocations come after its call.
    monkeypatch.setattr(SplitPool, "at", (100, 480, 900))
    monkeypatch.setattr(setup, "make_backend", lambda name, capacity, largest: SplitPool(capacity))
    m = run_train_execute(cfg(tiny, mode, BUDGET_MB), tiny.spec, tiny.trace, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "telemetry.jsonl").read_text().splitlines()]
    assert [r["weight_relocations"] for r in rows] == [2, 1] and all(r["weight_relocated_bytes"] > 0 for r in rows)
    assert m["reserve_releases"] == m["relocations"] == 3
    assert m["loss_match_reference"] is True and m["grads_match_reference"] is True
