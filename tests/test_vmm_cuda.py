"""The vmm backend on a real GPU: blocks hold exactly the bytes copied, the budget
holds, nothing is relocated, and closing gives every byte back.

Skipped cleanly without an NVIDIA GPU or without cuda-python's driver bindings.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]
pytest.importorskip("cuda.bindings.driver", reason="needs cuda-python (pip install cuda-python)")

from engine.errors import ExecutorError  # noqa: E402
from engine.executor import WeightExecutor  # noqa: E402
from engine.executor.vmm import VmmBackend, vmm_granule  # noqa: E402
from engine.policy import AccessOrder  # noqa: E402
from engine.policy.chunks import conversion_slack  # noqa: E402
from engine.policy.placement import place  # noqa: E402
from engine.policy.floor import floor  # noqa: E402

MiB = 1 << 20


def streamed_order(seed: int = 0) -> tuple[AccessOrder, dict[str, torch.Tensor]]:
    """Weights of many sizes, some under one granule, read in a cyclic order."""
    g = torch.Generator().manual_seed(seed)
    sizes = [int(s) for s in torch.randint(MiB // 8, 9 * MiB, (24,), generator=g)]
    sizes = [s - s % 2 for s in sizes]
    names = [f"w{i}" for i in range(len(sizes))]
    host = {n: torch.randint(-1000, 1000, (s // 2,), dtype=torch.int16, generator=g).view(torch.bfloat16)
            for n, s in zip(names, sizes)}
    reads = tuple((names[i], names[(i * 7 + 3) % len(names)]) for i in range(len(names)))
    return AccessOrder(tuple(f"k{i}" for i in range(len(reads))), reads, dict(zip(names, sizes))), host


@pytest.mark.parametrize("eviction", ["lru", "belady", "priority"])
def test_every_fetched_block_holds_its_weight_within_the_budget(eviction):
    order, host = streamed_order()
    granule = vmm_granule()
    p = place(order, None, granule)
    budget = p.resident_bytes + floor(p.order, 2).bytes + 2 * granule
    WeightExecutor(order, host, budget_bytes=budget, backend="vmm").close()  # streams, events: made once
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    ex = WeightExecutor(order, host, budget_bytes=budget, eviction=eviction, lookahead=2, backend="vmm")
    assert isinstance(ex.backend, VmmBackend) and ex.placement.granule == granule
    with torch.no_grad():
        for step in range(8):
            with ex.step():
                for i in range(len(order)):
                    got = ex.fetch(i)
                    if step in (0, 7):
                        for w, t in got.items():
                            assert torch.equal(t.cpu().view(torch.int16), host[w].view(torch.int16)), (step, i, w)
    rows = ex.telemetry()
    assert sum(r["relocations"] for r in rows) == 0 and rows[-1]["evictions"] > 0
    assert all(r["peak_device_bytes"] <= budget for r in rows)
    # The chunks may exceed the budget by the books' conversion slack, never more.
    assert ex.backend.reserved_peak_bytes() <= budget + conversion_slack(max(order.sizes.values()), granule)
    # What the weights held, as the simulator counts it: the chunks, mapped or not.
    assert rows[-1]["held_device_bytes"] == max(ex.backend.reserved_peak_bytes(), rows[-1]["peak_device_bytes"])
    maps = ex.backend.map_counts()
    assert maps["maps"] > 0 and maps["unmaps"] > 0
    ex.close()
    torch.cuda.synchronize()
    assert torch.cuda.mem_get_info()[0] == free_before  # every chunk released


def test_a_budget_under_one_granule_is_one_clear_line():
    with pytest.raises(ExecutorError, match="under one granule"):
        VmmBackend(1000)
