"""Eviction policies: which resident weight goes when the budget needs room.

Each keeps its own ordered view of the resident set (`Eviction`): lru (least
recently used), belady (furthest next use in the known, cyclic order) and
priority (a fixed resident set spread through the order, the rest streamed lru).
`EVICTIONS` is the registry every config and the simulator name them from.
"""
from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from heapq import heapify, heappop, heappush
from typing import Callable, Container, Iterable, Protocol

from engine.policy import AccessOrder
from engine.policy.floor import floor, reads, widest_window

ANCHOR_GAIN = 1 / 64  # of the streaming room: an anchor must lower it by this much (`anchors`)


class Eviction(Protocol):
    """Chooses victims among the resident weights it has been told about.

    `use` is called on every hit, fetch and prefetch, `remove` on every
    evict, so the policy keeps its own ordered view of the resident set; a
    pick then walks that view from the best victim and skips the few
    protected weights, rather than ranking every resident weight on every
    pick (resident weights x picks a step).
    """

    pinned: frozenset[str]  # never picked (rank may still order them, below the floor)

    def use(self, weight: str, at: int) -> None:
        """`weight` was read or copied in while issuing absolute position `at`
        (step * len(order) + position)."""
        ...

    def remove(self, weight: str) -> None: ...

    def pick(self, need: int, protected: Container[str]) -> list[str]:
        """Resident, unpinned, unprotected weights, best victim first, until
        their bytes reach `need`; all of them when they fall short. The caller
        evicts every weight returned."""
        ...

    def rank(self, weights: Iterable[str], position: int) -> list[str]:
        """`weights` (resident, pinned or not) in victim order at `position`."""
        ...


class LruEviction:
    """Least recently used goes first (the weight-offload RFC's policy).

    Hits, fetches and prefetches all count as use, each at its own tick of the
    logical clock, so there are no ties. Unpinned resident weights sit in an
    OrderedDict in last-use order: a pick reads it from the oldest end.
    """

    def __init__(self, order: AccessOrder, budget_bytes: int | None, lookahead: int):
        self.pinned: frozenset[str] = frozenset()
        self._sizes = order.sizes
        self._tick = 0
        self._last_use: dict[str, int] = {}  # pinned weights too: rank() orders them
        self._queue: OrderedDict[str, None] = OrderedDict()  # oldest use first

    def use(self, weight: str, at: int) -> None:
        self._tick += 1
        self._last_use[weight] = self._tick
        if weight not in self.pinned:
            self._queue[weight] = None
            self._queue.move_to_end(weight)

    def remove(self, weight: str) -> None:
        self._queue.pop(weight, None)

    def pick(self, need: int, protected: Container[str]) -> list[str]:
        chosen: list[str] = []
        for w in self._queue:  # protected weights were used recently: few are skipped
            if need <= 0:
                break
            if w not in protected:
                chosen.append(w)
                need -= self._sizes[w]
        return chosen

    def rank(self, weights: Iterable[str], position: int) -> list[str]:
        return sorted(weights, key=self._last_use.__getitem__)


class BeladyEviction:
    """Belady's MIN over the known order: the weight whose next use is furthest.

    Next use is counted cyclically from the issuing position (steps repeat); a
    weight read at that very position is next needed a whole step later. Ties go
    to the smallest name, so the choice is deterministic.

    A resident weight's next use, as an absolute position, changes only when the
    weight is read (every read is a `use`), so it is computed then and pushed on
    a heap; entries left behind by a later use or an eviction are stale and
    skipped when popped. An entry is one int, -next use x weights + the name's
    rank in sorted order: popping the smallest gives the furthest next use, ties
    to the smallest name, and ints cost the garbage collector nothing.
    """

    def __init__(self, order: AccessOrder, budget_bytes: int | None, lookahead: int):
        self.pinned: frozenset[str] = frozenset()
        self._n = len(order)
        self._sizes = order.sizes
        self._uses: dict[str, list[int]] = {}
        for p in range(self._n):
            for w in reads(order, p):
                self._uses.setdefault(w, []).append(p)
        self._names = sorted(order.sizes)
        self._rank = {w: r for r, w in enumerate(self._names)}
        self._key: dict[str, int] = {}  # resident weight -> its live heap entry
        self._heap: list[int] = []

    def next_use(self, weight: str, position: int) -> int:
        """Kernels from `position` until `weight` is read again (1..n)."""
        uses = self._uses[weight]
        k = bisect_right(uses, position)
        return uses[k] - position if k < len(uses) else uses[0] + self._n - position

    def use(self, weight: str, at: int) -> None:
        nxt = at + self.next_use(weight, at % self._n)
        key = -nxt * len(self._names) + self._rank[weight]
        self._key[weight] = key
        heappush(self._heap, key)
        if len(self._heap) > 2 * len(self._key) + 64:  # bound the stale entries
            self._heap = list(self._key.values())
            heapify(self._heap)

    def remove(self, weight: str) -> None:
        self._key.pop(weight, None)

    def pick(self, need: int, protected: Container[str]) -> list[str]:
        chosen: list[str] = []
        held: list[int] = []  # protected now, candidates again at the next pick
        names = self._names
        while need > 0 and self._heap:
            key = heappop(self._heap)
            w = names[key % len(names)]
            if self._key.get(w) != key:
                continue  # stale
            if w in protected:
                held.append(key)
                continue
            del self._key[w]  # a duplicate entry (same key) must not pick it twice
            chosen.append(w)
            need -= self._sizes[w]
        for key in held:
            heappush(self._heap, key)
        return chosen

    def rank(self, weights: Iterable[str], position: int) -> list[str]:
        return sorted(weights, key=lambda w: (-self.next_use(w, position), w))


class PriorityEviction(LruEviction):
    """A fixed resident set kept across steps, the rest streamed (comfy-aimdo's
    watermark, with the set spread through the order: `_priority_set`).

    Pinned weights are fetched on first use and never evicted; streamed
    weights are evicted LRU among themselves.
    """

    def __init__(self, order: AccessOrder, budget_bytes: int | None, lookahead: int):
        super().__init__(order, budget_bytes, lookahead)
        self.pinned = _priority_set(order, budget_bytes, lookahead)


def _priority_set(order: AccessOrder, budget_bytes: int | None, lookahead: int) -> frozenset[str]:
    """The resident set: the anchors (`anchors`), then what the budget leaves beside
    them and the streaming room they need, spread evenly through the access order.

    Why spread: a resident prefix (aimdo's choice) leaves only about the floor
    free while the prefix runs, so the copy engine idles under those kernels,
    and then every later kernel's weights are streamed back to back and the
    tail is copy-bound. Keeping the same fraction f = capacity / bytes of every
    stretch of the order resident means every stretch streams the same share of
    its bytes, so the copy stream has work under every kernel.

    Walk the distinct weights other than the anchors in first-use order and keep
    one when the kept bytes stay at or under f x the bytes walked so far (this one
    included). The kept bytes of every prefix then lie within one weight's size
    under f x the prefix's bytes. The walk can end with up to one weight's size of
    capacity unused, so a second pass fills that room with the first unkept
    weights that fit; that moves any stretch's share by less than one more
    weight's size.
    """
    if budget_bytes is None:  # unlimited: nothing is ever evicted anyway
        return frozenset()
    pinned_first, room = anchors(order, budget_bytes, lookahead)
    capacity = budget_bytes - room - sum(order.sizes[w] for w in pinned_first)
    first_use = [w for w in dict.fromkeys(w for reads in order.reads for w in reads) if w not in pinned_first]
    model = sum(order.sizes[w] for w in first_use)
    pinned: set[str] = set()
    walked = kept = 0
    for w in first_use:
        size = order.sizes[w]
        walked += size
        if (kept + size) * model <= capacity * walked:  # kept + size <= f * walked, exactly
            pinned.add(w)
            kept += size
    for w in first_use:
        if w not in pinned and kept + order.sizes[w] <= capacity:
            pinned.add(w)
            kept += order.sizes[w]
    return frozenset(pinned | pinned_first)


def _weightless(order: AccessOrder, weights: Container[str]) -> AccessOrder:
    """`order` with `weights` weighing nothing: the part a streaming room serves."""
    return AccessOrder(order.kernels, order.reads, {w: 0 if w in weights else s for w, s in order.sizes.items()})


def anchors(order: AccessOrder, budget_bytes: int, lookahead: int) -> tuple[frozenset[str], int]:
    """Weights pinned before the spread, and the streaming room the rest then needs.

    The streamed weights need room for the floor of their own part of the order
    (`floor` with the pinned weights weighing nothing), and every byte of room is a
    byte of the budget not pinned: a step streams the model's bytes less the
    budget's, plus the room. The room is set by the widest pair (and lookahead
    window). Where a few large weights set it (a decoder's embedding and head, read
    one after the other across a step's boundary), pinning one shrinks the room to
    what the rest need. So, while some weight of the widest pair or window (the
    largest such) lowers the room by ANCHOR_GAIN of it or more once pinned, pin it;
    then keep the longest run of these choices whose pinned bytes and room fit the
    budget (one anchor alone may not: a decoder's head leaves the embedding in the
    widest pair). Where like blocks set the room, another pair is as wide: pinning
    one weight lowers nothing, and none is chosen. Where sizes vary weight to weight
    (leaves of many shapes), each pin would lower the room a little and move the
    widest pair on: the gain stops that walk, whose anchors would save a step little
    and cost a pass over the order each.
    """
    n = len(order)
    chosen: set[str] = set()
    kept = 0
    room = floor(order, lookahead).bytes
    best = frozenset(chosen), room
    while kept <= budget_bytes:
        rest = _weightless(order, chosen)
        at = widest_window(rest, 2)[1]
        spots = [at, at + 1]
        if lookahead >= 2:
            at = widest_window(rest, lookahead - 1)[1]
            spots += range(at, at + min(lookahead - 1, n))  # a longer window holds every kernel
        candidates = sorted({w for p in spots for w in order.reads[p % n] if w not in chosen},
                            key=lambda w: (-order.sizes[w], w))
        for w in candidates:
            smaller = floor(_weightless(order, chosen | {w}), lookahead).bytes
            if smaller <= room * (1 - ANCHOR_GAIN):
                chosen.add(w)
                kept += order.sizes[w]
                room = smaller
                if kept + room <= budget_bytes:
                    best = frozenset(chosen), room
                break
        else:
            break
    return best


# In the order a tie between predicted steps goes (the first): priority's decisions repeat
# from step to step, belady's need not.
EVICTIONS: dict[str, Callable[[AccessOrder, int | None, int], Eviction]] = {
    "priority": PriorityEviction,
    "belady": BeladyEviction,
    "lru": LruEviction,
}
