"""The static plan: what a budget means for a model before any clock runs.

Access order, the floor and the kernels that set it, the pool warm list, and
for every eviction policy the resident set and the bytes it copies per step.
It is the first stage of every mode; `mode=plan` stops here.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.policy import AccessOrder
from engine.policy.placement import place
from engine.policy.eviction import EVICTIONS
from engine.policy.floor import Floor, floor
from engine.policy.weights import ResidencySummary, residency_summary
from engine.units import budget_bytes




@dataclass(frozen=True)
class Plan:
    model: str
    workload: str
    param_count: int
    model_bytes: int
    weight_count: int
    kernel_count: int  # positions in one step's access order (fwd + bwd for training)
    budget_bytes: int | None
    lookahead: int
    floor: Floor
    pool_warm_sizes: tuple[int, ...]
    policies: dict[str, ResidencySummary]
    resident_bytes: int = 0  # the vmm backend's block of weights under one granule, in the floor

    @property
    def below_floor(self) -> bool:
        return self.budget_bytes is not None and self.budget_bytes < self.floor.bytes

    def as_dict(self) -> dict:
        return {
            "model": self.model,
            "workload": self.workload,
            "param_count": self.param_count,
            "model_bytes": self.model_bytes,
            "weight_count": self.weight_count,
            "kernel_count": self.kernel_count,
            "budget_bytes": self.budget_bytes,
            "lookahead": self.lookahead,
            "floor_bytes": self.floor.bytes,
            "floor_pair_bytes": self.floor.pair_bytes,
            "floor_headroom_bytes": self.floor.headroom_bytes,
            "floor_kernels": list(self.floor.kernels),
            "floor_resident_bytes": self.resident_bytes,
            "below_floor": self.below_floor,
            "pool_warm_sizes": list(self.pool_warm_sizes),
            "policies": {
                name: {
                    "resident_bytes": s.resident_bytes,
                    "streamed_bytes_per_step": s.streamed_bytes_per_step,
                    "copies_per_step": s.copies_per_step,
                    "first_step_bytes": s.first_step_bytes,
                } for name, s in self.policies.items()
            },
        }


def make_plan(*, model: str, workload: str, param_count: int, order: AccessOrder,
              budget_mb: float | None, lookahead: int, granule: int = 1) -> Plan:
    """Plan one config on a backend that places weights in `granule`s (placement.py:
    the floor and the policies' figures then count the resident block and the
    rounded sizes). Below the floor the per-policy figures are omitted: no policy
    can run there without hazards, which only the simulator shows."""
    placed = place(order, None, granule)
    extra = placed.resident_bytes
    fl = floor(placed.order, lookahead)
    fl = Floor(fl.bytes + extra, fl.pair_bytes + extra, fl.headroom_bytes, fl.kernels)
    budget = budget_bytes(budget_mb)
    policies: dict[str, ResidencySummary] = {}
    if budget is None or budget >= fl.bytes:
        left = None if budget is None else budget - extra
        policies = {name: residency_summary(placed.order, left, name, lookahead) for name in EVICTIONS}
    return Plan(
        model=model,
        workload=workload,
        param_count=param_count,
        model_bytes=sum(order.sizes.values()),
        weight_count=len(order.sizes),
        kernel_count=len(order),
        budget_bytes=budget,
        lookahead=lookahead,
        floor=fl,
        pool_warm_sizes=tuple(sorted(set(placed.order.sizes.values()))),
        policies=policies,
        resident_bytes=extra,
    )
