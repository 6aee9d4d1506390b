"""Where a backend places weights, and what the residency policy plans with.

A stream-ordered pool places each weight at its own size (granule 1): the
policy plans with the weights' bytes and the budget as given.

A backend that maps device memory in granules (the vmm backend; 2 MiB on an
H100) gives each streamed weight whole granules, so the policy plans with
each weight's bytes rounded up to the granule: the granules mapped never
exceed the budget. Weights smaller than one granule would waste most of
theirs, so they are packed together (at RESIDENT_ALIGN) into one block that
stays resident for the run, and the policy plans the rest with what that
block leaves of the budget. A kernel whose weights are all in that block
needs no copy: the policy's prefetch window passes over it as over a kernel
of pinned weights. Both drivers build the same Placement, so they ask the
policy the same questions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from engine.errors import BelowFloorError, ConfigError
from engine.policy import AccessOrder
from engine.policy.weights import WeightResidency

RESIDENT_ALIGN = 256  # bytes; each resident weight starts at a multiple of this in its block
POOL_CHUNK = 32 << 20  # bytes; the CUDA pool reserves device memory in 32 MiB chunks
POOL_SLACK_LARGEST = 4  # the pool's slack, in units of the largest weight


def pool_slack_bytes(largest_weight_bytes: int) -> int:
    """Bytes the stream-ordered pool may reserve beyond its capacity so that fragmentation
    never refuses a block the policy's accounting allows (engine/executor/cuda.py): four of
    the largest weight, in whole pool chunks, at least one (never 0: a pool's maxSize of 0
    would mean no cap at all). The driver places the blocks, so how much of it a run
    reserves is not predicted; all of it is what the device may have to hold."""
    slack = max(POOL_SLACK_LARGEST * largest_weight_bytes, 1)
    return -(-slack // POOL_CHUNK) * POOL_CHUNK


@dataclass(frozen=True)
class Placement:
    granule: int  # bytes; 1: each weight at its own size
    order: AccessOrder  # what the residency policy sees: streamed weights at their placed sizes
    resident: Mapping[str, int]  # weights resident for the run -> offset in the resident block
    resident_bytes: int  # the resident block, in whole granules
    budget_bytes: int | None  # the budget left to the policy
    resident_kernels: frozenset[int] = frozenset()  # positions whose weights are all in the resident block

    @property
    def capacity_bytes(self) -> int:
        """The weights' device bytes a backend is sized for: the budget, or with none every
        weight as placed."""
        streamed = self.budget_bytes if self.budget_bytes is not None else sum(self.order.sizes.values())
        return streamed + self.resident_bytes

    @property
    def pool_bytes(self) -> int:
        """What the backend's pool is sized for: the capacity, or every weight as placed where
        that is less (a budget over the model)."""
        return held_bytes(self.capacity_bytes, self.order.sizes.values(), self.resident_bytes)


def held_bytes(capacity_bytes: int, placed_sizes: Iterable[int], resident_bytes: int = 0) -> int:
    """The most device bytes weights placed at `placed_sizes` (and a resident block) can hold
    under `capacity_bytes`."""
    return min(capacity_bytes, sum(placed_sizes) + resident_bytes)


def round_up(nbytes: int, granule: int) -> int:
    return -(-nbytes // granule) * granule


def place(order: AccessOrder, budget_bytes: int | None, granule: int) -> Placement:
    """The placement of `order`'s weights on a backend of `granule` bytes (1: none)."""
    if granule < 1:
        raise ConfigError(f"granule={granule}; a backend places weights in granules of at least 1 byte")
    if granule == 1:
        return Placement(1, order, {}, 0, budget_bytes)
    resident: dict[str, int] = {}
    end = 0
    for reads in order.reads:  # in access order, so the block reads front to back
        for w in reads:
            if w not in resident and order.sizes[w] < granule:
                resident[w] = end
                end = round_up(end + order.sizes[w], RESIDENT_ALIGN)
    resident_bytes = round_up(end, granule)
    if budget_bytes is not None and budget_bytes - resident_bytes < granule:
        raise ConfigError(
            f"budget {budget_bytes / 1e6:.1f} MB leaves no room beside the {resident_bytes / 1e6:.1f} MB of "
            f"weights under one granule ({granule / 2**20:g} MiB) that stay resident on this backend; raise "
            "the budget or use weights.backend=cuda")
    streamed = {w: round_up(n, granule) for w, n in order.sizes.items() if w not in resident}
    reads = tuple(tuple(w for w in r if w not in resident) for r in order.reads)
    emptied = frozenset(p for p, (was, now) in enumerate(zip(order.reads, reads)) if was and not now)
    left = None if budget_bytes is None else budget_bytes - resident_bytes
    return Placement(granule, AccessOrder(order.kernels, reads, streamed), resident, resident_bytes, left, emptied)


def all_resident(placement: Placement) -> bool:
    """Whether every streamed weight fits what the budget leaves, at its placed size, so none
    is ever evicted: a recorded module's weights are then bound once and its forward runs
    without hooks (engine/modules/hooks.py `KernelHooks.bound`), and the simulator predicts
    that forward. On a backend of granules the placed sizes are rounded up: weights whose
    bytes fit may still take turns there."""
    return placement.budget_bytes is None or placement.budget_bytes >= sum(placement.order.sizes.values())


def residency(placement: Placement, eviction: str, lookahead: int, allow_below_floor: bool = False) -> WeightResidency:
    """The residency policy over `placement`'s streamed weights; under the floor, the
    error counts the resident block in, so its figures are the user's budget's."""
    try:
        return WeightResidency(placement.order, placement.budget_bytes, eviction, lookahead, allow_below_floor,
                               placement.resident_kernels)
    except BelowFloorError as err:
        extra = placement.resident_bytes
        raise BelowFloorError(err.budget_bytes + extra, err.floor_bytes + extra, err.pair_bytes + extra,
                              err.kernels, extra) from None
