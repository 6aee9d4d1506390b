"""The link as execute reports it: weight copies' bytes over their copy-engine time."""
from dataclasses import replace

import pytest

from engine.modes.execute import copy_gbps, measured_copies, simulated_copies
from tests.test_sim import H100, cyclic, floor_bytes, run

MB = 10**6


def test_the_simulated_rate_is_the_profiles_for_large_copies_and_lower_for_small() -> None:
    big = cyclic(8, 300 * MB, 1000)  # lru re-copies every weight every step
    r = run(big, floor_bytes(big, 2), eviction="lru")
    spans = simulated_copies(r)
    assert len(spans) == 8  # the last step's window: one copy per weight
    assert copy_gbps(spans, big.weight_sizes) == pytest.approx(H100.h2d_gbps, rel=1e-3)
    small = cyclic(8, MB, 1000)
    r = run(small, floor_bytes(small, 2), eviction="lru", hardware=replace(H100, small_copy_mib=[1, 256],
                                                                          small_copy_gbps=[27.2, 54.4]))
    assert copy_gbps(simulated_copies(r), small.weight_sizes) == pytest.approx(27.2, rel=1e-3)  # under 1 MiB: its rate


def test_the_measured_rate_from_the_executors_timeline() -> None:
    timeline = [("compute", "k0", 0.0, 1.0), ("h2d", "w0", 0.0, 2.0), ("h2d", "w1", 2.0, 3.0)]
    sizes = {"w0": 100 * MB, "w1": 50 * MB}
    assert copy_gbps(measured_copies(timeline), sizes) == pytest.approx(150 * MB / 3e6)
    assert copy_gbps(measured_copies(None), sizes) is None
