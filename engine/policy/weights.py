"""Weight residency: which streamed weights sit in the budget, which are copied
in when, and which are evicted to make room.

The floor
---------
`floor(order, lookahead)` is the smallest budget this policy runs safely with:

    pair_bytes     = max over consecutive positions i, i+1 of bytes(K_i ∪ K_{i+1});
                     cyclic, since steps repeat, so (last, first) is a pair too.
                     A weight read by both kernels counts once.
    headroom_bytes = max over i of bytes(K_{i+2} ∪ ... ∪ K_{i+L}) for lookahead
                     L >= 2; 0 for L <= 1.
    bytes          = pair_bytes + headroom_bytes

The pair is what must be on the device together: while kernel i+1 is issued,
kernel i may still be running on the GPU and reading its weights, so neither set
may be evicted. The headroom is the room the copy stream needs to have the rest
of the lookahead window (beyond the next kernel) in flight. Above the floor every
demand fetch finds room without evicting a weight of the current or the
previous kernel, so no policy ever causes a use-after-evict hazard.

Issuing a kernel
----------------
`WeightResidency.issue(i)` answers, in the order the driver must carry it out:

1. Demand: each weight of K_i is a "hit" when resident (an in-flight prefetch
   counts as resident: the driver waits on its copy), else room is made and it
   is a "fetch". Protected from eviction: K_{i-1} ∪ K_i and the pinned set.
   Below the floor (only with allow_below_floor) the weights of K_{i-1} that K_i
   does not read may be evicted too; each such "evict" is followed by a "hazard"
   that names the reader position i-1.
2. Prefetch: for j = i+1 .. i+L (cyclic), each non-resident weight of K_j is a
   "prefetch", after room is made with K_{i-1} ∪ ... ∪ K_j protected. When that
   room cannot be made, prefetching stops for this issue: a prefetch never
   evicts a weight needed sooner than itself.

Resident bytes (in-flight prefetches included) never exceed the budget. Answers
depend only on the order of the questions: a logical clock, never time.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, Sequence

from engine.errors import BelowFloorError, ConfigError
from engine.policy import AccessOrder, Decision

MB = 1_000_000


def _reads(order: AccessOrder, position: int) -> tuple[str, ...]:
    """K_position without repeats, in read order."""
    return tuple(dict.fromkeys(order.reads[position]))


def _union_bytes(order: AccessOrder, positions: Iterable[int]) -> int:
    n = len(order)
    weights = {w for p in positions for w in order.reads[p % n]}
    return sum(order.sizes[w] for w in weights)


@dataclass(frozen=True)
class Floor:
    """The smallest budget that runs without hazards (module docstring)."""

    bytes: int
    pair_bytes: int
    headroom_bytes: int
    kernels: tuple[str, str]  # the consecutive pair that sets pair_bytes


def floor(order: AccessOrder, lookahead: int) -> Floor:
    """Floor of `order` with `lookahead` kernels prefetched ahead."""
    n = len(order)
    if n == 0:
        raise ConfigError("the access order is empty; the model spec produced no kernels")
    pair_bytes, pair_at = -1, 0
    for i in range(n):
        b = _union_bytes(order, (i, i + 1))
        if b > pair_bytes:  # strict: the first maximal pair names the floor
            pair_bytes, pair_at = b, i
    headroom = 0
    if lookahead >= 2:
        headroom = max(_union_bytes(order, range(i + 2, i + lookahead + 1)) for i in range(n))
    return Floor(
        bytes=pair_bytes + headroom,
        pair_bytes=pair_bytes,
        headroom_bytes=headroom,
        kernels=(order.kernels[pair_at], order.kernels[(pair_at + 1) % n]),
    )


class Eviction(Protocol):
    """Chooses victims; `pinned` weights are never offered to it."""

    pinned: frozenset[str]

    def touch(self, weight: str, clock: int) -> None: ...

    def victim(self, candidates: Sequence[str], position: int) -> str: ...


class LruEviction:
    """Least recently used goes first (the weight-offload RFC's policy).

    Hits, fetches and prefetches all count as use, each at its own tick of the
    logical clock, so there are no ties.
    """

    def __init__(self, order: AccessOrder, budget_bytes: int | None, floor_: Floor):
        self.pinned: frozenset[str] = frozenset()
        self._last_use: dict[str, int] = {}

    def touch(self, weight: str, clock: int) -> None:
        self._last_use[weight] = clock

    def victim(self, candidates: Sequence[str], position: int) -> str:
        return min(candidates, key=self._last_use.__getitem__)


class BeladyEviction:
    """Belady's MIN over the known order: the weight whose next use is furthest.

    Next use is counted cyclically from the issuing position (steps repeat); a
    weight read at that very position is next needed a whole step later. Ties go
    to the smallest name, so the choice is deterministic.
    """

    def __init__(self, order: AccessOrder, budget_bytes: int | None, floor_: Floor):
        self.pinned: frozenset[str] = frozenset()
        self._n = len(order)
        self._uses: dict[str, list[int]] = {}
        for p in range(self._n):
            for w in _reads(order, p):
                self._uses.setdefault(w, []).append(p)

    def touch(self, weight: str, clock: int) -> None:
        pass  # the future, not the past, decides

    def next_use(self, weight: str, position: int) -> int:
        """Kernels from `position` until `weight` is read again (1..n)."""
        uses = self._uses[weight]
        k = bisect_right(uses, position)
        return uses[k] - position if k < len(uses) else uses[0] + self._n - position

    def victim(self, candidates: Sequence[str], position: int) -> str:
        return min(candidates, key=lambda w: (-self.next_use(w, position), w))


class PriorityEviction(LruEviction):
    """A fixed resident set kept across steps, the rest streamed (comfy-aimdo's watermark).

    The pinned set is chosen once: distinct weights in first-use order, taken
    while their total fits in budget - floor (the floor stays free as the
    streaming working space). Pinned weights are fetched on first use and never
    evicted; streamed weights are evicted LRU among themselves.
    """

    def __init__(self, order: AccessOrder, budget_bytes: int | None, floor_: Floor):
        super().__init__(order, budget_bytes, floor_)
        self.pinned = _priority_set(order, budget_bytes, floor_.bytes)


def _priority_set(order: AccessOrder, budget_bytes: int | None, floor_bytes: int) -> frozenset[str]:
    if budget_bytes is None:  # unlimited: nothing is ever evicted anyway
        return frozenset()
    room = budget_bytes - floor_bytes
    pinned: list[str] = []
    for w in dict.fromkeys(w for p in range(len(order)) for w in _reads(order, p)):
        if order.sizes[w] > room:
            break  # a prefix of first use, as aimdo keeps: the earliest weights stay
        pinned.append(w)
        room -= order.sizes[w]
    return frozenset(pinned)


EVICTIONS: dict[str, Callable[[AccessOrder, int | None, Floor], Eviction]] = {
    "lru": LruEviction,
    "belady": BeladyEviction,
    "priority": PriorityEviction,
}


class WeightResidency:
    """The WeightPolicy: answers `issue(position)` with hits, fetches, evictions,
    prefetches (and hazards below the floor); every answer also goes to `.log`.

    budget_bytes None means unlimited: fetch on first use, never evict.
    """

    def __init__(self, order: AccessOrder, budget_bytes: int | None, eviction: str,
                 lookahead: int, allow_below_floor: bool = False):
        if eviction not in EVICTIONS:
            raise ConfigError(
                f"weights.eviction={eviction!r} is not one of {', '.join(EVICTIONS)}; pick one of those")
        if lookahead < 0:
            raise ConfigError(f"weights.lookahead={lookahead} is negative; use 0 or more")
        self.order = order
        self.budget_bytes = budget_bytes
        self.lookahead = lookahead
        self.allow_below_floor = allow_below_floor
        self.floor = floor(order, lookahead)
        if budget_bytes is not None:
            if budget_bytes < self.floor.bytes and not allow_below_floor:
                raise BelowFloorError(budget_bytes, self.floor.bytes, self.floor.kernels)
            _check_every_kernel_fits(order, budget_bytes)
        self._eviction = EVICTIONS[eviction](order, budget_bytes, self.floor)
        self._reads = [_reads(order, p) for p in range(len(order))]
        self._resident: dict[str, None] = {}  # insertion-ordered set
        self._resident_bytes = 0
        self._clock = 0
        self._next_position = 0
        self._issued = False
        self.step = 0
        self.log: list[Decision] = []

    @property
    def pinned(self) -> frozenset[str]:
        return self._eviction.pinned

    @property
    def resident(self) -> frozenset[str]:
        return frozenset(self._resident)

    @property
    def resident_bytes(self) -> int:
        return self._resident_bytes

    def issue(self, position: int) -> list[Decision]:
        """Decisions for issuing the kernel at `position` (module docstring)."""
        n = len(self.order)
        if position != self._next_position:
            # Answers depend on the order of questions; a skipped or repeated
            # kernel would make the two drivers' logs diverge silently.
            raise ValueError(
                f"issue({position}) out of launch order: the next kernel is position "
                f"{self._next_position} ({self.order.kernels[self._next_position]})")
        if position == 0 and self._issued:
            self.step += 1
        self._issued = True
        self._next_position = (position + 1) % n
        out: list[Decision] = []
        self._demand(position, out)
        self._prefetch(position, out)
        self.log.extend(out)
        return out

    def _demand(self, i: int, out: list[Decision]) -> None:
        n = len(self.order)
        cur = set(self._reads[i])
        prev = set(self._reads[(i - 1) % n])
        protected = prev | cur | self.pinned
        for w in self._reads[i]:
            if w in self._resident:
                self._use(w)
                out.append(Decision(self.step, i, "hit", w))
                continue
            need = self._need(w)
            victims = self._pick(need, self._unprotected(protected), i)
            for v in victims:
                self._evict(v, i, i, out)
            need -= sum(self.order.sizes[v] for v in victims)
            if need > 0:
                # Only below the floor: evicting the previous kernel's weights is
                # a use-after-evict hazard while that kernel may still run.
                assert self.allow_below_floor, "above the floor a demand fetch always finds room"
                for v in self._pick(need, [r for r in self._resident if r in prev - cur], i):
                    self._evict(v, i, i, out)
                    reader_step = self.step if i > 0 else self.step - 1
                    out.append(Decision(reader_step, (i - 1) % n, "hazard", v, i))
            self._admit(w)
            out.append(Decision(self.step, i, "fetch", w, i))

    def _prefetch(self, i: int, out: list[Decision]) -> None:
        n = len(self.order)
        protected = set(self._reads[(i - 1) % n]) | set(self._reads[i]) | self.pinned
        # Beyond n-1 kernels ahead the window has wrapped onto itself.
        for ahead in range(1, min(self.lookahead, n - 1) + 1):
            j = (i + ahead) % n
            protected |= set(self._reads[j])
            for w in self._reads[j]:
                if w in self._resident:
                    continue
                need = self._need(w)
                victims = self._pick(need, self._unprotected(protected), i)
                if need > sum(self.order.sizes[v] for v in victims):
                    return  # no room without evicting a weight needed sooner
                for v in victims:
                    self._evict(v, i, j, out)
                self._admit(w)
                out.append(Decision(self.step, i, "prefetch", w, j))

    def _need(self, weight: str) -> int:
        """Bytes to free before `weight` fits (<= 0: it fits already)."""
        if self.budget_bytes is None:
            return 0
        return self._resident_bytes + self.order.sizes[weight] - self.budget_bytes

    def _unprotected(self, protected: set[str]) -> list[str]:
        return [w for w in self._resident if w not in protected]

    def _pick(self, need: int, candidates: list[str], position: int) -> list[str]:
        """Victims in the policy's order until `need` bytes are freed; all of
        `candidates` when they cannot free that much."""
        chosen: list[str] = []
        while need > 0 and candidates:
            v = self._eviction.victim(candidates, position)
            candidates.remove(v)
            chosen.append(v)
            need -= self.order.sizes[v]
        return chosen

    def _use(self, weight: str) -> None:
        self._clock += 1
        self._eviction.touch(weight, self._clock)

    def _admit(self, weight: str) -> None:
        self._resident[weight] = None
        self._resident_bytes += self.order.sizes[weight]
        self._use(weight)

    def _evict(self, weight: str, position: int, serves: int, out: list[Decision]) -> None:
        del self._resident[weight]
        self._resident_bytes -= self.order.sizes[weight]
        out.append(Decision(self.step, position, "evict", weight, serves))


def _check_every_kernel_fits(order: AccessOrder, budget_bytes: int) -> None:
    """Even below the floor, one kernel's own weights must fit together."""
    biggest = max(range(len(order)), key=lambda p: (_union_bytes(order, (p,)), -p))
    need = _union_bytes(order, (biggest,))
    if need > budget_bytes:
        raise ConfigError(
            f"kernel {order.kernels[biggest]} alone reads {need / MB:.3f} MB of weights, more than "
            f"the budget of {budget_bytes / MB:.3f} MB; no policy can run it: use budget="
            f"{-(-need // MB)} or more")


@dataclass(frozen=True)
class ResidencySummary:
    """Steady-state residency after a few steps with no clock (what plan reports)."""

    # Weights resident through the whole last step: resident at its end, neither
    # evicted nor copied in during it (a weight copied in that step is streamed).
    resident_bytes: int
    resident: frozenset[str]
    streamed_bytes_per_step: int  # fetched + prefetched in the last step
    copies_per_step: int
    first_step_bytes: int  # fetched + prefetched in the first step (the cold start)


def residency_summary(order: AccessOrder, budget_bytes: int | None, eviction: str,
                      lookahead: int, steps: int = 3, *,
                      allow_below_floor: bool = False) -> ResidencySummary:
    """Run `steps` steps of WeightResidency and summarize the last (and the first)."""
    if steps < 1:
        raise ConfigError(f"steps={steps} must be at least 1")
    policy = WeightResidency(order, budget_bytes, eviction, lookahead, allow_below_floor)
    for _ in range(steps):
        for position in range(len(order)):
            policy.issue(position)

    def copied(step: int) -> list[str]:
        return [d.target for d in policy.log
                if d.step == step and d.action in ("fetch", "prefetch")]

    last = steps - 1
    streamed = copied(last)
    evicted = {d.target for d in policy.log if d.step == last and d.action == "evict"}
    resident = policy.resident - evicted - set(streamed)
    return ResidencySummary(
        resident_bytes=sum(order.sizes[w] for w in resident),
        resident=resident,
        streamed_bytes_per_step=sum(order.sizes[w] for w in streamed),
        copies_per_step=len(streamed),
        first_step_bytes=sum(order.sizes[w] for w in copied(0)),
    )
