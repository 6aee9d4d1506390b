"""Weight residency: the floor by hand, the safety invariants by property, and
the copies each eviction policy saves on a cyclic order."""
from __future__ import annotations

import itertools
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import BelowFloorError, ConfigError
from engine.policy import AccessOrder, Decision
from engine.policy.eviction import EVICTIONS, BeladyEviction, anchors
from engine.policy.floor import Floor, floor
from engine.policy.weights import WeightResidency, residency_summary

MB = 1_000_000


def make_order(reads: list[tuple[str, ...]], sizes: dict[str, int]) -> AccessOrder:
    return AccessOrder(tuple(f"k{i}" for i in range(len(reads))), tuple(reads), sizes)


# k0 and k1 share b; the largest pair is the cyclic one (k2, k0).
SHARED = make_order(
    [("a", "b"), ("b", "c"), ("d",)],
    {"a": 100 * MB, "b": 200 * MB, "c": 50 * MB, "d": 400_250_000})


def cyclic(n: int, size: int = 100 * MB) -> AccessOrder:
    """n kernels, each reading its own weight once per step."""
    return make_order([(f"w{i}",) for i in range(n)], {f"w{i}": size for i in range(n)})


# --- the floor, by hand ------------------------------------------------------

def test_floor_pair_counts_a_shared_weight_once_and_wraps():
    f = floor(SHARED, 1)
    # (k0,k1) = a+b+c = 350 MB, b once; (k1,k2) = 650.25; (k2,k0) = d+a+b = 700.25
    assert f == Floor(bytes=700_250_000, pair_bytes=700_250_000, headroom_bytes=0,
                      kernels=("k2", "k0"))
    assert floor(SHARED, 0) == f


def test_floor_headroom_is_the_rest_of_the_lookahead_window():
    # L=2: max over i of bytes(K_{i+2}) = d = 400.25 MB
    assert floor(SHARED, 2).headroom_bytes == 400_250_000
    assert floor(SHARED, 2).bytes == 1_100_500_000
    # L=3: max over i of bytes(K_{i+2} ∪ K_{i+3}): (k2,k0) = 700.25 MB
    assert floor(SHARED, 3).headroom_bytes == 700_250_000


def test_floor_first_maximal_pair_names_the_kernels():
    f = floor(cyclic(4), 1)
    assert (f.pair_bytes, f.kernels) == (200 * MB, ("k0", "k1"))


def test_single_kernel_order_pairs_with_itself():
    f = floor(make_order([("a", "b")], {"a": 3, "b": 4}), 2)
    assert f == Floor(bytes=14, pair_bytes=7, headroom_bytes=7, kernels=("k0", "k0"))


def test_below_floor_names_the_exact_mb_and_the_fix():
    with pytest.raises(BelowFloorError) as e:
        WeightResidency(SHARED, 1_000 * MB, "belady", 2)
    msg = str(e.value)
    assert "1100.500 MB" in msg and "budget=1101" in msg and "k2 + k0" in msg
    assert (e.value.floor_bytes, e.value.kernels) == (1_100_500_000, ("k2", "k0"))


def test_a_kernel_over_the_budget_fails_even_below_floor_allowed():
    with pytest.raises(ConfigError, match=r"kernel k2 alone reads 400\.250 MB.*budget=401"):
        WeightResidency(SHARED, 300 * MB, "lru", 0, allow_below_floor=True)


def test_unknown_eviction_and_negative_lookahead_are_config_errors():
    with pytest.raises(ConfigError, match="fifo"):
        WeightResidency(SHARED, None, "fifo", 0)
    with pytest.raises(ConfigError, match="lookahead=-1"):
        WeightResidency(SHARED, None, "lru", -1)


def test_issue_out_of_launch_order_is_refused():
    p = WeightResidency(SHARED, None, "lru", 0)
    p.issue(0)
    with pytest.raises(ValueError, match="next kernel is position 1"):
        p.issue(2)


# --- worked examples ----------------------------------------------------------

def test_belady_worked_example_keeps_the_weight_needed_last():
    order = cyclic(4)
    p = WeightResidency(order, 300 * MB, "belady", 0)
    for i in range(4):
        p.issue(i)
    step1 = [p.issue(i) for i in range(4)]
    # Room for 3 of 4 weights; at each miss the unprotected candidate read
    # furthest ahead goes: 2 copies a step where LRU makes 4.
    flat = [(d.position, d.action, d.target, d.detail) for ds in step1 for d in ds]
    assert flat == [
        (0, "hit", "w0", -1),
        (1, "evict", "w3", 1), (1, "fetch", "w1", 1),  # w2 is next at 2, w3 at 3
        (2, "hit", "w2", -1),
        (3, "evict", "w1", 3), (3, "fetch", "w3", 3),  # w0 is next at 0 (4), w1 at 1 (5)
    ]


def test_unlimited_budget_fetches_once_and_never_evicts():
    p = WeightResidency(SHARED, None, "lru", 1)
    for _ in range(2):
        for i in range(3):
            p.issue(i)
    actions = [(d.step, d.action, d.target) for d in p.log if d.action != "hit"]
    assert actions == [(0, "fetch", "a"), (0, "fetch", "b"), (0, "prefetch", "c"),
                       (0, "prefetch", "d")]


def test_below_floor_evicting_the_previous_kernel_logs_a_hazard():
    order = cyclic(3)
    p = WeightResidency(order, 100 * MB, "lru", 0, allow_below_floor=True)
    assert p.issue(0) == [Decision(0, 0, "fetch", "w0", 0)]
    assert p.issue(1) == [Decision(0, 1, "evict", "w0", 1), Decision(0, 0, "hazard", "w0", 1),
                          Decision(0, 1, "fetch", "w1", 1)]
    p.issue(2)
    # the cyclic pair: the hazard's reader is the last kernel of the previous step
    assert p.issue(0)[1] == Decision(0, 2, "hazard", "w2", 0)


def test_prefetch_stops_rather_than_evict_a_weight_needed_sooner():
    order = cyclic(4)
    assert floor(order, 3).bytes == 400 * MB  # pair 200 + headroom 200
    ds = WeightResidency(order, 400 * MB, "belady", 3).issue(0)
    assert [d.action for d in ds] == ["fetch", "prefetch", "prefetch", "prefetch"]
    tight = WeightResidency(order, 200 * MB, "belady", 3, allow_below_floor=True)
    assert [(d.action, d.target) for d in tight.issue(0)] == [("fetch", "w0"), ("prefetch", "w1")]
    # w0 (the previous kernel) and w1..w3 (the window) are all protected
    assert [(d.action, d.target) for d in tight.issue(1)] == [("hit", "w1")]


def test_priority_spreads_its_set_through_the_order():
    order = cyclic(9)
    assert floor(order, 0).bytes == 200 * MB
    # 300 MB over the floor of a 900 MB model: f = 1/3, so every third weight
    # in first-use order stays resident, not the first three.
    p = WeightResidency(order, 500 * MB, "priority", 0)
    assert p.pinned == frozenset({"w2", "w5", "w8"})
    # Unequal sizes: a weight is kept while the kept bytes stay <= f x the bytes walked.
    order = make_order([("a",), ("b",), ("c",), ("d",)],
                       {"a": 50 * MB, "b": 100 * MB, "c": 10 * MB, "d": 100 * MB})
    assert floor(order, 0).bytes == 150 * MB  # a+b and d+a; b+c and c+d are 110
    # Anchors first (test_priority_pins_the_weights_that_set_the_room): a (the rest's
    # floor 150 -> 110), then c (-> 100). Then f = (300 - 100 - 60) / 200 over b, d:
    # b (100 > 70) is streamed, d (100 <= 140) kept.
    assert anchors(order, 300 * MB, 0) == (frozenset("ac"), 100 * MB)
    assert WeightResidency(order, 300 * MB, "priority", 0).pinned == frozenset("acd")
    assert WeightResidency(order, 410 * MB, "priority", 0).pinned == frozenset("abcd")  # f = 1
    # Like pairs (no anchors), f = 10/80: no prefix of the walk earns a weight, so the
    # fill pass gives the 10 MB to the first that fits, a.
    order = make_order([("a",), ("b",), ("c",), ("d",)], {"a": 10 * MB, "b": 30 * MB, "c": 10 * MB, "d": 30 * MB})
    assert floor(order, 0).bytes == 40 * MB and anchors(order, 50 * MB, 0)[0] == frozenset()
    assert WeightResidency(order, 50 * MB, "priority", 0).pinned == frozenset("a")
    # A heavy weight that sets every widest pair is an anchor: pinned, all three fit.
    order = make_order([("a",), ("b",), ("c",)], {"a": 10 * MB, "b": 10 * MB, "c": 100 * MB})
    assert WeightResidency(order, 170 * MB, "priority", 0).pinned == frozenset("abc")


def test_priority_prefetch_reaches_past_a_run_of_pinned_kernels():
    """The window runs on to the L-th streamed kernel: the next step's first streamed weight
    is prefetched as the pinned tail starts, not L kernels before it is needed."""
    # Four like heads: pinning one leaves another pair as wide, so there are no anchors.
    sizes = {f"w{i}": (100 if i < 4 else 10) * MB for i in range(10)}
    order = make_order([(w,) for w in sizes], sizes)
    policy = WeightResidency(order, 260 * MB, "priority", 1)
    assert policy.pinned == frozenset(f"w{i}" for i in range(4, 10))  # the tail w4..w9
    for _ in range(2):
        for i in range(len(order)):
            policy.issue(i)
    w0 = [d for d in policy.log if d.step == 1 and d.action == "prefetch" and d.target == "w0"]
    assert [(d.position, d.detail) for d in w0] == [(4, 0)]  # at the tail's first kernel, for position 0
    # Without a pinned set the window is the next L kernels, as before: lru prefetches w0 at w9.
    lru = WeightResidency(order, 260 * MB, "lru", 1)
    for _ in range(2):
        for i in range(len(order)):
            lru.issue(i)
    assert [d.position for d in lru.log if d.step == 1 and d.action == "prefetch" and d.target == "w0"] == [9]


def test_priority_pins_the_weights_that_set_the_room():
    """A decoder: embedding and head (100 MB each) around 8 layers of 20 MB. Their pair
    across the step's boundary sets the floor (200 + 100 headroom at lookahead 2); pinned,
    the layers need room for two and one more (60 MB), so 240 MB more is pinned."""
    sizes = {"embed": 100 * MB, **{f"l{i}": 20 * MB for i in range(8)}, "head": 100 * MB}
    order = make_order([(w,) for w in sizes], sizes)
    assert floor(order, 2).bytes == 300 * MB
    assert anchors(order, 330 * MB, 2) == (frozenset({"embed", "head"}), 60 * MB)
    pinned = WeightResidency(order, 330 * MB, "priority", 2).pinned
    assert {"embed", "head"} <= pinned and sum(sizes[w] for w in pinned) == 260 * MB  # 3 layers
    # Either alone leaves the other in the widest pair (120 + 100 headroom: 320 MB with
    # it), but the two together fit at the floor itself.
    assert anchors(order, 300 * MB, 2) == (frozenset({"embed", "head"}), 60 * MB)
    assert anchors(order, 259 * MB, 2) == (frozenset(), 300 * MB)  # allow_below_floor's budgets
    # Pinning a would leave b + c, 1 MB narrower: under ANCHOR_GAIN of the room, no anchor.
    near = make_order([("a",), ("b",), ("c",)], {"a": 100 * MB, "b": 100 * MB, "c": 99 * MB})
    assert anchors(near, 1000 * MB, 0) == (frozenset(), 200 * MB)


def test_a_light_streamed_kernel_is_in_the_window_but_does_not_count():
    """Kernels streaming under LIGHT_FRACTION of the median streamed kernel's bytes (l0, l1:
    2 MB against 100) are prefetched in order, but the window runs on past them to the L-th
    kernel that counts: h2 is prefetched while h1 is issued, not two kernels later."""
    sizes = {"h0": 100 * MB, "h1": 100 * MB, "l0": 2 * MB, "l1": 2 * MB, "h2": 100 * MB, "h3": 100 * MB}
    order = make_order([(w,) for w in sizes], sizes)
    policy = WeightResidency(order, 1000 * MB, "lru", 1)
    for i in range(len(order)):
        policy.issue(i)
    prefetched = [(d.position, d.target, d.detail) for d in policy.log if d.action == "prefetch"]
    assert prefetched == [(0, "h1", 1), (1, "l0", 2), (1, "l1", 3), (1, "h2", 4), (4, "h3", 5)]
    # Counting every streamed kernel, h2 would wait for l1's issue (the window of 1 kernel).
    counted = WeightResidency(make_order([(w,) for w in sizes], {w: 100 * MB for w in sizes}), 1000 * MB, "lru", 1)
    for i in range(len(order)):
        counted.issue(i)
    assert [d.position for d in counted.log if d.action == "prefetch" and d.target == "h2"] == [3]


# --- summary: bytes copied per step --------------------------------------------

def test_cyclic_lru_recopies_every_weight_while_belady_and_priority_copy_less():
    order = cyclic(6)
    model = 600 * MB
    for lookahead, budget in ((0, 400 * MB), (1, 400 * MB), (2, 500 * MB)):
        by = {e: residency_summary(order, budget, e, lookahead) for e in EVICTIONS}
        assert by["lru"].streamed_bytes_per_step == model
        assert by["lru"].copies_per_step == 6
        assert by["belady"].streamed_bytes_per_step < model
        assert by["priority"].streamed_bytes_per_step < model
    s = residency_summary(order, 400 * MB, "priority", 0)
    assert (s.resident, s.resident_bytes, s.streamed_bytes_per_step, s.first_step_bytes) == (
        frozenset({"w2", "w5"}), 200 * MB, 400 * MB, 600 * MB)
    s = residency_summary(order, 400 * MB, "belady", 0)
    assert s.streamed_bytes_per_step == 400 * MB


def test_summary_with_unlimited_budget_is_all_resident():
    s = residency_summary(SHARED, None, "belady", 2)
    assert s.resident == frozenset("abcd") and s.streamed_bytes_per_step == 0
    assert s.first_step_bytes == sum(SHARED.sizes.values())


# --- properties ------------------------------------------------------------------

@st.composite
def access_orders(draw, max_kernels: int = 8) -> AccessOrder:
    names = [f"w{i}" for i in range(draw(st.integers(1, 8)))]
    sizes = {w: draw(st.integers(1, 60)) for w in names}
    reads = [tuple(draw(st.lists(st.sampled_from(names), max_size=3, unique=True)))
             for _ in range(draw(st.integers(1, max_kernels)))]
    return make_order(reads, sizes)


def replay(order: AccessOrder, policy: WeightResidency, steps: int, above_floor: bool) -> int:
    """Issue `steps` steps, carrying out the log as a driver would; checks every
    safety rule on the way and returns the number of hazards."""
    n, budget = len(order), policy.budget_bytes
    resident: set[str] = set()
    hazards = 0
    for _ in range(steps):
        for i in range(n):
            cur, prev = set(order.reads[i]), set(order.reads[(i - 1) % n])
            ds = policy.issue(i)
            assert [d.target for d in ds if d.action in ("hit", "fetch")] == list(
                dict.fromkeys(order.reads[i]))
            for d in ds:
                if d.action == "evict":
                    assert d.target in resident and d.target not in cur
                    if above_floor:
                        assert d.target not in prev
                    resident.remove(d.target)
                elif d.action in ("fetch", "prefetch"):
                    assert d.target not in resident
                    resident.add(d.target)
                elif d.action == "hit":
                    assert d.target in resident
                else:
                    assert d.action == "hazard" and not above_floor
                    assert d.target in prev - cur and d.position == (i - 1) % n
                    hazards += 1
                if budget is not None:
                    assert sum(order.sizes[w] for w in resident) <= budget
            assert cur <= resident  # the kernel's weights are all there when it runs
    assert resident == policy.resident
    return hazards


@settings(max_examples=300, deadline=None)
@given(access_orders(), st.sampled_from(sorted(EVICTIONS)), st.integers(0, 4),
       st.integers(0, 200), st.booleans())
def test_above_floor_no_policy_evicts_current_or_previous_weights(order, eviction, lookahead,
                                                                   extra, unlimited):
    budget = None if unlimited else floor(order, lookahead).bytes + extra
    assert replay(order, WeightResidency(order, budget, eviction, lookahead), 3, True) == 0


@settings(max_examples=300, deadline=None)
@given(access_orders(), st.sampled_from(sorted(EVICTIONS)), st.integers(0, 4), st.data())
def test_below_the_pair_floor_hazards_appear(order, eviction, lookahead, data):
    f = floor(order, lookahead)
    biggest = max(sum(order.sizes[w] for w in set(r)) for r in order.reads)
    if biggest >= f.pair_bytes:
        return  # no budget fits every kernel yet splits a pair
    budget = data.draw(st.integers(biggest, f.pair_bytes - 1))
    policy = WeightResidency(order, budget, eviction, lookahead, allow_below_floor=True)
    assert replay(order, policy, 2, False) > 0


@settings(max_examples=200, deadline=None)
@given(access_orders(), st.sampled_from(sorted(EVICTIONS)), st.integers(0, 4), st.integers(0, 100))
def test_two_runs_give_the_same_log(order, eviction, lookahead, extra):
    budget = floor(order, lookahead).bytes + extra

    def run() -> list[Decision]:
        p = WeightResidency(order, budget, eviction, lookahead)
        for _ in range(3):
            for i in range(len(order)):
                p.issue(i)
        return p.log

    assert run() == run()


@settings(max_examples=300, deadline=None)
@given(st.integers(3, 10), st.integers(0, 3), st.data())
def test_cyclic_order_over_budget_lru_copies_all_priority_less(n, lookahead, data):
    sizes = {f"w{i}": data.draw(st.integers(1, 50)) for i in range(n)}
    order = make_order([(w,) for w in sizes], sizes)
    model = sum(sizes.values())
    f = floor(order, lookahead)
    if f.bytes >= model:
        return
    budget = data.draw(st.integers(f.bytes, model - 1))
    assert residency_summary(order, budget, "lru", lookahead).streamed_bytes_per_step == model
    priority = residency_summary(order, budget, "priority", lookahead)
    # Room for some weight over the floor: the walk or the fill pass keeps one.
    if budget - f.bytes >= min(sizes.values()):
        assert priority.streamed_bytes_per_step < model
        assert priority.resident


@settings(max_examples=300, deadline=None)
@given(access_orders(), st.sampled_from(sorted(EVICTIONS)), st.integers(0, 4), st.integers(0, 200))
def test_every_victim_is_the_best_unprotected_candidate(order, eviction, lookahead, extra):
    """Brute force beside the policies' heap and queue: each evicted weight is the
    best of the resident, unpinned weights not protected at that moment (Belady:
    furthest next use, ties to the smallest name; LRU and priority: least
    recently used)."""
    n = len(order)
    policy = WeightResidency(order, floor(order, lookahead).bytes + extra, eviction, lookahead)
    next_use = BeladyEviction(order, None, policy.lookahead).next_use
    resident: set[str] = set()
    last_use: dict[str, int] = {}
    tick = itertools.count()
    for _ in range(10):  # enough uses for Belady's heap to drop its stale entries
        for i in range(n):
            for d in policy.issue(i):
                if d.action == "evict":
                    ahead = (d.detail - i) % n  # 0 for a demand fetch, else the prefetch's kernel
                    protected = {w for k in range(-1, ahead + 1) for w in order.reads[(i + k) % n]}
                    candidates = resident - protected - policy.pinned
                    key = ((lambda w: (-next_use(w, i), w)) if eviction == "belady"
                           else last_use.__getitem__)
                    assert d.target == min(candidates, key=key)
                    resident.remove(d.target)
                else:
                    resident.add(d.target)
                    last_use[d.target] = next(tick)  # hit, fetch and prefetch all count as use


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=2, max_size=40), st.integers(0, 3), st.data())
def test_spread_priority_set_keeps_every_half_of_the_order_at_the_same_fraction(weights, lookahead,
                                                                                  data):
    sizes = {f"w{i}": s for i, s in enumerate(weights)}
    order = make_order([(w,) for w in sizes], sizes)
    model = sum(weights)
    fl = floor(order, lookahead).bytes
    budget = data.draw(st.integers(fl, fl + model - 1))  # 0 <= f < 1
    pinned = WeightResidency(order, budget, "priority", lookahead).pinned
    first, room = anchors(order, budget, lookahead)
    rest = {w: s for w, s in sizes.items() if w not in first}
    f = min(1.0, (budget - room - (model - sum(rest.values()))) / max(1, sum(rest.values())))
    n = len(weights)
    # Every prefix of the walk keeps within one weight's size under f x its
    # bytes and the fill pass adds less than one more, so a window (two
    # prefixes' difference; a wrapping one, three) lands within two weights'
    # sizes of f x its bytes.
    tolerance = 2 * max(weights)
    for start in range(n):  # every contiguous half, wrapping too: steps repeat
        half = [f"w{(start + k) % n}" for k in range(n // 2) if f"w{(start + k) % n}" in rest]
        kept = sum(sizes[w] for w in half if w in pinned)
        assert abs(kept - f * sum(sizes[w] for w in half)) <= tolerance


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=2, max_size=40), st.integers(0, 3), st.data())
def test_priority_set_leaves_its_streamed_part_the_room_of_its_floor(weights, lookahead, data):
    """Pinned bytes plus the floor of what streams fit the budget (so a demand fetch always
    finds room), and the anchors never pin less than pinning budget - floor would."""
    sizes = {f"w{i}": s for i, s in enumerate(weights)}
    order = make_order([(w,) for w in sizes], sizes)
    fl = floor(order, lookahead).bytes
    budget = data.draw(st.integers(fl, fl + sum(weights)))
    pinned = WeightResidency(order, budget, "priority", lookahead).pinned
    streamed = AccessOrder(order.kernels, order.reads, {w: 0 if w in pinned else s for w, s in sizes.items()})
    kept = sum(sizes[w] for w in pinned)
    assert kept + floor(streamed, lookahead).bytes <= budget
    assert kept >= budget - fl - max(weights)


def test_belady_next_use_is_cyclic():
    b = BeladyEviction(cyclic(4), None, 0)
    assert [b.next_use("w1", p) for p in range(4)] == [1, 4, 3, 2]


# --- the config group -------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(EVICTIONS))
def test_weights_group_composes(name):
    from hydra import compose, initialize_config_dir

    from engine.config import register

    register()
    conf = os.path.join(os.path.dirname(__file__), "..", "conf")
    with initialize_config_dir(config_dir=os.path.abspath(conf), version_base="1.3"):
        cfg = compose("config", overrides=["model=tiny", f"weights={name}"])
    assert (cfg.weights.eviction, cfg.weights.lookahead) == (name, 2)


def test_keep_last_steps_drops_whole_older_steps_in_place():
    from engine.policy import Decision, keep_last_steps

    log = [Decision(s, 0, "hit", f"w{i}") for i, s in enumerate([0, 0, 1, 1, 2])]
    keep_last_steps(log, None)
    assert len(log) == 5
    keep_last_steps(log, 2)
    assert [d.step for d in log] == [1, 1, 2]
    keep_last_steps(log, 5)
    assert [d.step for d in log] == [1, 1, 2]
    keep_last_steps(log, 0)
    assert log == []


@pytest.mark.parametrize("eviction", ["lru", "belady", "priority"])
def test_hazards_start_exactly_under_the_hard_minimum(eviction):
    """The floor's pair is the hard minimum: one byte under it every policy has a hazard;
    at it (still under the floor) none, only shorter prefetches."""
    from omegaconf import OmegaConf

    from engine.config import ActivationsConfig, WeightsConfig, load_hardware
    from engine.models import load_spec
    from engine.models.synthesize import synthesize
    from sim import simulate

    wl = OmegaConf.create({"name": "infer", "kind": "infer", "batch": 1, "video_tokens": 6144, "audio_tokens": 128,
                           "text_tokens": 256, "context_tokens": 0, "lora_rank": 0})
    trace = synthesize(load_spec("tiny", wl), wl, load_hardware("h100_pcie5"))
    fl = floor(trace.access_order(), 2)
    assert fl.pair_bytes < fl.bytes
    weights = OmegaConf.merge(OmegaConf.structured(WeightsConfig), {"eviction": eviction, "lookahead": 2})

    def hazards(budget: int) -> int:
        return len(simulate(trace, weights, OmegaConf.structured(ActivationsConfig), load_hardware("h100_pcie5"),
                            budget_bytes=budget, steps=2, allow_below_floor=True).prediction["hazards"])

    assert hazards(fl.pair_bytes - 1) > 0
    assert hazards(fl.pair_bytes) == 0
    with pytest.raises(BelowFloorError, match=rf"Hazards are certain only under {fl.pair_bytes / 1e6:.3f} MB"):
        WeightResidency(trace.access_order(), fl.bytes - 1, eviction, 2)
