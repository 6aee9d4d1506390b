"""Weight residency: which streamed weights sit in the budget, which are copied
in when, and which are evicted to make room (the victims chosen by an eviction
policy, engine/policy/eviction.py; the smallest safe budget, the floor, in
engine/policy/floor.py).

Issuing a kernel
----------------
`WeightResidency.issue(i)` answers, in the order the driver must carry it out:

1. Demand: each weight of K_i is a "hit" when resident (an in-flight prefetch
   counts as resident: the driver waits on its copy), else room is made and it
   is a "fetch". Protected from eviction: K_{i-1} ∪ K_i and the pinned set.
   Below the floor (only with allow_below_floor) the weights of K_{i-1} that K_i
   does not read may be evicted too; each such "evict" is followed by a "hazard"
   that names the reader position i-1.
2. Prefetch: over the window of i (below), in order, each non-resident weight
   of K_j is a "prefetch", after room is made with K_{i-1} ∪ ... ∪ K_j
   protected. When that room cannot be made, prefetching stops for this issue:
   a prefetch never evicts a weight needed sooner than itself.

The window of i is j = i+1 .. i+L (cyclic), and beyond that the kernels up to
the L-th *streamed* kernel after i: one that reads a weight outside the pinned
set, or none at all. A kernel whose weights the placement keeps resident
outside the policy (`resident_kernels`) needs no copy and is passed over as a
pinned-only one. Without a pinned set (lru, belady) every kernel is
streamed and the window is the next L kernels. With one (priority), a run of
pinned-only kernels would otherwise hide the next streamed weights from the
copy stream until the host nears them: at a step's end, say, where the model's
tail is resident and the next step opens with streamed blocks, the link would
idle through the tail.

A streamed kernel that copies less than LIGHT_FRACTION of the median streamed
kernel's bytes is in the window but does not count toward L: its copy keeps the
link busy for a fraction of a kernel's time, so a window filled with such
kernels (a model's head, mostly pinned, streaming a few small projections)
would leave the next large kernel's copy unstarted and the link idle.

Resident bytes (in-flight prefetches included) never exceed the budget. Answers
depend only on the order of the questions: a logical clock, never time.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from statistics import median
from typing import Mapping

from engine.errors import BelowFloorError, ConfigError
from engine.policy import AccessOrder, Decision
from engine.policy.eviction import EVICTIONS
from engine.policy.floor import floor, reads, widest_window
from engine.units import MB

LIGHT_FRACTION = 0.25  # of the median streamed kernel's bytes: a lighter one does not count toward the lookahead


class WeightResidency:
    """The WeightPolicy: answers `issue(position)` with hits, fetches, evictions,
    prefetches (and hazards below the floor); every answer also goes to `.log`.

    budget_bytes None means unlimited: fetch on first use, never evict.
    """

    def __init__(self, order: AccessOrder, budget_bytes: int | None, eviction: str,
                 lookahead: int, allow_below_floor: bool = False,
                 resident_kernels: frozenset[int] = frozenset()):
        if eviction not in EVICTIONS:
            raise ConfigError(
                f"weights.eviction={eviction!r} is not one of {', '.join(EVICTIONS)}; pick one of those")
        if lookahead < 0:
            raise ConfigError(f"weights.lookahead={lookahead} is negative; use 0 or more")
        self.order = order
        self.eviction = eviction
        self.budget_bytes = budget_bytes
        self.lookahead = lookahead
        self.allow_below_floor = allow_below_floor
        self.floor = floor(order, lookahead)
        if budget_bytes is not None:
            if budget_bytes < self.floor.bytes and not allow_below_floor:
                raise BelowFloorError(budget_bytes, self.floor.bytes, self.floor.pair_bytes, self.floor.kernels)
            _check_every_kernel_fits(order, budget_bytes)
        self._eviction = EVICTIONS[eviction](order, budget_bytes, lookahead)
        self._pinned = self._eviction.pinned
        self._reads = [reads(order, p) for p in range(len(order))]
        self._read_sets = [frozenset(r) for r in self._reads]
        # What evictions must spare at each position, fixed by the order: the previous
        # and the current kernel's weights, then those of each kernel up to the
        # lookahead (beyond n-1 kernels ahead the window has wrapped onto itself).
        # Built once: the policy answers every kernel of every step with them.
        n = len(order)
        self._guard = [self._read_sets[(i - 1) % n] | self._read_sets[i] for i in range(n)]
        self._window = _windows(self._read_sets, self._pinned, lookahead, resident_kernels, order.sizes)
        self._guard_ahead: list[list[frozenset[str]]] = []
        for i in range(n):
            window, ahead = self._guard[i], []
            for j in self._window[i]:
                window = window | self._read_sets[j]
                ahead.append(window)
            self._guard_ahead.append(ahead)
        self._resident: dict[str, None] = {}  # insertion-ordered set
        self._resident_bytes = 0
        self._pinned_bytes = 0  # the resident part of the pinned set
        self._at = 0  # absolute position being issued: step * len(order) + position
        self._next_position = 0
        self._issued = False
        self.step = 0
        self.log: list[Decision] = []

    @property
    def pinned(self) -> frozenset[str]:
        return self._pinned

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
        self._at = self.step * n + position
        out: list[Decision] = []
        self._demand(position, out)
        self._prefetch(position, out)
        self.log.extend(out)
        return out

    def _demand(self, i: int, out: list[Decision]) -> None:
        n = len(self.order)
        cur = self._read_sets[i]
        prev = self._read_sets[(i - 1) % n]
        protected = self._guard[i]
        for w in self._reads[i]:
            if w in self._resident:
                self._eviction.use(w, self._at)
                out.append(Decision(self.step, i, "hit", w))
                continue
            need = self._need(w)
            victims = self._eviction.pick(need, protected) if need > 0 else []
            for v in victims:
                self._evict(v, i, i, out)
            need -= sum(self.order.sizes[v] for v in victims)
            if need > 0:
                # Only below the floor: evicting the previous kernel's weights is
                # a use-after-evict hazard while that kernel may still run.
                assert self.allow_below_floor, "above the floor a demand fetch always finds room"
                ranked = self._eviction.rank((r for r in prev - cur if r in self._resident), i)
                for v in _enough(need, ranked, self.order.sizes):
                    self._evict(v, i, i, out)
                    reader_step = self.step if i > 0 else self.step - 1
                    out.append(Decision(reader_step, (i - 1) % n, "hazard", v, i))
            self._admit(w)
            out.append(Decision(self.step, i, "fetch", w, i))

    def _prefetch(self, i: int, out: list[Decision]) -> None:
        for j, protected in zip(self._window[i], self._guard_ahead[i]):
            for w in self._reads[j]:
                if w in self._resident:
                    continue
                need = self._need(w)
                if need > 0:
                    if need > self._evictable_bytes(protected):
                        return  # no room without evicting a weight needed sooner
                    for v in self._eviction.pick(need, protected):
                        self._evict(v, i, j, out)
                self._admit(w)
                out.append(Decision(self.step, i, "prefetch", w, j))

    def _need(self, weight: str) -> int:
        """Bytes to free before `weight` fits (<= 0: it fits already)."""
        if self.budget_bytes is None:
            return 0
        return self._resident_bytes + self.order.sizes[weight] - self.budget_bytes

    def _evictable_bytes(self, protected: set[str]) -> int:
        """Bytes a pick could free: resident, neither pinned nor protected."""
        sizes = self.order.sizes
        held = sum(sizes[w] for w in protected if w in self._resident and w not in self._pinned)
        return self._resident_bytes - self._pinned_bytes - held

    def _admit(self, weight: str) -> None:
        self._resident[weight] = None
        self._resident_bytes += self.order.sizes[weight]
        if weight in self._pinned:
            self._pinned_bytes += self.order.sizes[weight]
        self._eviction.use(weight, self._at)

    def _evict(self, weight: str, position: int, serves: int, out: list[Decision]) -> None:
        del self._resident[weight]
        self._resident_bytes -= self.order.sizes[weight]
        if weight in self._pinned:
            self._pinned_bytes -= self.order.sizes[weight]
        self._eviction.remove(weight)
        out.append(Decision(self.step, position, "evict", weight, serves))


def _windows(read_sets: list[frozenset[str]], pinned: frozenset[str], lookahead: int,
             resident_kernels: frozenset[int], sizes: Mapping[str, int]) -> list[tuple[int, ...]]:
    """Each position's prefetch window (module docstring): the next `lookahead` kernels,
    then on to the `lookahead`-th streamed one that is not light; never the position itself
    (n - 1 ahead at most)."""
    n = len(read_sets)
    # A kernel with no weights counts as streamed, unless the placement emptied it.
    streamed = [p not in resident_kernels and not (r and r <= pinned) for p, r in enumerate(read_sets)]
    copied = [sum(sizes[w] for w in r if w not in pinned) if streamed[p] else 0 for p, r in enumerate(read_sets)]
    typical = median([b for b in copied if b] or [0])
    counts = [streamed[p] and not (read_sets[p] and copied[p] < LIGHT_FRACTION * typical) for p in range(n)]
    stream = [p for p in range(n) if streamed[p]]
    out = []
    for i in range(n):
        ahead = min(lookahead, n - 1)
        window = [(i + a) % n for a in range(1, ahead + 1)]
        need = lookahead - sum(counts[j] for j in window)
        k = bisect_right(stream, (i + ahead) % n)  # the streamed positions after the window, cyclically
        for c in range(len(stream) if need > 0 else 0):
            q = stream[(k + c) % len(stream)]
            if not ahead < (q - i) % n:
                break  # wrapped round to the window (or to i itself)
            window.append(q)
            need -= counts[q]
            if not need:
                break
        out.append(tuple(window))
    return out


def _enough(need: int, ranked: list[str], sizes: Mapping[str, int]) -> list[str]:
    """The shortest prefix of `ranked` whose bytes reach `need` (all when short)."""
    chosen: list[str] = []
    for w in ranked:
        if need <= 0:
            break
        chosen.append(w)
        need -= sizes[w]
    return chosen


def _check_every_kernel_fits(order: AccessOrder, budget_bytes: int) -> None:
    """Even below the floor, one kernel's own weights must fit together."""
    need, biggest = widest_window(order, 1)
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
