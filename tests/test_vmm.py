"""The vmm backend's parts that run without a GPU: the placement both drivers plan
with, the chunk map against a fake driver, and the executor on a cpu arena of
granules with decision parity against the simulator."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from engine.config import ActivationsConfig, WeightsConfig, load_hardware
from engine.errors import BelowFloorError, ConfigError, ExecutorError
from engine.executor import WeightExecutor
from engine.executor.cpu import CpuBackend
from engine.models import forward
from engine.policy import AccessOrder
from engine.policy.chunks import ChunkBooks, conversion_slack, layout
from engine.policy.placement import RESIDENT_ALIGN, place, pool_slack_bytes, residency
from engine.policy.floor import floor
from sim.simulator import simulate

GRANULE = 4096  # the tiny model's weights are 32 B to 192 KiB: some under, most over a granule


@st.composite
def orders(draw):
    n_weights = draw(st.integers(1, 12))
    sizes = {f"w{i}": draw(st.integers(1, 50_000)) for i in range(n_weights)}
    names = list(sizes)
    reads = tuple(tuple(draw(st.lists(st.sampled_from(names), max_size=3, unique=True)))
                  for _ in range(draw(st.integers(1, 10))))
    used = {w for r in reads for w in r}
    return AccessOrder(tuple(f"k{i}" for i in range(len(reads))), reads, {w: sizes[w] for w in used})


@given(orders(), st.sampled_from([1, 64, 4096, 16384]), st.integers(0, 400_000))
@settings(max_examples=200, deadline=None)
def test_placement_rounds_streamed_weights_and_packs_the_small_ones(order, granule, budget):
    try:
        p = place(order, budget, granule)
    except ConfigError:  # too little budget left beside the resident block
        assert granule > 1 and budget - place(order, None, granule).resident_bytes < granule
        return
    assert p.order.kernels == order.kernels and p.granule == granule
    if granule == 1:
        assert p.order == order and not p.resident and p.budget_bytes == budget
        return
    assert set(p.order.sizes) | set(p.resident) == set(order.sizes) and not set(p.order.sizes) & set(p.resident)
    for w, n in p.order.sizes.items():
        assert order.sizes[w] >= granule and n % granule == 0 and 0 <= n - order.sizes[w] < granule
    spans = sorted((off, off + order.sizes[w]) for w, off in p.resident.items())
    assert all(order.sizes[w] < granule and off % RESIDENT_ALIGN == 0 for w, off in p.resident.items())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no two resident weights overlap
    assert p.resident_bytes % granule == 0 and (not spans or spans[-1][1] <= p.resident_bytes)
    assert p.budget_bytes == budget - p.resident_bytes
    assert p.order.reads == tuple(tuple(w for w in r if w in p.order.sizes) for r in order.reads)
    assert p.resident_kernels == {i for i, (a, b) in enumerate(zip(order.reads, p.order.reads)) if a and not b}


def test_a_kernel_of_resident_weights_does_not_use_up_the_lookahead():
    # k2 reads only a weight under a granule (resident for the run): it needs no copy, so
    # the window of k1 (lookahead 1) passes over it to k3 and d's copy starts under k1,
    # not under k2. k4, which reads nothing at all, counts as a kernel, as on the pool.
    g = GRANULE
    order = AccessOrder(("k0", "k1", "k2", "k3", "k4"), (("a",), ("b",), ("small",), ("d",), ()),
                        {"a": 2 * g, "b": 2 * g, "small": 100, "d": 2 * g})
    placement = place(order, 12 * g, g)
    assert placement.resident_kernels == {2}
    policy = residency(placement, "lru", 1)
    first = [[(d.action, d.target) for d in policy.issue(i)] for i in range(5)]
    assert first == [[("fetch", "a"), ("prefetch", "b")], [("hit", "b"), ("prefetch", "d")], [], [("hit", "d")], []]


class FakeDriver:
    """Checks every call a real driver would refuse: a map over a mapping, an unmap of
    nothing, a chunk used after release, address space freed while mapped."""

    granule = 64

    def __init__(self, fail_map_at: int | None = None):
        self.mapped: dict[int, int] = {}  # granule address -> chunk
        self.chunks: dict[int, int] = {}  # chunk -> bytes
        self.ranges: list[tuple[int, int]] = []
        self.next_address, self.next_chunk, self.maps = 1 << 20, 0, 0
        self.fail_map_at = fail_map_at

    def reserve(self, nbytes):
        assert nbytes % self.granule == 0
        address = self.next_address
        self.next_address += nbytes + (1 << 20)
        self.ranges.append((address, nbytes))
        return address

    def free_range(self, address, nbytes):
        assert not any(address <= a < address + nbytes for a in self.mapped), "freed while mapped"
        self.ranges.remove((address, nbytes))

    def create(self, nbytes):
        assert nbytes % self.granule == 0
        self.next_chunk += 1
        self.chunks[self.next_chunk] = nbytes
        return self.next_chunk

    def release(self, chunk):
        assert chunk not in self.mapped.values(), "released while mapped"
        del self.chunks[chunk]

    def map(self, address, chunk, nbytes):
        self.maps += 1
        if self.maps == self.fail_map_at:
            raise ExecutorError("cuMemMap failed: CUDA_ERROR_OUT_OF_MEMORY")
        assert self.chunks[chunk] == nbytes  # a chunk may be mapped twice: a stale mapping and its new one
        assert any(a <= address and address + nbytes <= a + n for a, n in self.ranges)
        for i in range(0, nbytes, self.granule):
            assert address + i not in self.mapped
            self.mapped[address + i] = chunk
        self.access_pending = set(range(address, address + nbytes, self.granule))

    def set_access(self, address, nbytes):
        assert all(address + i in self.mapped for i in range(0, nbytes, self.granule))

    def unmap(self, address, nbytes):
        chunk = self.mapped[address]
        assert self.chunks[chunk] == nbytes
        for i in range(0, nbytes, self.granule):
            assert self.mapped.pop(address + i) == chunk

    def held(self):
        return sum(self.chunks.values())


class Done:
    def __init__(self, done: bool = False):
        self.done = done

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


@pytest.mark.parametrize("seed", range(4))
def test_chunk_books_never_refuse_a_block_the_cap_allows_and_leave_nothing_behind(seed):
    rng = random.Random(seed)
    driver = FakeDriver()
    g = driver.granule
    cap = 80 * g
    cm = ChunkBooks(driver, cap, 2 * cap)
    cm.grow([40 * g, 3 * g])
    live: dict[int, int] = {}  # address -> bytes placed
    pending: list[Done] = []
    for _ in range(3000):
        if live and (rng.random() < 0.5 or sum(live.values()) > cap - 40 * g):
            address = rng.choice(list(live))
            del live[address]
            freed = Done()
            pending.append(freed)
            cm.free(address, freed)
        else:
            nbytes = rng.choice([rng.randint(1, 40 * g), 3 * g, 17 * g, 32 * g])
            address = cm.place(nbytes)
            placed = -(-nbytes // g) * g
            assert all(address + placed <= a or a + n <= address for a, n in live.items())  # ranges apart
            assert all(address + i in driver.mapped for i in range(0, placed, g))
            live[address] = placed
        for freed in pending:
            if rng.random() < 0.3:
                freed.done = True
        assert driver.held() <= cap and cm.held * g == driver.held() and cm.live_bytes == sum(live.values())
        per_chunk = {}
        for a_base, n in live.items():
            for ch in {driver.mapped[a] for a in range(a_base, a_base + n, g)}:
                per_chunk[ch] = per_chunk.get(ch, 0) + 1
        assert all(v == 1 for v in per_chunk.values())  # no chunk backs two live blocks
    assert cm.reused > 0
    cm.close()
    assert not driver.mapped and not driver.chunks and not driver.ranges


def test_a_block_is_the_fewest_chunks_largest_first():
    assert layout(16 + 8 + 2 + 1) == [16, 8, 2, 1]
    assert layout(50) == [16, 16, 16, 2] and layout(1) == [1] and layout(0) == []


def test_a_failed_map_leaves_nothing_of_the_block_mapped():
    driver = FakeDriver(fail_map_at=3)
    g = driver.granule
    cm = ChunkBooks(driver, 40 * g, 80 * g)
    with pytest.raises(ExecutorError, match="cuMemMap failed"):
        cm.place(19 * g)  # 16 + 2 + 1: the third map fails
    assert not driver.mapped and cm.live_bytes == 0
    address = cm.place(40 * g)  # the whole cap, once the failure is behind
    assert cm.live_bytes == 40 * g and len(set(driver.mapped.values())) == 3  # 16 + 16 + 8
    with pytest.raises(ExecutorError, match="past its budget"):
        cm.place(1)
    cm.free(address, Done())
    with pytest.raises(ExecutorError, match="freed twice"):
        cm.free(address, Done())
    cm.close()
    assert not driver.mapped and not driver.chunks and not driver.ranges


def test_a_block_takes_the_free_range_nearest_its_layout():
    driver = FakeDriver()
    g = driver.granule
    cm = ChunkBooks(driver, 64 * g, 128 * g)
    cm.grow([24 * g])
    a = cm.place(19 * g - 5)  # 16 + 2 + 1
    b = cm.place(16 * g)
    assert cm.maps == 4
    cm.free(a, Done())
    assert cm.place(19 * g) == a and cm.maps == 4 and cm.reused == 1  # as it was: no call
    cm.free(b, Done(True))
    assert cm.place(24 * g) == b and cm.maps == 5 and cm.unmaps == 0  # b's 16, and an 8 mapped after it
    cm.free(b, Done(True))
    assert cm.place(17 * g) == b and cm.unmaps == 1 and cm.maps == 6  # the 8 unmapped, a 1 mapped
    cm.close()
    assert not driver.mapped and not driver.chunks and not driver.ranges


def test_a_range_still_read_is_never_unmapped_until_its_free_passed():
    driver = FakeDriver()
    g = driver.granule
    cm = ChunkBooks(driver, 33 * g, 64 * g)
    a, b = cm.place(16 * g), cm.place(16 * g)
    reading = Done()
    cm.free(a, reading)
    c = cm.place(16 * g + g)  # a's chunk moves to c and stays mapped in a: no wait, no unmap
    assert c not in (a, b) and cm.unmaps == 0 and cm.waits == 0 and not reading.done
    assert driver.mapped[a] == driver.mapped[c]  # the stale mapping and its new one
    cm.free(b, Done(True))
    cm.place(g)  # needs a 1-granule chunk: b's 16 is unmapped (its free passed) and made into one
    assert cm.releases == 1 and driver.mapped[a] == driver.mapped[c]  # a's stale mapping stays: still read
    reading.done = True
    stale_chunk = driver.mapped[c]
    cm.place(2 * g)  # the sweep unmaps a's stale mapping now that its free passed
    assert driver.mapped.get(a) != stale_chunk and cm.waits == 0
    cm.close()
    assert not driver.mapped and not driver.chunks and not driver.ranges


def test_a_missing_size_is_made_in_the_slack_before_anything_is_converted_and_the_slack_is_the_bound():
    driver = FakeDriver()
    g = driver.granule
    cm = ChunkBooks(driver, 16 * g, 32 * g, slack_bytes=conversion_slack(2 * g, g))
    assert cm.slack_bytes == 4 * g
    a = cm.place(16 * g)
    reading = Done()
    cm.free(a, reading)
    b = cm.place(2 * g)  # a 2 is made in the slack: a's 16 is neither converted nor taken, no wait
    assert cm.waits == 0 and not reading.done and cm.held == 18 and driver.held() == 18 * g
    cm.free(b, Done(True))
    reading.done = True
    a2 = cm.place(16 * g)  # a's range as it is: no driver call
    b2 = cm.place(2 * g)  # b's range as it is: the slack's chunk stayed to serve it
    assert (cm.reused, cm.creates, cm.releases, cm.held) == (2, 2, 0, 18)
    cm.free(a2, Done(True))
    cm.free(b2, Done(True))
    cm.place(4 * g)  # past the slack (18 + 4 > 20): a free range's 16 comes loose and is made a 4
    assert (cm.creates, cm.releases, cm.held, driver.held()) == (3, 1, 6, 6 * g)
    assert cm.peak_held == 18  # never past the cap and its slack
    cm.close()
    assert not driver.mapped and not driver.chunks and not driver.ranges


@pytest.mark.parametrize("eviction", ["lru", "belady", "priority"])
def test_the_executor_on_granules_is_bitwise_under_the_budget_with_the_simulators_decisions(tiny, eviction):
    p = place(tiny.order, None, GRANULE)
    budget = p.resident_bytes + floor(p.order, 2).bytes + 3 * GRANULE
    placement = place(tiny.order, budget, GRANULE)
    ex = WeightExecutor(tiny.order, tiny.wf.tensors(), budget_bytes=budget, eviction=eviction, lookahead=2,
                        backend=CpuBackend(budget, granule=GRANULE))
    assert ex.placement == placement
    with torch.no_grad():
        for _ in range(3):
            with ex.step():
                out = forward(tiny.spec, ex, tiny.inputs)
            assert all(torch.equal(out[k], tiny.reference[k]) for k in out)
    rows = ex.telemetry()
    assert all(r["peak_device_bytes"] <= budget for r in rows)  # whole granules, within the budget
    assert rows[-1]["evictions"] > 0
    bare = residency(placement, eviction, 2)
    for _ in range(3):
        for i in range(len(tiny.order)):
            bare.issue(i)
    assert ex.log == bare.log
    weights = OmegaConf.merge(OmegaConf.structured(WeightsConfig),
                              {"eviction": eviction, "lookahead": 2, "backend": "vmm"})
    hardware = OmegaConf.merge(load_hardware("h100_pcie5"), {"vmm_granule_bytes": GRANULE, "vmm_map_us": 3.0})
    sim = simulate(tiny.trace, weights, OmegaConf.structured(ActivationsConfig), hardware, budget, 3, False)
    assert sim.decisions == ex.log  # decision parity with the simulator on the same placement
    assert sim.prediction["peak_device_bytes"] <= budget
    ex.close()


def test_map_costs_are_host_time_in_the_simulator(tiny):
    budget = place(tiny.order, None, GRANULE).resident_bytes + 3 * floor(place(tiny.order, None, GRANULE).order, 2).bytes
    weights = OmegaConf.merge(OmegaConf.structured(WeightsConfig), {"eviction": "lru", "backend": "vmm"})
    act = OmegaConf.structured(ActivationsConfig)
    fast, slow = (simulate(tiny.trace, weights, act,
                           OmegaConf.merge(load_hardware("h100_pcie5"),
                                           {"vmm_granule_bytes": GRANULE, "vmm_map_us": us}), budget, 3, False)
                  for us in (0.0, 50.0))
    assert fast.decisions == slow.decisions
    assert slow.prediction["step_ms"] > fast.prediction["step_ms"]


def test_a_budget_with_no_room_beside_the_resident_weights_is_one_clear_line(tiny):
    resident = place(tiny.order, None, GRANULE).resident_bytes
    with pytest.raises(ConfigError, match="weights.backend=cuda"):
        WeightExecutor(tiny.order, tiny.wf.tensors(), budget_bytes=resident, eviction="lru",
                       backend=CpuBackend(resident, granule=GRANULE))




def test_the_plan_floor_counts_the_vmm_placement(tiny):
    from engine.plan import make_plan

    pool = make_plan(model="tiny", workload="infer", param_count=1, order=tiny.order, budget_mb=None, lookahead=2)
    vmm = make_plan(model="tiny", workload="infer", param_count=1, order=tiny.order, budget_mb=None, lookahead=2,
                    granule=GRANULE)
    p = place(tiny.order, None, GRANULE)
    assert pool.resident_bytes == 0 and pool.floor == floor(tiny.order, 2)
    assert vmm.resident_bytes == p.resident_bytes and vmm.floor.bytes == p.resident_bytes + floor(p.order, 2).bytes
    # the executor refuses exactly under the plan's floor
    with pytest.raises(BelowFloorError, match="small weights this backend keeps resident"):
        WeightExecutor(tiny.order, tiny.wf.tensors(), budget_bytes=vmm.floor.bytes - 1, eviction="lru",
                       backend=CpuBackend(vmm.floor.bytes, granule=GRANULE))
    WeightExecutor(tiny.order, tiny.wf.tensors(), budget_bytes=vmm.floor.bytes, eviction="lru",
                   backend=CpuBackend(vmm.floor.bytes, granule=GRANULE)).close()


def test_the_device_bound_is_the_pools_cap_and_the_vmm_chunks_peak(tiny):
    """`check` holds device_bound_bytes against the device: on the pool the weights at its
    cap (capacity + slack, as the executor caps it), on vmm the chunks' predicted peak."""
    p = place(tiny.order, None, GRANULE)
    budget = p.resident_bytes + 3 * floor(p.order, 2).bytes
    act = OmegaConf.structured(ActivationsConfig)
    hw = OmegaConf.merge(load_hardware("h100_pcie5"), {"vmm_granule_bytes": GRANULE})
    by_backend = {}
    for backend in ("cuda", "vmm"):
        weights = OmegaConf.merge(OmegaConf.structured(WeightsConfig), {"eviction": "lru", "backend": backend})
        by_backend[backend] = simulate(tiny.trace, weights, act, hw, budget, 3, False).prediction
    pool, vmm = by_backend["cuda"], by_backend["vmm"]
    others = pool["peak_process_bytes"] - pool["peak_device_bytes"]  # nothing saved: activations and context
    assert pool["device_bound_bytes"] == others + budget + pool_slack_bytes(max(tiny.order.sizes.values()))
    assert vmm["device_bound_bytes"] == vmm["peak_process_bytes"]
