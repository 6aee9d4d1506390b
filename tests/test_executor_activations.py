"""Activation spill in the executor, on the CPU "device": real copies into real slabs.

Losses and LoRA gradients must be bitwise identical to the same step without
offload; views, duplicates, non-dense tensors, float8, checksums and the pool's
books are checked on small models whose saved tensors the test controls.
"""
from __future__ import annotations

import gc
import warnings
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from engine.config import ActivationsConfig, PoolConfig
from engine.errors import ConfigError, ExecutorError
from engine.executor.model_hooks import KernelTracking, ResidentWeights, layer_boundary
from engine.executor.offloader import ActivationOffloader
from engine.executor.pinned_pool import PAGE, SlabPool
from engine.models import forward, load_spec, make_inputs
from engine.models.lora import init_lora
from engine.models.run import DictSource
from engine.models.seeded import random_weights
from engine.policy.schedule import replay
from engine.policy.activations import WatermarkPolicy, build_activation_policy

WORKLOAD = SimpleNamespace(kind="train_lora", batch=2, video_tokens=24, audio_tokens=6, text_tokens=5,
                           context_tokens=7, lora_rank=4)
# Class sizes (MB) that fit the tiny model's saved tensors (a few KB to ~50 KB).
SMALL_POOL = PoolConfig(class_sizes_mb=[0.002, 0.01, 0.05], slabs_per_class=[300, 200, 20])


def cfg(mode: str = "watermark", **kw) -> ActivationsConfig:
    base = dict(mode=mode, high_watermark_mb=0.05, low_watermark_mb=0.03, min_tensor_bytes=0,
                pool=SMALL_POOL, num_offload_layers=3)
    return ActivationsConfig(**{**base, **kw})


def offloader(act: ActivationsConfig, num_layers: int = 4, **kw) -> ActivationOffloader:
    return ActivationOffloader(build_activation_policy(act, num_layers), act, "cpu", **kw)


@pytest.fixture(scope="module")
def tiny():
    spec = load_spec("tiny", WORKLOAD)
    return SimpleNamespace(spec=spec, weights=random_weights(spec, seed=0),
                           inputs=make_inputs(spec, WORKLOAD, seed=1))


def lora_step(tiny, off: ActivationOffloader | None = None):
    """One LoRA training step; (loss, gradients). Fresh adapters each call, same seed."""
    lora = init_lora(tiny.spec, 4, seed=3)
    source = DictSource(tiny.spec, tiny.weights)
    if off is not None:
        source = KernelTracking(source, tiny.spec, off)
    out = forward(tiny.spec, source, tiny.inputs, lora)
    loss = sum(o.float().pow(2).mean() for o in out.values())
    loss.backward()
    return loss.detach(), {k: t.grad for k, t in lora.items()}


def assert_bitwise(got, ref) -> None:
    assert torch.equal(got[0], ref[0])
    assert got[1].keys() == ref[1].keys()
    for k in ref[1]:
        assert torch.equal(got[1][k], ref[1][k]), k


def assert_counts_match_policy(off: ActivationOffloader) -> None:
    t = off.telemetry()[-1]
    p = off.policy.history[-1]
    assert (t["activations_saved"], t["activations_kept"], t["activations_spilled"], t["activations_restored"]) == (p.saved, p.kept, p.spilled, p.restored)
    assert (t["spill_bytes"], t["restore_bytes"]) == (p.spill_bytes, p.restore_bytes)
    assert (t["pool_hits"], t["pool_misses"]) == (p.pool_hits, p.pool_misses)
    assert t["d2h_bytes"] == t["spill_bytes"]  # every spill is one copy out


# ----- the tiny LoRA step, bitwise


@pytest.mark.parametrize("mode", ["watermark", "sync"])
def test_lora_step_is_bitwise_identical_and_counts_match_the_policy(tiny, mode):
    ref = lora_step(tiny)
    off = offloader(cfg(mode), weights=ResidentWeights(tiny.weights))
    for _ in range(2):  # the second step reuses every slab
        with off.step():
            got = lora_step(tiny, off)
        assert_bitwise(got, ref)
        assert_counts_match_policy(off)
    t = off.telemetry()[-1]
    assert t["activations_spilled"] >= 0.6 * t["activations_saved"]
    assert t["activations_restored"] == t["activations_spilled"] and t["h2d_bytes"] == t["restore_bytes"]
    assert t["weight_handles"] > 0  # frozen weights are held as handles, not spilled
    # The hooks timed their calls: every tensor autograd saved is unpacked once in backward.
    assert t["pack_hook_calls"] == t["unpack_hook_calls"] >= t["activations_saved"] > 0
    assert t["kernel_hook_calls"] > 0 and min(t[f"{h}_hook_us"] for h in ("pack", "unpack", "kernel")) > 0
    assert t["held"] > 0  # LoRA adapters: trainable leaves stay
    actions = {d.action for d in off.log}
    if mode == "sync":
        assert {"offload_group", "wait_offload", "reload_group"} <= actions
    else:
        assert {"spill", "restore", "release"} <= actions
    for c, n in enumerate(SMALL_POOL.slabs_per_class):  # every slab came back
        assert off.slabs.free_slabs(c) == n
    off.close()


def test_replayed_questions_give_the_same_decisions(tiny):
    act = cfg("watermark")
    off = offloader(act)
    questions = []
    for _ in range(2):
        with off.step():
            lora_step(tiny, off)
        questions += off.questions
    assert replay(build_activation_policy(act, 4), questions) == off.log


def test_checksums_pass_on_an_honest_step(tiny):
    off = offloader(cfg("watermark", debug_checksums=True))
    with off.step():
        got = lora_step(tiny, off)
    assert_bitwise(got, lora_step(tiny))


def test_spilled_plus_device_bytes_equal_the_no_offload_figure(tiny):
    def forward_end_bytes(off):
        lora = init_lora(tiny.spec, 4, seed=3)
        with off.step():
            out = forward(tiny.spec, KernelTracking(DictSource(tiny.spec, tiny.weights), tiny.spec, off),
                          tiny.inputs, lora)
            on, away = off.device_bytes, off.off_device_bytes
            sum(o.float().pow(2).mean() for o in out.values()).backward()
        return on, away

    total, none_away = forward_end_bytes(offloader(cfg("watermark", high_watermark_mb=1e6, low_watermark_mb=1e6)))
    assert none_away == 0 and total > 0
    for mode in ("watermark", "sync"):
        on, away = forward_end_bytes(offloader(cfg(mode)))
        assert away > 0.4 * total
        assert on + away == total, mode


def test_without_a_pool_sync_spills_are_misses(tiny):
    ref = lora_step(tiny)
    off = offloader(cfg("sync", pool=PoolConfig()))
    with off.step():
        assert_bitwise(lora_step(tiny, off), ref)
    t = off.telemetry()[-1]
    assert t["pool_misses"] == t["activations_spilled"] > 0 and t["pool_hits"] == 0


def test_pool_hits_and_misses_are_counted(tiny):
    pool = PoolConfig(class_sizes_mb=[0.01], slabs_per_class=[5])
    ref = lora_step(tiny)
    off = offloader(cfg("watermark", pool=pool))
    with off.step():
        assert_bitwise(lora_step(tiny, off), ref)
    assert_counts_match_policy(off)
    t = off.telemetry()[-1]
    assert t["pool_hits"] > 0 and t["pool_misses"] > 0
    assert off.slabs.free_slabs(0) == 5


def test_small_tensors_stay_unasked(tiny):
    """Tensors under min_tensor_bytes are held as they are: the policy never hears of them."""
    ref = lora_step(tiny)
    every = offloader(cfg("watermark", min_tensor_bytes=0))
    with every.step():
        lora_step(tiny, every)
    all_sizes = [q[2] for q in every.questions if q[0] == "save"]
    off = offloader(cfg("watermark", min_tensor_bytes=10_000))
    with off.step():
        assert_bitwise(lora_step(tiny, off), ref)
    sizes = {q[1]: q[2] for q in off.questions if q[0] == "save"}
    spilled = {d.target for d in off.log if d.action in ("spill", "miss")}
    assert spilled and all(n >= 10_000 for n in sizes.values())
    small = sum(n < 10_000 for n in all_sizes)
    assert small and len(sizes) == len(all_sizes) - small
    t, t_every = off.telemetry()[-1], every.telemetry()[-1]
    assert t["activations_saved"] == len(sizes) and t["held"] >= t_every["held"] + small


# ----- tensor groups: views, duplicates, non-dense tensors, dtypes


class SaveViews(torch.autograd.Function):
    """Saves q, k, v: three views of one qkv; backward records what it got back."""

    seen: list = []

    @staticmethod
    def forward(ctx, qkv):
        q, k, v = qkv.chunk(3, dim=-1)
        ctx.save_for_backward(q, k, v)
        return q * k * v

    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors
        SaveViews.seen.append((q, k, v))
        return torch.cat([g * k * v, g * q * v, g * q * k], dim=-1)


def test_views_go_out_once_through_their_base_and_come_back_as_views():
    x = torch.randn(8, 96, requires_grad=True)

    def step(off=None):
        x.grad = None
        qkv = x * 2  # the base: an activation
        SaveViews.apply(qkv).sum().backward()
        return qkv, x.grad.clone()

    _, ref = step()
    off = offloader(cfg("watermark", high_watermark_mb=0, low_watermark_mb=0), num_layers=1)
    with off.step():
        qkv, got = step(off)
    assert torch.equal(got, ref)
    t = off.telemetry()[-1]
    assert t["activations_saved"] == 1 and t["d2h_bytes"] == qkv.numel() * qkv.element_size()
    q, k, v = SaveViews.seen[-1]
    storage = q.untyped_storage().data_ptr()
    assert storage != qkv.untyped_storage().data_ptr()  # restored, not the original
    assert k.untyped_storage().data_ptr() == storage == v.untyped_storage().data_ptr()
    assert (k.storage_offset() - q.storage_offset(), v.storage_offset() - k.storage_offset()) == (32, 32)
    assert q.stride() == qkv.stride() and torch.equal(torch.cat([q, k, v], -1), qkv)


def test_a_tensor_saved_twice_goes_out_once():
    x = torch.randn(64, 32, requires_grad=True)

    def step():
        x.grad = None
        a = x * 3  # a scalar multiply saves nothing
        (a * a).sum().backward()  # saves a twice
        return a, x.grad.clone()

    _, ref = step()
    off = offloader(cfg("watermark", high_watermark_mb=0, low_watermark_mb=0), num_layers=1)
    with off.step():
        a, got = step()
    assert torch.equal(got, ref)
    t = off.telemetry()[-1]
    assert t["activations_saved"] == 1 and t["d2h_bytes"] == a.numel() * a.element_size()
    assert len([q for q in off.questions if q[0] == "unpack"]) == 1


def test_non_dense_tensors_are_made_contiguous_with_one_warning():
    p = torch.randn(6, 5, requires_grad=True)
    gaps = [torch.empty_strided((6, 5), (10, 2)).copy_(torch.randn(6, 5)) for _ in range(2)]

    def step():
        p.grad = None
        sum((p * s).sum() for s in gaps).backward()  # saves each gapped tensor (no base)
        return p.grad.clone()

    ref = step()
    off = offloader(cfg("watermark", high_watermark_mb=0, low_watermark_mb=0), num_layers=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with off.step():
            got = step()
    assert torch.equal(got, ref)
    assert [str(w.message) for w in caught if "contiguous" in str(w.message)].__len__() == 1
    assert off.telemetry()[-1]["activations_spilled"] == 2


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


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16])
def test_low_precision_dtypes_round_trip_bitwise(dtype):
    x = torch.randn(256, 16, requires_grad=True)
    off = offloader(cfg("watermark", high_watermark_mb=0, low_watermark_mb=0), num_layers=1)
    with off.step():
        SaveLowPrecision.apply(x, dtype).sum().backward()
    before, after = SaveLowPrecision.seen[-2:]
    assert torch.equal(before, after)
    assert off.telemetry()[-1]["activations_spilled"] == 1


# ----- checksums


def test_a_corrupted_slab_is_caught_naming_the_tensor_and_layer(tiny):
    off = offloader(cfg("watermark", debug_checksums=True))
    lora = init_lora(tiny.spec, 4, seed=3)
    with pytest.raises(ExecutorError, match=r"checksum mismatch for saved tensor (\S+) \(layer -?\d+\)") as err:
        with off.step():
            out = forward(tiny.spec, KernelTracking(DictSource(tiny.spec, tiny.weights), tiny.spec, off),
                          tiny.inputs, lora)
            name = next(d.target for d in off.log if d.action == "spill")
            off.host_copy(name)[0] ^= 0xFF
            sum(o.float().pow(2).mean() for o in out.values()).backward()
    assert name in str(err.value)
    with pytest.raises(ExecutorError, match="stopped after an earlier failure"):
        with off.step():
            pass


# ----- decision parity and layer boundaries


class Saves(torch.autograd.Function):
    """Saves fresh tensors of the given element counts (float32)."""

    @staticmethod
    def forward(ctx, x, *numels):
        ctx.save_for_backward(*(torch.full((n,), float(i)) for i, n in enumerate(numels)))
        return x * 1.5

    @staticmethod
    def backward(ctx, g):
        saved = ctx.saved_tensors
        return (g * 1.5,) + (None,) * len(saved)


def test_decision_parity_with_a_bare_policy_on_a_known_sequence():
    sizes = {0: [300, 40, 900], 1: [50, 700], 2: [600, 600, 10]}  # elements per saved tensor, by layer
    x = torch.randn(4, requires_grad=True)
    act = cfg("watermark", high_watermark_mb=0.005, low_watermark_mb=0.003, min_tensor_bytes=1000)
    off = offloader(act, num_layers=3)
    with off.step():
        h = x
        for layer, numels in sizes.items():
            h = Saves.apply(layer_boundary(h, layer, off), *numels)
        h.sum().backward()
    # The questions, written out: forward saves in order, backward layer by layer in reverse.
    expected, n = [], 0
    names: dict[int, list[str]] = {}
    for layer, numels in sizes.items():
        if layer:
            expected.append(("layer_end", "fwd", layer - 1))
        expected.append(("layer_start", "fwd", layer))
        for k in numels:
            if 4 * k >= act.min_tensor_bytes:  # smaller: held unasked, but it takes its name
                names.setdefault(layer, []).append(f"t{n}")
                expected.append(("save", f"t{n}", 4 * k, layer))
            n += 1
    expected += [("layer_end", "fwd", 2), ("layer_start", "bwd", 2)]
    for layer in (2, 1, 0):
        if layer < 2:
            expected += [("layer_end", "bwd", layer + 1), ("layer_start", "bwd", layer)]
        expected += [("unpack", name) for name in names[layer]]
    expected += [("layer_end", "bwd", 0), ("step_end",)]
    assert off.questions == expected
    bare = WatermarkPolicy(act)
    assert replay(bare, expected) == off.log
    assert {d.action for d in off.log} >= {"keep", "spill", "restore", "release"}


def mlp_step(ws, x, off=None, layers=True):
    for w in ws:
        w.grad = None
    h = x
    for i, w in enumerate(ws):
        if off is not None and layers:
            h = layer_boundary(h, i, off)
        h = torch.tanh(h @ w) * 1.1
    h.pow(2).mean().backward()
    return [w.grad.clone() for w in ws]


def test_sync_reloads_ahead_through_layer_boundary_markers():
    torch.manual_seed(0)
    ws = [nn.Parameter(torch.randn(32, 32) / 6) for _ in range(6)]
    x = torch.randn(64, 32)
    ref = mlp_step(ws, x)
    off = offloader(cfg("sync", num_offload_layers=3), num_layers=6)
    with off.step():
        got = mlp_step(ws, x, off)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    actions = [d.action for d in off.log]
    assert actions.count("reload_group") == 3 and actions.count("offload_group") == 3
    assert "restore" not in actions  # every group was reloaded before backward needed it
    assert off.telemetry()[-1]["held"] == 5  # the parameters that backward needs (not the first)


def test_module_hooks_give_layers_to_a_plain_module():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])
    x = torch.randn(32, 16, requires_grad=True)

    def step(off=None):
        model.zero_grad()
        x.grad = None
        model(x).pow(2).sum().backward()
        return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]

    ref = step()
    off = offloader(cfg("watermark", high_watermark_mb=0.003, low_watermark_mb=0.002), num_layers=4)
    hooks = off.layer_hooks({block: i for i, block in enumerate(model)})
    with off.step():
        got = step(off)
    for h in hooks:
        h.remove()
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    layers = {q[3] for q in off.questions if q[0] == "save"}
    assert layers == {0, 1, 2, 3}
    assert off.telemetry()[-1]["held"] == 5  # the 4 weights and x: leaves that require grad


# ----- managed weights: the seam to the weight runtime


class FakeWeightStore:
    """Stands in for the weight runtime: device weights it may evict, fetched again on demand."""

    def __init__(self, host: dict[str, torch.Tensor]):
        self.host = host
        self.device = {n: t.clone() for n, t in host.items()}
        self.fetched: list[str] = []

    def handle(self, t):
        for name, w in self.device.items():
            if t.untyped_storage().data_ptr() == w.untyped_storage().data_ptr():
                return name, tuple(t.shape), t.stride(), t.storage_offset() - w.storage_offset()
        return None

    def fetch(self, handle):
        name, size, stride, offset = handle
        self.fetched.append(name)
        w = self.device.get(name)
        if w is None:
            w = self.device[name] = self.host[name].clone()
        return w.as_strided(size, stride, w.storage_offset() + offset)

    def evict_all(self) -> None:
        self.device.clear()


def test_managed_weights_are_held_as_handles_and_fetched_again():
    torch.manual_seed(0)
    store = FakeWeightStore({"w0": torch.randn(16, 16), "w1": torch.randn(16, 16)})
    x = torch.randn(8, 16, requires_grad=True)

    def step(off=None):
        x.grad = None
        h = x
        for name in ("w0", "w1"):
            h = torch.tanh(h @ store.device[name].t())  # saves a view of the weight
        return h

    step().sum().backward()
    ref = x.grad.clone()
    off = offloader(cfg("watermark"), num_layers=1, weights=store)
    with off.step():
        out = step(off)
        alive = weakref.ref(store.device["w0"])
        store.evict_all()  # the runtime evicts after the forward
        gc.collect()
        assert alive() is None  # nothing (autograd included) held the weight
        out.sum().backward()
    assert torch.equal(x.grad, ref)
    assert sorted(store.fetched) == ["w0", "w1"]
    assert off.telemetry()[-1]["weight_handles"] == 2


def test_resident_weights_rebuild_views():
    w = {"a": torch.randn(4, 6)}
    rw = ResidentWeights(w)
    view = w["a"].t()[1:3]
    assert torch.equal(rw.fetch(rw.handle(view)), view)
    assert rw.handle(torch.randn(4, 6)) is None


def test_resident_weights_packed_in_one_storage_at_several_dtypes():
    """Weights bound into a packed block (bytes, each weight a view at its own dtype) share one
    storage: each saved view is rebuilt over a weight of its own dtype there."""
    block = torch.zeros(96, dtype=torch.uint8)
    w = {"norm": block[:32].view(torch.float32), "proj": block[32:].view(torch.bfloat16).view(4, 8)}
    w["norm"].copy_(torch.arange(8.0))
    w["proj"].copy_(torch.randn(4, 8))
    rw = ResidentWeights(w)
    for view in (w["norm"][2:6], w["proj"].t()[1:3]):
        assert torch.equal(rw.fetch(rw.handle(view)), view)
    with pytest.raises(ExecutorError, match="views weight .* as torch.float16"):
        rw.handle(block[32:].view(torch.float16))


# ----- misuse fails loudly


def test_a_step_without_backward_fails_and_stops_the_offloader():
    x = torch.randn(4, 4, requires_grad=True)
    off = offloader(cfg("watermark"), num_layers=1)
    with pytest.raises(ExecutorError, match="never used"):
        with off.step():
            y = (x * 2).tanh().sum()
    with pytest.raises(ExecutorError, match="stopped after an earlier failure"):
        y.backward()


def test_a_second_backward_over_the_graph_fails():
    x = torch.randn(4, 4, requires_grad=True)
    off = offloader(cfg("watermark"), num_layers=1)
    with off.step():
        y = (x * 2).tanh().sum()
        y.backward(retain_graph=True)
    with pytest.raises(ExecutorError, match="after that step ended"):
        with off.step():
            y.backward()
    off = offloader(cfg("watermark"), num_layers=1)
    with pytest.raises(ExecutorError, match="retain_graph"):
        with off.step():
            y = (x * 2).tanh().sum()
            y.backward(retain_graph=True)
            y.backward()


def test_the_policy_must_match_the_mode():
    act = cfg("sync")
    with pytest.raises(ExecutorError, match="SyncDictPolicy|WatermarkPolicy"):
        ActivationOffloader(WatermarkPolicy(cfg("watermark")), act, "cpu")
    with pytest.raises(ConfigError, match="mode off"):
        ActivationOffloader(WatermarkPolicy(cfg("watermark")), cfg("off"), "cpu")


# ----- the slab pool


def test_slabs_have_exact_sizes_and_come_back():
    pool = SlabPool([1000, 5000], [3, 1], pin=False)
    assert pool.nbytes == 3 * PAGE + 2 * PAGE
    slabs = [pool.take(0) for _ in range(3)]
    assert all(s.data.numel() == 1000 and s.data.dtype == torch.uint8 for s in slabs)
    assert len({s.data.data_ptr() for s in slabs}) == 3
    with pytest.raises(ExecutorError, match="all 3 are in use"):
        pool.take(0)
    with pytest.raises(ExecutorError, match="has 2 classes"):
        pool.take(2)
    pool.give_back(slabs[0], None)
    assert pool.free_slabs(0) == 1 and pool.take(1).data.numel() == 5000


def test_on_demand_restores_are_told_apart_from_predictive_ones(tiny):
    """An on-demand restore must not queue behind predictive ones (on CUDA: a stream of its own);
    the executor flags exactly the restores of the tensor being unpacked."""
    def restores(act: ActivationsConfig) -> list[bool]:
        off = offloader(act, weights=ResidentWeights(tiny.weights))
        seen: list[bool] = []
        copy = off._copies.restore

        def flagged(*args, on_demand: bool = False):
            seen.append(on_demand)
            return copy(*args, on_demand=on_demand)

        off._copies.restore = flagged
        with off.step():
            lora_step(tiny, off)
        off.close()
        return seen

    on_demand = restores(cfg(restore_lookahead=0, restore_within_low_watermark=False))
    assert on_demand and all(on_demand)
    ahead = restores(cfg(restore_lookahead=4, restore_within_low_watermark=False))
    assert len(ahead) == len(on_demand)  # the same tensors come back, most of them ahead of need
    assert sum(ahead) < len(ahead) // 2
