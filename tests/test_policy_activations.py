"""Size-class pool, watermark validation and the watermark spill policy."""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.config import ActivationsConfig, PoolConfig
from engine.errors import ConfigError
from engine.policy import Decision
from engine.policy.activations import WatermarkPolicy, build_activation_policy, validate_watermarks
from engine.policy.saved import SizeClassPool
from engine.policy.sync import SyncDictPolicy

MB = 1_000_000
STAGEHAND = PoolConfig(class_sizes_mb=[1, 4, 16, 64, 256], slabs_per_class=[512, 2, 2, 2, 2])


def stagehand_pool() -> SizeClassPool:
    return SizeClassPool([s * MB for s in STAGEHAND.class_sizes_mb], STAGEHAND.slabs_per_class)


# --- SizeClassPool --------------------------------------------------------------

def test_stagehand_200mb_tensors_two_hits_then_a_miss():
    pool = stagehand_pool()
    assert [pool.acquire(200 * MB) for _ in range(3)] == [4, 4, None]
    assert (pool.hits, pool.misses, pool.in_use(4)) == (2, 1, 2)


def test_stagehand_3mb_tensor_moves_up_when_its_class_is_full():
    pool = stagehand_pool()
    assert [pool.acquire(3 * MB) for _ in range(7)] == [1, 1, 2, 2, 3, 3, 4]
    pool.release(1)
    assert pool.acquire(3 * MB) == 1
    assert (pool.hits, pool.misses) == (8, 0)


def test_class_sizes_are_exact():
    pool = stagehand_pool()
    assert pool.acquire(4 * MB) == 1
    assert pool.acquire(4 * MB + 1) == 2
    assert pool.acquire(256 * MB + 1) is None


def test_release_of_a_class_with_nothing_in_use_raises():
    pool = stagehand_pool()
    with pytest.raises(ValueError, match="released twice"):
        pool.release(0)


class PoolMachine(RuleBasedStateMachine):
    """Random acquires and releases against a model of the books."""

    SIZES = [10, 40, 160]
    SLABS = [3, 1, 2]

    def __init__(self):
        super().__init__()
        self.pool = SizeClassPool(self.SIZES, self.SLABS)
        self.held: list[int] = []
        self.misses = 0

    @rule(nbytes=st.integers(0, 200))
    def acquire(self, nbytes):
        free = [c for c in range(3)
                if self.SIZES[c] >= nbytes and self.held.count(c) < self.SLABS[c]]
        got = self.pool.acquire(nbytes)
        assert got == (free[0] if free else None)
        if got is None:
            self.misses += 1
        else:
            self.held.append(got)

    @precondition(lambda self: self.held)
    @rule(k=st.integers(0, 100))
    def release(self, k):
        c = self.held.pop(k % len(self.held))
        self.pool.release(c)

    @rule(c=st.integers(0, 2))
    def release_free_class_raises(self, c):
        if c not in self.held:
            with pytest.raises(ValueError):
                self.pool.release(c)

    @invariant()
    def books_match(self):
        for c in range(3):
            assert self.pool.in_use(c) == self.held.count(c) <= self.SLABS[c]
        assert self.pool.misses == self.misses


TestPoolNeverDoubleBooks = PoolMachine.TestCase
TestPoolNeverDoubleBooks.settings = settings(max_examples=100, deadline=None)


# --- validate_watermarks ------------------------------------------------------------

def act(**kw) -> ActivationsConfig:
    base = dict(mode="watermark", high_watermark_mb=10.0, low_watermark_mb=6.0,
                pool=PoolConfig(class_sizes_mb=[4, 16], slabs_per_class=[1, 1]),
                restore_lookahead=1, min_tensor_bytes=MB)
    base.update(kw)
    return ActivationsConfig(**base)


@pytest.mark.parametrize("kw, reason", [
    (dict(low_watermark_mb=11.0), "low_watermark_mb=11.0 is above high_watermark_mb=10.0"),
    (dict(high_watermark_mb=-1.0, low_watermark_mb=-2.0), "high_watermark_mb=-1.0 is negative"),
    (dict(pool=PoolConfig()), "class_sizes_mb is empty"),
    (dict(pool=PoolConfig([4, 16], [1])), "has 2 classes but slabs_per_class has 1"),
    (dict(pool=PoolConfig([4, 4], [1, 1])), "strictly increasing"),
    (dict(pool=PoolConfig([16, 4], [1, 1])), "strictly increasing"),
    (dict(pool=PoolConfig([0, 4], [1, 1])), "not positive"),
    (dict(pool=PoolConfig([4, 16], [1, 0])), r"slabs_per_class\[1\]=0"),
    (dict(max_inflight_d2h=0), "max_inflight_d2h=0"),
    (dict(max_inflight_h2d=0), "max_inflight_h2d=0"),
    (dict(restore_lookahead=-1), "restore_lookahead=-1"),
    (dict(min_tensor_bytes=-1), "min_tensor_bytes=-1"),
])
def test_invalid_watermark_configs_are_rejected_with_their_reason(kw, reason):
    with pytest.raises(ConfigError, match=reason):
        validate_watermarks(act(**kw))


def test_valid_watermark_config_passes():
    validate_watermarks(act())


# --- WatermarkPolicy -------------------------------------------------------------------

def forward(policy, saves):
    return [policy.on_save(name, nbytes, layer) for name, nbytes, layer in saves]


SAVES = [(f"t{i}", 3 * MB, i) for i in range(6)] + [("s", MB // 2, 6)]


def test_watermark_hysteresis_worked_example():
    p = WatermarkPolicy(act())  # high 10 MB, low 6 MB; slabs: 4 MB x1, 16 MB x1
    out = forward(p, SAVES)
    assert out == [
        [Decision(0, 0, "keep", "t0")],  # 3 MB
        [Decision(0, 1, "keep", "t1")],  # 6
        [Decision(0, 2, "keep", "t2")],  # 9: under high
        # 12 > 10: spill oldest first until <= 6; t1 moves up to the 16 MB class
        [Decision(0, 0, "spill", "t0", 0), Decision(0, 1, "spill", "t1", 1),
         Decision(0, 3, "keep", "t3")],
        [Decision(0, 4, "keep", "t4")],  # 9: above low, under high: hysteresis keeps it
        # 12 > 10 again: the pool is full, both fall back to unpinned memory
        [Decision(0, 2, "miss", "t2"), Decision(0, 3, "miss", "t3"), Decision(0, 5, "keep", "t5")],
        [Decision(0, 6, "keep", "s")],  # under min_tensor_bytes: always kept
    ]
    assert p.saved.device_bytes == 6 * MB + MB // 2


def test_watermark_restores_predictively_in_backward_order():
    p = WatermarkPolicy(act(restore_within_low_watermark=False))  # restore_lookahead 1, nothing more
    forward(p, SAVES)
    back = {name: p.on_unpack(name) for name in ["s", "t5", "t4", "t3", "t2", "t1", "t0"]}
    assert back == {
        "s": [Decision(0, 3, "restore", "t3"), Decision(0, 6, "release", "s")],
        "t5": [Decision(0, 5, "release", "t5")],  # t3 (the window) is on its way
        "t4": [Decision(0, 4, "release", "t4")],
        "t3": [Decision(0, 2, "restore", "t2"), Decision(0, 3, "release", "t3")],
        "t2": [Decision(0, 1, "restore", "t1"), Decision(0, 2, "release", "t2")],
        "t1": [Decision(0, 0, "restore", "t0"), Decision(0, 1, "release", "t1")],
        "t0": [Decision(0, 0, "release", "t0")],
    }
    assert p.saved.pool.in_use(0) == p.saved.pool.in_use(1) == 0
    p.on_step_end()
    c = p.history[0]
    assert (c.saved, c.kept, c.spilled, c.restored) == (7, 3, 4, 4)
    assert (c.spill_bytes, c.restore_bytes, c.pool_hits, c.pool_misses) == (
        12 * MB, 12 * MB, 2, 2)
    assert c.peak_device_bytes == 12 * MB


def test_without_lookahead_restores_are_on_demand():
    p = WatermarkPolicy(act(restore_lookahead=0, restore_within_low_watermark=False))
    forward(p, SAVES)
    assert p.on_unpack("t5") == [Decision(0, 5, "release", "t5")]
    assert p.on_unpack("t3") == [Decision(0, 3, "restore", "t3"), Decision(0, 3, "release", "t3")]


def test_watermark_restores_ahead_while_under_the_low_watermark():
    p = WatermarkPolicy(act())  # low 6 MB; after forward t4, t5 and s hold 6.5 MB
    forward(p, SAVES)
    back = {name: p.on_unpack(name) for name in ["s", "t5", "t4", "t3", "t2", "t1", "t0"]}
    assert back == {
        "s": [Decision(0, 3, "restore", "t3"), Decision(0, 6, "release", "s")],  # the window of 1
        "t5": [Decision(0, 5, "release", "t5")],  # 9 MB once t5 goes: no room for t2
        "t4": [Decision(0, 2, "restore", "t2"), Decision(0, 4, "release", "t4")],  # 3 + 3 MB: room
        "t3": [Decision(0, 1, "restore", "t1"), Decision(0, 3, "release", "t3")],  # beyond the window
        "t2": [Decision(0, 0, "restore", "t0"), Decision(0, 2, "release", "t2")],
        "t1": [Decision(0, 1, "release", "t1")],
        "t0": [Decision(0, 0, "release", "t0")],
    }
    p.on_step_end()
    assert p.history[0].peak_device_bytes == 12 * MB  # forward's; backward stayed under it


def test_restores_ahead_stop_short_of_the_inflight_cap():
    p = WatermarkPolicy(act(restore_lookahead=0, max_inflight_h2d=2, low_watermark_mb=6.0))
    forward(p, SAVES)
    for name in ["s", "t5", "t4"]:
        p.on_unpack(name)
    # 6 MB free under the low watermark would take t3 and t2; the cap of 2 in flight allows 1 ahead.
    assert [d.target for d in p.log if d.action == "restore"] == ["t3"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 8), min_size=2, max_size=30), st.integers(2, 30))
def test_restores_ahead_never_lift_saved_bytes_over_the_low_watermark(sizes_mb, low_mb):
    p = WatermarkPolicy(act(high_watermark_mb=low_mb + 2.0, low_watermark_mb=float(low_mb), restore_lookahead=0,
                            pool=PoolConfig([8], [len(sizes_mb)])))
    names = [f"t{i}" for i in range(len(sizes_mb))]
    forward(p, [(n, mb * MB, i) for i, (n, mb) in enumerate(zip(names, sizes_mb))])
    for n in reversed(names):
        rec = p.saved.records[n]
        on_demand = rec.nbytes if rec.spilled and not rec.restored else 0
        before = p.saved.device_bytes
        p.on_unpack(n)
        assert p.saved.device_bytes <= max(p.low_bytes, before + on_demand - rec.nbytes)
    p.on_step_end()
    c = p.history[0]
    assert c.restored == c.spilled


def test_step_end_with_unreleased_tensors_raises_and_steps_repeat():
    p = WatermarkPolicy(act())
    forward(p, SAVES)
    with pytest.raises(RuntimeError, match="7 saved tensors never unpacked"):
        p.on_step_end()
    for name in ["s", "t5", "t4", "t3", "t2", "t1", "t0"]:
        p.on_unpack(name)
    p.on_step_end()
    second = forward(p, SAVES)
    assert second[3][0] == Decision(1, 0, "spill", "t0", 0)  # slabs came back


def test_unpack_of_an_unknown_tensor_and_double_save_raise():
    p = WatermarkPolicy(act())
    p.on_save("x", MB, 0)
    with pytest.raises(ValueError, match="saved twice"):
        p.on_save("x", MB, 0)
    p.on_unpack("x")
    with pytest.raises(ValueError, match="unpacked twice"):
        p.on_unpack("x")


def test_high_watermark_zero_spills_every_large_tensor():
    p = WatermarkPolicy(act(high_watermark_mb=0.0, low_watermark_mb=0.0))
    assert p.on_save("a", 2 * MB, 0) == [Decision(0, 0, "spill", "a", 0)]
    assert p.on_save("b", 100, 0) == [Decision(0, 0, "keep", "b")]


# --- the registry and the config group -------------------------------------------------

def test_build_activation_policy_by_mode():
    assert build_activation_policy(act(mode="off"), 8) is None
    assert isinstance(build_activation_policy(act(), 8), WatermarkPolicy)
    assert isinstance(build_activation_policy(act(mode="sync", num_offload_layers=3), 8),
                      SyncDictPolicy)
    with pytest.raises(ConfigError, match="'spill' is not one of off, watermark, sync"):
        build_activation_policy(act(mode="spill"), 8)


def compose_activations(name: str, *overrides: str):
    from hydra import compose, initialize_config_dir

    from engine.config import register

    register()
    conf = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "conf"))
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        return compose("config", overrides=["model=tiny", f"activations={name}", *overrides]).activations


def test_activation_groups_compose_and_validate():
    assert compose_activations("off").mode == "off"
    wm = compose_activations("watermark")
    assert wm.pool.exact and not wm.pool.class_sizes_mb  # sized per step by engine.job.prepare
    with pytest.raises(ConfigError, match="never sized"):
        build_activation_policy(wm, 16)
    wm = compose_activations("watermark", "activations/pool=stagehand")
    assert list(wm.pool.class_sizes_mb) == [1, 4, 16, 64, 256]
    assert list(wm.pool.slabs_per_class) == [512, 2, 2, 2, 2]
    assert wm.low_watermark_mb < wm.high_watermark_mb
    assert isinstance(build_activation_policy(wm, 16), WatermarkPolicy)
    sync = compose_activations("sync", "activations/pool=stagehand")
    assert sync.sync_dict is None and sync.num_offload_layers > 0
    assert isinstance(build_activation_policy(sync, 16), SyncDictPolicy)


# ----- the exact pool (activations/pool=exact)

QUESTIONS = [("layer_start", "fwd", 0), ("save", "a", 2 * MB, 0), ("save", "b", 2 * MB, 0),
             ("save", "small", 1000, 0), ("save", "c", 1 * MB, 0), ("layer_end", "fwd", 0),
             ("layer_start", "bwd", 0), ("unpack", "c"), ("unpack", "small"), ("unpack", "b"), ("unpack", "a"),
             ("layer_end", "bwd", 0), ("step_end",)]


def test_exact_pool_holds_every_spill_of_the_step_at_once():
    from engine.policy.schedule import replay
    from engine.policy.pool_sizing import exact_pool

    spill_all = ActivationsConfig(mode="watermark", high_watermark_mb=0, low_watermark_mb=0, min_tensor_bytes=MB)
    sized = exact_pool(spill_all, QUESTIONS, 1)
    assert sized == {"class_sizes_mb": [1.0, 2.0], "slabs_per_class": [1, 2]}  # "small" stays, under min_tensor_bytes
    policy = WatermarkPolicy(ActivationsConfig(**{**spill_all.__dict__, "pool": PoolConfig(**sized)}))
    actions = [d.action for d in replay(policy, QUESTIONS)]
    assert actions.count("spill") == 3 and "miss" not in actions


def test_exact_pool_of_a_step_that_never_spills_is_one_slab():
    from engine.policy.pool_sizing import exact_pool

    roomy = ActivationsConfig(mode="watermark", high_watermark_mb=100, low_watermark_mb=90, min_tensor_bytes=MB)
    assert exact_pool(roomy, QUESTIONS, 1) == {"class_sizes_mb": [1.0], "slabs_per_class": [1]}
    with pytest.raises(ConfigError, match="min_tensor_bytes"):
        exact_pool(ActivationsConfig(mode="watermark", min_tensor_bytes=10 * MB), QUESTIONS, 1)


def test_the_simulator_asks_a_trace_step_the_questions_step_questions_lists():
    """The launcher asks in step_questions' order (the one schedule); the sized pool is only exact if they agree."""
    from types import SimpleNamespace

    from engine.config import HardwareConfig
    from engine.policy.pool_sizing import exact_pool
    from engine.policy.schedule import step_questions
    from engine.models import load_spec
    from engine.models.synthesize import synthesize

    workload = dict(name="train_lora", kind="train_lora", batch=1, video_tokens=64, audio_tokens=16, text_tokens=8,
                    context_tokens=0, lora_rank=4, steps=2)
    hw = HardwareConfig(name="t", source="t", device_memory_mb=80000, h2d_gbps=50.0, d2h_gbps=50.0,
                        duplex_gbps=80.0, pageable_gbps=7.0, mmap_gbps=7.0, mmap_registered_gbps=50.0,
                        matmul_tflops=500.0, hbm_gbps=2000.0)
    from omegaconf import OmegaConf

    trace = synthesize(load_spec("tiny", SimpleNamespace(**workload)), OmegaConf.create(workload), hw)
    act = ActivationsConfig(mode="sync", num_offload_layers=2, min_tensor_bytes=0)
    questions = step_questions(trace.records, 0)
    act = ActivationsConfig(**{**act.__dict__, "pool": PoolConfig(**exact_pool(act, questions, trace.num_layers))})
    asked = []
    policy = build_activation_policy(act, trace.num_layers)
    for method in ("on_save", "on_unpack", "on_layer_start", "on_layer_end"):
        original = getattr(policy, method)
        kind = method.removeprefix("on_")

        def spy(*args, _original=original, _kind=kind):
            asked.append((_kind, *args))
            return _original(*args)
        setattr(policy, method, spy)
    from engine.policy.weights import WeightResidency
    from sim.simulator import drive

    weights = WeightResidency(trace.access_order(), None, eviction="belady", lookahead=1)
    result = drive(trace, weights, policy, hw, act, 50.0, None, 1)
    assert asked == [q for q in questions if q[0] != "step_end"]
    assert result.prediction["pool_misses"] == 0 and result.prediction["spilled"] > 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 10_000), st.integers(1, 50)), min_size=1, max_size=6),
       st.integers(0, 200_000))
def test_a_capped_pool_fits_its_cap_and_only_cuts(classes, cap):
    from engine.policy.pool_sizing import capped

    sizes, slabs = [s for s, _ in classes], [n for _, n in classes]
    out = capped(sizes, slabs, cap)
    total = sum(s * n for s, n in zip(sizes, slabs))
    assert all(0 <= o <= n for o, n in zip(out, slabs))
    assert sum(s * o for s, o in zip(sizes, out)) <= max(cap, 0) or out == slabs and total <= cap
    if total <= cap:
        assert out == slabs
    else:  # no class that was cut could take one more slab
        room = cap - sum(s * o for s, o in zip(sizes, out))
        assert all(o == n or s > room for s, o, n in zip(sizes, out, slabs))
