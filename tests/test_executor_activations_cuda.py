"""Activation spill on a real GPU: bitwise LoRA gradients, peak memory, pinned slabs, checksums.

Bitwise comparisons run with deterministic kernels on both sides (docs/DESIGN.md,
"Comparing outputs on the GPU"); the reference's own run-to-run spread is
checked first. Run with CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment
(set here too, for a process whose cuBLAS is not yet initialized).
"""
from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

from engine.config import ActivationsConfig, PoolConfig  # noqa: E402
from engine.errors import ExecutorError  # noqa: E402
from engine.executor.model_hooks import KernelTracking, ResidentWeights, layer_boundary  # noqa: E402
from engine.executor.offloader import ActivationOffloader  # noqa: E402
from engine.models import forward, load_spec, make_inputs  # noqa: E402
from engine.models.lora import init_lora  # noqa: E402
from engine.models.run import DictSource  # noqa: E402
from engine.models.seeded import random_weights  # noqa: E402
from engine.policy.activations import build_activation_policy  # noqa: E402

WORKLOAD = SimpleNamespace(kind="train_lora", batch=2, video_tokens=256, audio_tokens=32, text_tokens=16,
                           context_tokens=0, lora_rank=8)
POOL = PoolConfig(class_sizes_mb=[0.05, 0.3, 1.5], slabs_per_class=[600, 200, 40])


def cfg(mode: str, **kw) -> ActivationsConfig:
    base = dict(mode=mode, high_watermark_mb=0.5, low_watermark_mb=0.3, min_tensor_bytes=0, pool=POOL,
                num_offload_layers=3)
    return ActivationsConfig(**{**base, **kw})


@pytest.fixture(autouse=True)
def deterministic():
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture(scope="module")
def tiny():
    spec = load_spec("tiny", WORKLOAD)
    return SimpleNamespace(spec=spec, weights=random_weights(spec, seed=0, device="cuda"),
                           inputs=make_inputs(spec, WORKLOAD, device="cuda", seed=1))


def lora_step(tiny, off=None):
    lora = init_lora(tiny.spec, 8, device="cuda", seed=3)
    source = DictSource(tiny.spec, tiny.weights)
    if off is not None:
        source = KernelTracking(source, tiny.spec, off)
    out = forward(tiny.spec, source, tiny.inputs, lora)
    loss = sum(o.float().pow(2).mean() for o in out.values())
    loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), {k: t.grad for k, t in lora.items()}


def same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


@pytest.mark.parametrize("mode, caps", [("watermark", 4), ("watermark", 1), ("sync", 4), ("sync", 1)])
def test_lora_step_is_bitwise_identical(tiny, mode, caps):
    ref = lora_step(tiny)
    assert same(lora_step(tiny), ref), "the reference itself is not reproducible: a nondeterministic kernel"
    act = cfg(mode, max_inflight_d2h=caps, max_inflight_h2d=caps, debug_checksums=caps == 1)
    with ActivationOffloader(build_activation_policy(act, tiny.spec.num_layers), act, "cuda",
                             weights=ResidentWeights(tiny.weights)) as off:
        assert off.slabs.buffer.is_pinned()
        for _ in range(2):
            with off.step():
                got = lora_step(tiny, off)
            assert same(got, ref)
        t = off.telemetry()[-1]
        p = off.policy.history[-1]
        assert (t["activations_spilled"], t["activations_restored"], t["spill_bytes"]) == (p.spilled, p.restored, p.spill_bytes)
        assert t["activations_spilled"] > 0.5 * t["activations_saved"] and t["pool_misses"] == 0
        assert t["d2h_bytes"] == t["spill_bytes"] and t["h2d_bytes"] > 0
        assert t["stall_time_ms"] >= 0 and t["vram_peak_mb"] > 0


def mlp(layers: int, dim: int, hidden: int):
    torch.manual_seed(0)
    return [(nn.Parameter(torch.randn(dim, hidden, device="cuda", dtype=torch.bfloat16) / dim ** 0.5),
             nn.Parameter(torch.randn(hidden, dim, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5))
            for _ in range(layers)]


def mlp_step(ws, x, off=None) -> tuple[list[torch.Tensor], int]:
    """One step; (gradients, peak allocated bytes during it)."""
    for a, b in ws:
        a.grad = b.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    h = x
    for i, (a, b) in enumerate(ws):
        if off is not None:
            h = layer_boundary(h, i, off)
        h = h + torch.nn.functional.gelu(h @ a) @ b
    h.float().pow(2).mean().backward()
    torch.cuda.synchronize()
    return [w.grad.clone() for pair in ws for w in pair], torch.cuda.max_memory_allocated()


@pytest.mark.parametrize("mode", ["watermark", "sync"])
def test_offload_lowers_the_peak(mode):
    ws = mlp(8, 1024, 4096)
    x = torch.randn(8192, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ref, ref_peak = mlp_step(ws, x)
    pool = PoolConfig(class_sizes_mb=[16.8, 67.2], slabs_per_class=[8, 16])
    act = cfg(mode, high_watermark_mb=300, low_watermark_mb=250, min_tensor_bytes=1 << 20, pool=pool,
              num_offload_layers=4, restore_lookahead=2)
    with ActivationOffloader(build_activation_policy(act, 8), act, "cuda") as off:
        for _ in range(2):
            with off.step():
                got, peak = mlp_step(ws, x, off)
            assert all(torch.equal(a, b) for a, b in zip(got, ref))
        t = off.telemetry()[-1]
    assert t["spill_bytes"] > 400e6
    # Much of what was spilled is off the device at the peak (the in-flight caps bound the rest).
    print(f"{mode}: peak {ref_peak / 1e6:.0f} -> {peak / 1e6:.0f} MB, spilled {t['spill_bytes'] / 1e6:.0f} MB, "
          f"stall {t['stall_time_ms']:.2f} ms")
    assert ref_peak - peak > 0.4 * t["spill_bytes"], (ref_peak, peak, t)


def test_a_corrupted_pinned_slab_is_caught(tiny):
    act = cfg("watermark", debug_checksums=True)
    off = ActivationOffloader(build_activation_policy(act, tiny.spec.num_layers), act, "cuda",
                              weights=ResidentWeights(tiny.weights))
    lora = init_lora(tiny.spec, 8, device="cuda", seed=3)
    with pytest.raises(ExecutorError, match="checksum mismatch for saved tensor"):
        with off.step():
            out = forward(tiny.spec, KernelTracking(DictSource(tiny.spec, tiny.weights), tiny.spec, off),
                          tiny.inputs, lora)
            name = next(d.target for d in off.log if d.action == "spill")
            off.host_copy(name)[0] ^= 0xFF
            sum(o.float().pow(2).mean() for o in out.values()).backward()
    off.close()


class SaveLowPrecision(torch.autograd.Function):
    seen: list = []

    @staticmethod
    def forward(ctx, x, dtype):
        low = x.to(dtype)
        ctx.save_for_backward(low)
        SaveLowPrecision.seen.append(low.view(torch.uint8).clone())
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (low,) = ctx.saved_tensors
        SaveLowPrecision.seen.append(low.view(torch.uint8).clone())
        return g * low.float(), None


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_round_trips_through_a_pinned_slab(dtype):
    x = torch.randn(1024, 512, device="cuda", requires_grad=True)
    act = cfg("watermark", high_watermark_mb=0, low_watermark_mb=0)
    with ActivationOffloader(build_activation_policy(act, 1), act, "cuda") as off:
        with off.step():
            SaveLowPrecision.apply(x, dtype).sum().backward()
        assert off.telemetry()[-1]["pool_hits"] == 1
    before, after = SaveLowPrecision.seen[-2:]
    assert torch.equal(before, after)
