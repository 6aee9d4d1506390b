"""Soak: many steps on the cpu backend leave every book where the first steps left it.

1000 weight-streaming steps of the tiny model (tiny inputs, the floor budget,
so every step evicts and copies) and a run of LoRA training steps with the
activation offloader (watermark mode, host copies). Checked at the end of each
step or at samples: pool bytes, live blocks, the arena's reserved high-water,
registered ranges, free slabs, Python objects alive, and host RSS.

Decision logs and per-step telemetry are kept for the last `keep_steps` steps
(KEEP_STEPS by default): a long run holds a bounded window of them, so nothing
is trimmed by hand here and the window's size is asserted.

RSS bound. Host RSS is sampled from step SETTLED on (allocators have settled
and the log window is full). It may end at most 4 MB above the lowest sample of
the first half of the run, plus that half's own spread: the allocator's noise
moves RSS by a few MB at random, so the margin is measured from the run itself,
while a leak grows steadily (one 4 KB block a step adds 4 MB over 990 steps).
Leaks of Python objects are caught exactly by the object count, and leaks of
pool blocks by the pool's books.
"""
from __future__ import annotations

import gc
from types import SimpleNamespace

import torch

from engine.config import ActivationsConfig, PoolConfig
from engine.executor import WeightExecutor, host_weights
from engine.executor.model_hooks import KernelTracking
from engine.executor.offloader import ActivationOffloader
from engine.executor.cpu import CpuBackend
from engine.executor.setup import bitwise_equal
from engine.models import forward, load_spec, make_inputs
from engine.models.lora import init_lora
from engine.models.run import DictSource
from engine.models.seeded import random_weights
from engine.policy import KEEP_STEPS, AccessOrder
from engine.policy.activations import build_activation_policy
from engine.policy.floor import floor
from engine.weightfile import WeightFile, materialize

RSS_BOUND = 4 << 20  # bytes (module docstring)
OBJECTS_BOUND = 50  # Python objects: one leaked per step would be 990
SETTLED = KEEP_STEPS + 4  # the step after which nothing may grow: the kept window of logs is full
INFER = SimpleNamespace(kind="infer", batch=1, video_tokens=1, audio_tokens=1, text_tokens=1, context_tokens=0,
                        lora_rank=0)
TRAIN = SimpleNamespace(kind="train_lora", batch=1, video_tokens=4, audio_tokens=2, text_tokens=2,
                        context_tokens=2, lora_rank=2)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def sample() -> tuple[int, int]:
    gc.collect()
    return rss_bytes(), len(gc.get_objects())


def assert_rss_flat(rss: list[int]) -> None:
    """`rss` sampled through the run from SETTLED on (module docstring)."""
    first = rss[:max(2, len(rss) // 2)]
    allowed = RSS_BOUND + max(first) - min(first)
    assert rss[-1] - min(first) <= allowed, f"RSS grew {(rss[-1] - min(first)) / 1e6:.1f} MB, " \
        f"allowed {allowed / 1e6:.1f} MB"


def test_1000_weight_streaming_steps_grow_nothing(tmp_path):
    spec = load_spec("tiny", INFER)
    path = materialize(spec, tmp_path / "tiny.ptd", seed=1, device="cpu")
    inputs = make_inputs(spec, INFER, seed=2)
    order = AccessOrder(tuple(k.name for k in spec.kernels), tuple(k.weights for k in spec.kernels),
                        {n: w.nbytes for n, w in spec.weights.items()})
    budget = floor(order, 2).bytes
    wf = WeightFile(path, spec)
    with torch.no_grad():
        reference = forward(spec, DictSource(spec, {n: t.clone() for n, t in wf.tensors().items()}), inputs)
    backend = CpuBackend(budget)
    host = host_weights(wf, "mmap_registered", backend)
    ex = WeightExecutor(order, host.tensors, budget_bytes=budget, eviction="belady", lookahead=2, backend=backend)
    books, rss = set(), []
    with torch.no_grad():
        for step in range(1000):
            with ex.step():
                if step % 50 == 0:  # the model's forward, compared bitwise
                    out = forward(spec, ex, inputs)
                    assert all(bitwise_equal(out[k], reference[k]) for k in reference), step
                    del out
                else:  # every kernel's fetch: every decision carried out, every copy made
                    for i in range(len(order)):
                        ex.fetch(i)
            assert ex.steps[-1].evictions > 0 and ex.steps[-1].h2d_bytes > 0
            books.add((backend.used_bytes(), backend.live_blocks(), backend.reserved_peak_bytes(),
                       tuple(backend.registered.items())))
            window = set(range(step - KEEP_STEPS + 1, step + 1))
            assert len(ex.steps) == min(step + 1, KEEP_STEPS) and {d.step for d in ex.log} <= window
            if step + 1 == SETTLED:
                settled = sample()
            if step + 1 >= SETTLED and (step + 1 - SETTLED) % 50 == 0:
                rss.append(rss_bytes())
    end = sample()
    rss.append(end[0])
    assert len(books) == 1, books  # the same pool bytes, blocks, reserve and ranges after every step
    (used, blocks, reserved, ranges), = books
    assert 0 < used <= budget and reserved <= budget and len(ranges) == 1
    assert end[1] - settled[1] <= OBJECTS_BOUND, f"{end[1] - settled[1]} more Python objects"
    assert_rss_flat(rss)
    ex.close()
    host.close()
    assert backend.registered == {} and backend.live_blocks() == 0
    wf.close()


def _act_cfg() -> ActivationsConfig:
    return ActivationsConfig(mode="watermark", high_watermark_mb=0.02, low_watermark_mb=0.01, min_tensor_bytes=0,
                             pool=PoolConfig(class_sizes_mb=[0.002, 0.01, 0.05], slabs_per_class=[300, 200, 20]))


def test_training_steps_with_activation_spill_grow_nothing():
    steps = 60
    spec = load_spec("tiny", TRAIN)
    weights = random_weights(spec, seed=0)
    inputs = make_inputs(spec, TRAIN, seed=1)
    lora = init_lora(spec, 2, seed=3)
    act = _act_cfg()
    off = ActivationOffloader(build_activation_policy(act, spec.num_layers), act, "cpu")
    slabs = list(act.pool.slabs_per_class)
    losses, counts, rss = set(), set(), []
    for step in range(steps):
        with off.step():
            out = forward(spec, KernelTracking(DictSource(spec, weights), spec, off), inputs, lora)
            loss = sum(o.float().pow(2).mean() for o in out.values())
            loss.backward()
        for p in lora.values():
            p.grad = None  # the same step every time: the same loss, the same spills
        losses.add(loss.item())
        t = off.telemetry()[-1]
        counts.add((t["activations_spilled"], t["activations_restored"], t["pool_hits"], t["pool_misses"]))
        assert t["activations_spilled"] > 0 and t["pool_hits"] > 0
        assert [off.slabs.free_slabs(c) for c in range(len(slabs))] == slabs  # every slab came back
        assert off.device_bytes == 0 and off.off_device_bytes == 0
        assert len(off.telemetry()) == len(off.policy.history) == min(step + 1, KEEP_STEPS)
        assert len({d.step for d in off.log}) <= KEEP_STEPS
        if step + 1 == SETTLED:
            settled = sample()
        if step + 1 >= SETTLED:
            rss.append(rss_bytes())
    end = sample()
    rss.append(end[0])
    assert len(losses) == 1 and len(counts) == 1
    assert end[1] - settled[1] <= OBJECTS_BOUND, f"{end[1] - settled[1]} more objects"
    assert_rss_flat(rss)
    off.close()
