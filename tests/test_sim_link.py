"""sim/link.py and sim/pool.py on their own: closed-form copy times, FIFO, the duplex cap."""
from __future__ import annotations

import pytest
import simpy

from engine.config import HardwareConfig
from engine.errors import ConfigError
from sim.link import ACTIVATIONS, D2H, H2D, MIB, PcieLink, SmallCopyEfficiency, source_gbps
from sim.pool import DevicePool

# The lent H100's measured link (benchmarks/results/hardware-h100-2026-11-22.md).
H100 = HardwareConfig(
    name="h100", source="DESIGN.md", device_memory_mb=81559, h2d_gbps=54.4, d2h_gbps=54.2,
    duplex_gbps=87.6, pageable_gbps=7.1, mmap_gbps=7.3, mmap_registered_gbps=55.0,
    small_copy_mib=[1, 4, 256], small_copy_gbps=[46.0, 52.6, 54.4], matmul_tflops=771.0, hbm_gbps=3000.0)
GB = 10**9


def _link() -> tuple[simpy.Environment, PcieLink, list]:
    env = simpy.Environment()
    log: list = []
    return env, PcieLink(env, H100, lambda t, track, what: log.append((t, track, what))), log


def test_small_copy_efficiency_interpolates() -> None:
    eff = SmallCopyEfficiency(H100)
    assert eff(MIB) * 54.4 == pytest.approx(46.0)
    assert eff(MIB // 4) * 54.4 == pytest.approx(46.0)  # below the smallest point its rate holds
    assert eff(int(2.5 * MIB)) * 54.4 == pytest.approx((46.0 + 52.6) / 2)
    assert eff(GB) == 1.0


def test_source_bandwidths() -> None:
    assert [source_gbps(H100, s) for s in ("pinned", "mmap_registered", "mmap", "pageable")] == \
        [54.4, 55.0, 7.3, 7.1]


def test_one_copy_alone_runs_at_its_rate() -> None:
    env, link, log = _link()
    c = link.copy(H2D, "w", GB, 54.4)
    env.run()
    assert c.end_ns == pytest.approx(GB / 54.4, abs=1)
    assert log == [(0, "h2d", "start w"), (c.end_ns, "h2d", "end w")]


def test_one_direction_is_fifo() -> None:
    env, link, _ = _link()
    a = link.copy(H2D, "a", GB, 54.4)
    b = link.copy(H2D, "b", GB, 54.4)
    env.run()
    assert b.start_ns == a.end_ns and b.end_ns == pytest.approx(2 * GB / 54.4, abs=2)


def test_duplex_cap_equal_bytes_share_it() -> None:
    env, link, _ = _link()
    up = link.copy(H2D, "up", GB, 54.4)
    down = link.copy(D2H, "down", GB, 54.2)
    env.run()
    expected = GB / (87.6 / 2)
    assert up.end_ns == pytest.approx(expected, rel=1e-6)
    assert down.end_ns == pytest.approx(expected, rel=1e-6)


def test_rerated_when_the_other_direction_starts_and_stops() -> None:
    env, link, _ = _link()
    up = link.copy(H2D, "up", 2 * GB, 54.4)
    t_join = 10_000_000  # D2H of 0.5 GB joins after 10 ms

    def later():
        yield env.timeout(t_join)
        link.copy(D2H, "down", GB // 2, 54.2)

    env.process(later())
    env.run()
    half = 87.6 / 2
    down_end = t_join + (GB / 2) / half
    up_left = 2 * GB - 54.4 * t_join - half * (down_end - t_join)
    assert up.end_ns == pytest.approx(down_end + up_left / 54.4, abs=3)


def test_a_slow_copy_leaves_the_rest_to_the_other_direction() -> None:
    # Max-min share: a pageable H2D (7.1 GB/s) cannot use half the duplex cap.
    env, link, _ = _link()
    link.copy(H2D, "slow", GB, 7.1)
    fast = link.copy(D2H, "fast", GB, 54.2)
    env.run()
    assert fast.end_ns == pytest.approx(GB / 54.2, rel=1e-6)


def test_gate_holds_the_queue() -> None:
    env, link, _ = _link()
    gate = env.event()
    a = link.copy(D2H, "a", GB, 54.2, gate=gate)
    b = link.copy(D2H, "b", GB, 54.2)

    def open_gate():
        yield env.timeout(1000)
        gate.succeed()

    env.process(open_gate())
    env.run()
    assert a.start_ns == 1000 and b.start_ns == a.end_ns


def test_a_gated_weight_copy_holds_back_its_own_stream_only() -> None:
    """The executor copies weights and restores activations on separate streams: a weight
    copy waiting for a free must not hold back a restore the kernel that frees it needs."""
    env, link, _ = _link()
    free = env.event()
    weight = link.copy(H2D, "weight", GB, 54.4, gate=free)
    after = link.copy(H2D, "next weight", GB, 54.4)
    restore = link.copy(H2D, "restore", GB // 10, 54.4, stream=ACTIVATIONS)

    def kernel():  # needs the restore, then frees the gated copy's bytes
        yield restore.done
        free.succeed()

    env.process(kernel())
    env.run()
    assert restore.start_ns == 0
    assert weight.start_ns == restore.end_ns and after.start_ns == weight.end_ns


def test_an_urgent_copy_passes_a_gated_head_and_waits_only_for_the_copy_in_progress() -> None:
    env, link, _ = _link()
    gate = env.event()
    running = link.copy(H2D, "running", GB, 54.4)
    held = link.copy(H2D, "held", GB, 54.4, gate=gate)  # a predictive restore whose spill is still out
    urgent = link.copy(H2D, "urgent", GB // 100, 54.4, urgent=True)  # an on-demand restore
    late = link.copy(H2D, "late", GB // 100, 54.4, urgent=True)

    def open_gate():
        yield env.timeout(100_000_000)
        gate.succeed()

    env.process(open_gate())
    env.run()
    assert urgent.start_ns == running.end_ns and late.start_ns == urgent.end_ns  # urgent ones in order
    assert held.start_ns == 100_000_000  # the gate still holds it, nothing else


def test_an_urgent_copy_starts_at_once_when_only_a_gated_head_waits() -> None:
    env, link, _ = _link()
    gate = env.event()
    held = link.copy(H2D, "held", GB, 54.4, gate=gate)
    urgent = link.copy(H2D, "urgent", GB // 100, 54.4, urgent=True)
    env.process((lambda: (yield env.timeout(10**9)) or gate.succeed())())
    env.run()
    assert urgent.start_ns == 0 and held.start_ns == 10**9


def test_pool_waits_fifo_until_frees() -> None:
    env = simpy.Environment()
    pool = DevicePool(env, 100)
    assert pool.allocate(60, "a") is None
    big = pool.allocate(60, "b")
    small = pool.allocate(10, "c")  # fits, but may not overtake b
    assert big is not None and small is not None
    pool.free(60)
    assert big.triggered and small.triggered and pool.weight_bytes == 70
    pool.add_activation(50)
    assert pool.peak == 120 and pool.device_bytes == 120
    with pytest.raises(ConfigError, match="larger than the whole budget"):
        pool.allocate(101, "huge")
