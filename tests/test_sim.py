"""The simulator against closed-form answers, the policies' contracts, and itself."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import ActivationsConfig, HardwareConfig, PoolConfig, WeightsConfig
from engine.errors import BelowFloorError
from engine.policy.floor import floor
from engine.policy.weights import WeightResidency
from engine.models.spec import SavedTensor
from engine.trace import KernelRecord, Trace
from sim import simulate
from sim.compute import trace_sustained_slowdown

# The lent H100's measured numbers (benchmarks/results/hardware-h100-2026-11-22.md), pinned here so tests do not move with conf/.
H100 = HardwareConfig(
    name="h100", source="DESIGN.md", device_memory_mb=81559, h2d_gbps=54.4, d2h_gbps=54.2,
    duplex_gbps=87.6, pageable_gbps=7.1, mmap_gbps=7.3, mmap_registered_gbps=55.0,
    small_copy_mib=[1, 4, 256], small_copy_gbps=[46.0, 52.6, 54.4], matmul_tflops=771.0, hbm_gbps=3000.0)
MB = 10**6
US = 1000
MS = 10**6
PINNED = 54.4  # GB/s = bytes per ns
FETCH_NS = (10.0 + 2.0) * US  # fetch_host_us + alloc_us


def cyclic(n: int, weight_bytes: int, compute_ns: int) -> Trace:
    """n kernels, kernel i reads its own weight w{i}: a cyclic order over steps."""
    records = tuple(KernelRecord(f"k{i}", i, "fwd", (f"w{i}",), compute_ns, 0, 0) for i in range(n))
    return Trace({"source": "test"}, {f"w{i}": weight_bytes for i in range(n)}, records)


def training(n: int, weight_bytes: int, compute_ns: int, saved_bytes: int) -> Trace:
    """n forward kernels (one per layer) each saving one tensor, then the backward."""
    fwd = [KernelRecord(f"k{i}", i, "fwd", (f"w{i}",), compute_ns, 0, 0,
                        saved=(SavedTensor(f"k{i}.out", saved_bytes, i),)) for i in range(n)]
    bwd = [KernelRecord(f"k{i}.bwd", i, "bwd", (f"w{i}",), 2 * compute_ns, 0, 0, needs=(f"k{i}.out",))
           for i in reversed(range(n))]
    return Trace({"source": "test"}, {f"w{i}": weight_bytes for i in range(n)}, tuple(fwd + bwd))


def run(trace: Trace, budget: int | None, *, eviction: str = "belady", lookahead: int = 2,
        hardware: HardwareConfig = H100, steps: int = 3, act: ActivationsConfig | None = None,
        below: bool = False):
    weights = WeightsConfig(eviction=eviction, lookahead=lookahead, source="pinned")
    return simulate(trace, weights, act, hardware, budget, steps, below)


def floor_bytes(trace: Trace, lookahead: int) -> int:
    return floor(trace.access_order(), lookahead).bytes


# ------------------------------------------------------------ closed forms

def test_compute_bound_all_resident() -> None:
    # Budget None: every weight stays after step 1, so a step is its compute;
    # the host's 5 us launches hide under 100 us kernels.
    p = run(cyclic(50, MB, 100 * US), None).prediction
    assert p["step_ms"] == pytest.approx(50 * 0.1, rel=0.01)
    assert p["compute_ms"] == pytest.approx(50 * 0.1, rel=1e-9)
    assert p["stall_ms"] == 0 and p["h2d_bytes"] == 0
    assert p["host_ms"] == pytest.approx(50 * H100.kernel_launch_us / 1e3) and p["bound_by"] == "compute"


def test_launch_bound_when_kernels_are_shorter_than_a_launch() -> None:
    # Step 0's copies leave the GPU behind the host; step 1 catches up, and from
    # step 2 on the host's launches pace the GPU.
    p = run(cyclic(50, MB, 1 * US), None, steps=4).prediction
    assert p["step_ms"] == pytest.approx(50 * H100.kernel_launch_us / 1e3, rel=0.01)
    assert p["host_ms"] == pytest.approx(p["step_ms"], rel=0.01) and p["bound_by"] == "host"
    assert p["host_wait_ms"] == pytest.approx(p["step_ms"] - p["compute_ms"], abs=1e-6)


def test_a_host_sync_starts_each_step_behind_the_last_one() -> None:
    # All resident, the host far ahead: steps run back to back at their compute. A module
    # whose host synchronizes before kernel 0 (header host_syncs) issues it only once the
    # previous step has run: each step then adds kernel 0's launch, on an idle GPU.
    t = cyclic(4, MB, 1 * MS)
    free = run(t, None, steps=4)
    synced = run(replace(t, header={**t.header, "host_syncs": [0]}), None, steps=4)
    assert free.prediction["step_ms"] == pytest.approx(4.0, rel=1e-9)
    assert synced.prediction["step_ms"] == pytest.approx(4.0 + H100.kernel_launch_us / 1e3, rel=1e-9)
    starts = [t for t, track, what in synced.events if track == "host" and what == "start k0"]
    ends = [t for t, track, what in synced.events if track == "compute" and what == "end k3"]
    assert all(start >= end for start, end in zip(starts[1:], ends))


def test_a_synced_loop_waits_for_each_steps_last_kernel() -> None:
    # GPU-bound, all resident: a synced loop (workload.loop=synced) starts each step as a
    # host sync before its first kernel does, one launch behind the last step's end.
    t = cyclic(4, MB, 1 * MS)
    loop = simulate(t, WeightsConfig(source="pinned"), None, H100, None, 4, False, loop="synced")
    before_k0 = run(replace(t, header={**t.header, "host_syncs": [0]}), None, steps=4)
    assert loop.prediction["step_ms"] == pytest.approx(4.0 + H100.kernel_launch_us / 1e3, rel=1e-9)
    assert loop.step_ends_ns == before_k0.step_ends_ns
    # Host-bound (kernels of 1 us under 5 us launches): free-running the host paces the GPU;
    # synced, each step also waits for its last kernel to run.
    fast = cyclic(50, MB, 1 * US)
    free = run(fast, None, steps=4).prediction["step_ms"]
    synced = simulate(fast, WeightsConfig(source="pinned"), None, H100, None, 4, False,
                      loop="synced").prediction["step_ms"]
    assert free == pytest.approx(50 * H100.kernel_launch_us / 1e3, rel=1e-9)
    assert synced == pytest.approx(free + 1 / 1e3, rel=1e-9)
    with pytest.raises(ValueError, match="loop='sometimes'"):
        simulate(t, WeightsConfig(), None, H100, None, 1, False, loop="sometimes")


def test_a_block_record_runs_as_its_host_issues_it() -> None:
    # A recorded module's record is a block of many launches (header block_records): after the
    # host sync, the GPU starts it once the host has made its first launch, not after the
    # block's whole host time; it still ends no sooner than the host has issued all of it.
    records = tuple(KernelRecord(f"k{i}", i, "fwd", (f"w{i}",), 1 * MS, 0, 0, host_ns=500 * US) for i in range(4))
    header = {"source": "test", "host_syncs": [0]}
    sizes = {f"w{i}": MB for i in range(4)}
    launch_ms = H100.kernel_launch_us / 1e3
    whole = run(Trace(header, sizes, records), None, steps=4).prediction
    blocks = run(Trace({**header, "block_records": True}, sizes, records), None, steps=4).prediction
    assert whole["step_ms"] == pytest.approx(4.0 + 0.5, rel=1e-9)
    assert blocks["step_ms"] == pytest.approx(4.0 + launch_ms, rel=1e-9)
    assert blocks["compute_ms"] == pytest.approx(4.0, rel=1e-9)
    # With its launches counted, the first launch is the block's host time over them (a block of
    # 100 launches in 500 us makes its first 5 us in), not a whole spec kernel's kernel_launch_us.
    counted = tuple(replace(r, launches=100) for r in records)
    assert run(Trace({**header, "block_records": True}, sizes, counted), None,
               steps=4).prediction["step_ms"] == pytest.approx(4.0 + 0.005, rel=1e-9)
    slow = tuple(replace(r, host_ns=3 * MS) for r in records)  # the host bounds the step either way
    bound = run(Trace({**header, "block_records": True}, sizes, slow), None, steps=4).prediction
    assert bound["step_ms"] == pytest.approx(4 * 3.0, rel=1e-9) and bound["compute_ms"] == pytest.approx(4.0)
    # Inside a block the GPU waits on the host's later launches: host wait, not compute.
    assert bound["host_wait_ms"] == pytest.approx(4 * 3.0 - 4.0, rel=1e-9) and bound["bound_by"] == "host"


def test_a_recordings_own_slowdown_under_copies_overrides_the_profiles() -> None:
    # Copy-bound: the next weight's copy runs under every kernel, which so runs slowed.
    t = cyclic(8, 300 * MB, 1 * MS)
    budget = floor_bytes(t, 2)
    own = run(replace(t, header={**t.header, "compute_slowdown_under_copy": 0.1}), budget, eviction="lru",
              hardware=replace(H100, compute_slowdown_under_copy=0.5)).prediction
    same = run(t, budget, eviction="lru", hardware=replace(H100, compute_slowdown_under_copy=0.1)).prediction
    profile = run(t, budget, eviction="lru", hardware=replace(H100, compute_slowdown_under_copy=0.5)).prediction
    assert own == same
    assert own["compute_ms"] == pytest.approx(8 * 1.1) and profile["compute_ms"] == pytest.approx(8 * 1.5)


def test_copy_bound_everything_streamed() -> None:
    # LRU on a cyclic order re-copies every weight every step; 300 MB copies run at
    # the full pinned rate (above the largest small-copy point, 256 MiB).
    t = cyclic(8, 300 * MB, 1 * US)
    p = run(t, floor_bytes(t, 2), eviction="lru").prediction
    assert p["h2d_bytes"] == 8 * 300 * MB
    assert p["step_ms"] == pytest.approx(8 * 300 * MB / PINNED / MS, rel=0.01)
    assert p["stall_ms"] == pytest.approx(p["step_ms"] - p["compute_ms"], rel=0.01)
    assert p["bound_by"] == "copies"


def test_lookahead_0_does_not_overlap() -> None:
    # A launch queue of 1 stops the host running ahead (itself a prefetch), so with
    # lookahead 0 each kernel's copy and compute run one after the other.
    hw = replace(H100, launch_queue_depth=1)
    n, copy_ns, compute_ns = 6, 300 * MB / PINNED, 5 * MS
    t = cyclic(n, 300 * MB, compute_ns)
    serial = run(t, floor_bytes(t, 0), lookahead=0, hardware=hw, eviction="lru").prediction
    assert serial["step_ms"] == pytest.approx(n * (FETCH_NS + copy_ns + compute_ns) / MS, rel=0.01)
    assert serial["overlap"] == 0
    overlapped = run(t, floor_bytes(t, 2), lookahead=2, hardware=hw, eviction="lru").prediction
    assert overlapped["step_ms"] == pytest.approx(n * copy_ns / MS, rel=0.02)
    assert overlapped["overlap"] > 0.85


def test_slowdown_under_copy() -> None:
    # k0 runs while w1's copy is still on the link; k1 runs after it landed.
    records = (KernelRecord("k0", 0, "fwd", ("w0",), 1 * MS, 0, 0),
               KernelRecord("k1", 1, "fwd", ("w1",), 1 * MS, 0, 0))
    t = Trace({}, {"w0": MB, "w1": 1000 * MB}, records)
    p = run(t, None, lookahead=1, hardware=replace(H100, compute_slowdown_under_copy=0.5),
            steps=1).prediction
    assert p["compute_ms"] == pytest.approx(2.5)


def test_a_copy_slows_only_the_part_of_a_kernel_it_overlaps() -> None:
    # k0 (10 ms) starts as w1's copy (about 2.8 ms) starts: only that part runs at 1 / 1.5.
    records = (KernelRecord("k0", 0, "fwd", ("w0",), 10 * MS, 0, 0),
               KernelRecord("k1", 1, "fwd", ("w1",), 1 * MS, 0, 0))
    t = Trace({}, {"w0": MB, "w1": 150 * MB}, records)
    r = run(t, None, lookahead=1, hardware=replace(H100, compute_slowdown_under_copy=0.5), steps=1)
    span = {}
    for ns, track, what in r.events:
        kind, name = what.split(" ", 1)
        if kind in ("start", "end"):
            span.setdefault((track, name), {})[kind] = ns
    k0, w1 = span[("compute", "k0")], span[("h2d", "w1")]
    overlap = min(k0["end"], w1["end"]) - max(k0["start"], w1["start"])
    assert 2 * MS < overlap < 3 * MS
    # Its own work: the overlap at 1 / 1.5 of its pace, the rest at its pace (ns rounding).
    assert overlap / 1.5 + (k0["end"] - k0["start"] - overlap) == pytest.approx(10 * MS, abs=2)
    assert r.prediction["compute_ms"] == pytest.approx(10 + overlap / 3 / MS + 1, abs=1e-5)


def test_kernels_slow_under_sustained_load_by_the_streams_duty() -> None:
    # All resident: back to back, the duty nears 1 and the kernels run `sustained` slower;
    # a host that launches each kernel as long as it runs halves the duty, and the slowdown.
    t = cyclic(20, MB, 1 * MS)
    hw = replace(H100, compute_sustained_slowdown=0.1, sustained_window_ms=5.0)
    busy = run(t, None, hardware=hw, steps=8).prediction
    assert busy["compute_ms"] == pytest.approx(20 * 1.1, rel=1e-3)
    half = run(replace(t, records=tuple(replace(r, host_ns=2 * MS) for r in t.records)), None, hardware=hw,
               steps=8).prediction
    assert half["compute_ms"] == pytest.approx(20 * 1.05, rel=0.01)
    assert run(t, None, steps=8).prediction["compute_ms"] == pytest.approx(20.0)  # the profile's default: none


def test_whose_sustained_slowdown_a_trace_runs_at() -> None:
    hw = replace(H100, compute_sustained_slowdown=0.1)
    assert trace_sustained_slowdown({"compute_sustained_slowdown": 0.03}, hw) == 0.03  # the recording's own
    assert trace_sustained_slowdown({"compute_scale": 1.04}, hw) == 0.0  # kernels scaled to the pipelined step
    assert trace_sustained_slowdown({}, hw) == 0.1


# ------------------------------------------------------------ policies' contracts

def test_hazards_below_the_floor_and_none_above() -> None:
    t = cyclic(4, 100 * MB, 1 * MS)
    fl = floor_bytes(t, 0)
    assert run(t, fl, lookahead=0).prediction["hazards"] == []
    with pytest.raises(BelowFloorError):
        run(t, fl - 1, lookahead=0)
    hazards = run(t, 150 * MB, lookahead=0, below=True).prediction["hazards"]
    # From the second kernel on, each fetch evicts the previous kernel's weight
    # while that kernel may still run: 3 in step 0, then 4 a step.
    assert len(hazards) == 3 + 4 + 4
    first = hazards[0]
    assert (first["kernel"], first["weight"], first["evicted_by"], first["step"]) == ("k0", "w0", "k1", 0)
    assert first["time_ms"] == first["time_ns"] / MS and first["time_ns"] > 0
    assert [h["time_ns"] for h in hazards] == sorted(h["time_ns"] for h in hazards)


def test_lru_copies_more_than_belady_and_priority_on_a_cyclic_order() -> None:
    t = cyclic(8, 100 * MB, 1 * MS)
    copied = {e: run(t, 500 * MB, eviction=e, lookahead=1).prediction["h2d_bytes"]
              for e in ("lru", "belady", "priority")}
    assert copied["lru"] == 8 * 100 * MB  # everything, every step
    assert copied["belady"] < copied["lru"] and copied["priority"] < copied["lru"]


def test_decisions_are_the_policys_own_log() -> None:
    # The central invariant's simulator half: the driver asks issue(0..n-1) in order,
    # every step, and logs exactly what the policy answered.
    t = cyclic(7, 100 * MB, 1 * MS)
    result = run(t, 300 * MB, eviction="lru")
    policy = WeightResidency(t.access_order(), 300 * MB, "lru", 2)
    for _ in range(3):
        for pos in range(len(t.records)):
            policy.issue(pos)
    assert result.decisions == policy.log


def test_deterministic() -> None:
    t = training(6, 50 * MB, 1 * MS, 40 * MB)
    a, b = (run(t, 200 * MB, act=_watermark()) for _ in range(2))
    assert a.decisions == b.decisions and a.events == b.events and a.prediction == b.prediction


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 8), sizes=st.lists(st.integers(1, 400), min_size=8, max_size=8),
       compute_us=st.integers(1, 3000), lookahead=st.integers(0, 3), slack=st.integers(0, 2000),
       eviction=st.sampled_from(["lru", "belady", "priority"]))
def test_above_the_floor_the_budget_holds(n, sizes, compute_us, lookahead, slack, eviction) -> None:
    records = tuple(KernelRecord(f"k{i}", i, "fwd", (f"w{i}",), compute_us * US, 0, 0) for i in range(n))
    t = Trace({}, {f"w{i}": sizes[i] * MB for i in range(n)}, records)
    budget = floor_bytes(t, lookahead) + slack * MB
    p = run(t, budget, eviction=eviction, lookahead=lookahead).prediction
    assert p["hazards"] == []
    assert p["peak_device_bytes"] <= budget
    assert 0 <= p["overlap"] <= 1
    assert p["step_ms"] == pytest.approx(p["compute_ms"] + p["stall_ms"] + p["host_wait_ms"], abs=1e-6)
    assert p["host_wait_ms"] >= 0 and p["stall_ms"] >= 0


# ------------------------------------------------------------ activations

def _watermark(**kw) -> ActivationsConfig:
    return ActivationsConfig(mode="watermark", high_watermark_mb=100, low_watermark_mb=50,
                             min_tensor_bytes=0, pool=PoolConfig([16, 64], [2, 2]), **kw)


def test_watermark_spills_and_restores_all_of_it() -> None:
    t = training(8, 50 * MB, 1 * MS, 40 * MB)
    result = run(t, None, act=_watermark())
    p = result.prediction
    assert p["spilled"] > 0 and p["kept"] + p["spilled"] == 8
    assert p["pool_hits"] + p["pool_misses"] == p["spilled"] and p["pool_misses"] > 0
    # Budget None: no weight moves in the steady state, so H2D is the restores alone.
    assert p["d2h_bytes"] == p["h2d_bytes"] == p["spilled"] * 40 * MB
    spills = [w for _, track, w in result.events if track == "d2h" and w.startswith("end ")]
    restores = [w for _, track, w in result.events if track == "h2d" and w.startswith("end restore")]
    assert len(spills) == len(restores) == 3 * p["spilled"]
    assert result.device_bytes[-1][1] == 8 * 50 * MB  # every activation freed: weights remain
    # Without spilling, all 8 x 40 MB would be on the device at the turn to backward.
    assert p["peak_device_bytes"] < 8 * 50 * MB + 8 * 40 * MB


def test_inflight_cap_finalizes_inline() -> None:
    t = training(8, 50 * MB, 1 * US, 40 * MB)
    capped = run(t, None, act=_watermark(max_inflight_d2h=1))
    roomy = run(t, None, act=_watermark(max_inflight_d2h=64))
    assert any(w.startswith("finalize spill") for _, _, w in capped.events)
    assert not any(w.startswith("finalize spill") for _, _, w in roomy.events)
    assert capped.decisions == roomy.decisions  # the cap costs time, never changes an answer
    # GPU idle while the host waits on a finalize is a stall, not launch overhead:
    # what remains is at most the host's own issue costs (16 kernels, 16 fetches at most).
    p = capped.prediction
    overhead_ms = p["step_ms"] - p["compute_ms"] - p["stall_ms"]
    assert 0 <= overhead_ms <= 16 * (H100.kernel_launch_us + FETCH_NS / US) / 1e3


def test_activations_off_keeps_everything() -> None:
    t = training(4, 50 * MB, 1 * MS, 40 * MB)
    p = run(t, None, act=ActivationsConfig(mode="off")).prediction
    assert (p["kept"], p["spilled"], p["d2h_bytes"]) == (4, 0, 0)
    assert p["peak_device_bytes"] == 4 * 50 * MB + 4 * 40 * MB


def test_sync_dict_offloads_groups_and_reloads_them() -> None:
    t = training(6, 50 * MB, 1 * MS, 40 * MB)
    act = ActivationsConfig(mode="sync", num_offload_layers=3, min_tensor_bytes=0)
    result = run(t, None, act=act)
    p = result.prediction
    assert p["spilled"] == 3 and p["pool_misses"] == 3  # no pinned pool configured
    assert p["d2h_bytes"] == p["h2d_bytes"] == 3 * 40 * MB
    actions = [d.action for d in result.decisions if d.step == 2]
    assert actions.count("offload_group") == actions.count("wait_offload") == actions.count("reload_group") == 3
    assert result.device_bytes[-1][1] == 6 * 50 * MB


def test_a_weight_copy_waits_behind_every_earlier_evictions_last_reader() -> None:
    """As on the executor's copy stream: freeing a block makes the stream wait for
    its last reader, so no later copy starts before that kernel ends, even when
    the pool already has the bytes for it (LTX-2's 8 recorded blocks, where
    belady evicts several weights read at different kernels for one fetch)."""
    from pathlib import Path

    from engine.trace import read_trace

    trace = read_trace(Path(__file__).resolve().parents[1] / "data" / "traces" / "ltx2_infer.jsonl.gz")
    r = run(trace, 2403 * MB, eviction="belady", lookahead=1, steps=2)
    n = len(trace.records)
    kernel_end = [t for t, track, what in r.events if track == "compute" and what.startswith("end ")]
    copy_start = [t for t, track, what in r.events if track == "h2d" and what.startswith("start ")]
    copies, barrier, checked, read = 0, -1, 0, {}
    for d in r.decisions:
        if d.action == "evict" and d.target in read:
            barrier = max(barrier, read.pop(d.target))
        elif d.action in ("fetch", "prefetch"):
            if barrier >= 0:
                assert copy_start[copies] >= kernel_end[barrier], (d, barrier)
                checked += 1
            copies += 1
        if d.action in ("hit", "fetch") and d.detail in (-1, d.position):
            read[d.target] = d.step * n + d.position
    assert checked > 100


def test_a_resident_decode_step_reads_its_weights_from_hbm():
    """Decode is bound by reading the weights: a linear's io_bytes include its weight bytes
    (an embedding reads only its rows), so the step cannot beat weights / HBM bandwidth."""
    from omegaconf import OmegaConf

    from engine.config import load_hardware
    from engine.models import load_spec
    from engine.models.synthesize import synthesize

    wl = OmegaConf.create(dict(name="decode", kind="decode", batch=1, video_tokens=0, audio_tokens=0,
                               text_tokens=0, context_tokens=4096, lora_rank=0))
    spec = load_spec("llama8b", wl)
    hw = load_hardware("h100_calibrated")
    hw.kernel_table = None  # the roofline; the measured kernel table is tested in tests/test_compute.py
    trace = synthesize(spec, wl, hw)
    read = sum(w.nbytes for n, w in spec.weights.items() if n != "model.embed_tokens.weight")
    compute_ns = sum(r.compute_ns for r in trace.records)
    assert compute_ns >= read / hw.hbm_gbps
    assert compute_ns < 1.1 * read / hw.hbm_gbps + 1e6  # and not far above: the weights dominate


def test_a_host_bound_step_is_predicted_at_its_host_time_after_a_cold_first_step():
    """The first step copies every weight in while the host runs ahead; the warm-up barrier keeps
    that lead out of the steps reported, so an all-resident host-bound step is its host time.
    The trace: transformers Llama-3.1-8B decode as recorded on the GPU, one kernel a decoder layer."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from engine.config import load_hardware
    from engine.trace import read_trace

    path = Path(__file__).resolve().parents[1] / "benchmarks/results/traces/llama8b-hf-decode-h100-2026-11-25.jsonl.gz"
    trace = read_trace(path)
    host = sum(r.host_ns for r in trace.records) / 1e6
    compute = sum(r.compute_ns for r in trace.records) / 1e6
    assert host > 2 * compute
    weights = OmegaConf.merge(OmegaConf.structured(WeightsConfig), {"eviction": "priority"})
    result = simulate(trace, weights, OmegaConf.structured(ActivationsConfig), load_hardware("h100_calibrated"),
                      budget_bytes=None, steps=3, allow_below_floor=False)
    assert host <= result.prediction["step_ms"] <= host * 1.01


def test_priority_settles_and_belady_drifts_on_a_recorded_decode():
    """The recorded Llama-3.1-8B decode at 8000 MB: priority decides the same every step
    from the second on; belady's band of streamed blocks moves, so engine.offload's
    prediction runs it long (16 steps) and reports the warm steps' mean and range."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from engine.choice import LONG_RUN_STEPS
    from engine.config import load_hardware
    from engine.modules.offload import predict
    from engine.trace import read_trace

    trace = read_trace(Path(__file__).resolve().parents[1]
                       / "benchmarks/results/traces/llama8b-hf-decode-h100-2026-11-25.jsonl.gz")
    hw = load_hardware("h100_calibrated")
    runs = {ev: simulate(trace, OmegaConf.merge(OmegaConf.structured(WeightsConfig), {"eviction": ev}),
                         OmegaConf.structured(ActivationsConfig), hw, 8_000_000_000, 4, False)
            for ev in ("priority", "belady")}
    assert runs["priority"].settled() and not runs["belady"].settled()
    belady = predict(trace, hw, 8_000_000_000, 2, "belady")
    lo, hi = belady["step_ms_range"]
    assert hi - lo > 0.1 * belady["step_ms"] and lo < belady["step_ms"] < hi
    long = simulate(trace, OmegaConf.merge(OmegaConf.structured(WeightsConfig), {"eviction": "belady"}),
                    OmegaConf.structured(ActivationsConfig), hw, 8_000_000_000, LONG_RUN_STEPS, False)
    assert belady["step_ms"] == long.prediction["mean_step_ms"]
    priority = predict(trace, hw, 8_000_000_000, 2, "priority")
    assert priority["step_ms"] == runs["priority"].prediction["mean_step_ms"]
    # What execute's measured step follows: the warm steps' mean where they vary, else their median.
    assert belady["steps_vary"] is True and priority["steps_vary"] is False


def test_a_host_bound_recording_is_fitted_to_the_step_it_measured() -> None:
    """FLUX.1-dev's LoRA step recorded on the H200 (data/traces/h200/validate/flux-train-c):
    its host times sum to its pipelined step (778.07 ms), but its forward is the GPU's and the
    host waits there on CUDA's launch queue, so replayed as recorded the step runs 824.83 ms.
    Fitted, the simulator's all-resident step is the measured one; a recording the GPU bounds,
    and a fitted one, come back as they are."""
    from pathlib import Path

    from engine.calibrate import base_profile
    from engine.config import hardware_of
    from engine.trace import read_trace
    from sim.simulator import HOST_FIT_TOLERANCE, host_fitted

    data = Path(__file__).resolve().parents[1] / "data" / "traces" / "h200"
    hw = hardware_of(base_profile("h200"))
    recorded = read_trace(data / "validate" / "flux-train-c.jsonl.gz")
    weights = WeightsConfig(eviction="priority", lookahead=1)
    target = recorded.header["pipelined_step_ns"] / 1e6
    assert target == pytest.approx(778.07, abs=0.01)
    fitted = host_fitted(recorded, hw)
    assert 0.85 < fitted.header["host_fit"] < 0.9 and "host_fit" not in recorded.header
    assert [r.host_ns for r in fitted.records] == [round(r.host_ns * fitted.header["host_fit"])
                                                   for r in recorded.records]
    assert host_fitted(fitted, hw) is fitted
    assert host_fitted(recorded, hw) is fitted  # fitted once per trace and hardware
    step = simulate(recorded, weights, None, hw, None, 4, False).prediction["mean_step_ms"]
    assert step == pytest.approx(target, rel=HOST_FIT_TOLERANCE)  # simulate fits it
    gpu_bound = read_trace(data / "modules" / "flux-train-b.jsonl.gz")
    assert host_fitted(gpu_bound, hw) is gpu_bound
