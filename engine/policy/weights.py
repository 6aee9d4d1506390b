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

`pair_bytes` is the hard minimum: under it K_{i-1} ∪ K_i cannot be resident
together and a hazard is certain. `bytes`, the floor, is the advised minimum and
the one execute refuses below: between the two nothing breaks (a demand fetch
evicts prefetched weights, never the pair), but the prefetches run short of the
lookahead and the step stalls on copies.

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
from collections import OrderedDict
from dataclasses import dataclass
from heapq import heapify, heappop, heappush
from statistics import median
from typing import Callable, Container, Iterable, Mapping, Protocol

from engine.errors import BelowFloorError, ConfigError
from engine.policy import AccessOrder, Decision
from engine.units import MB

LIGHT_FRACTION = 0.25  # of the median streamed kernel's bytes: a lighter one does not count toward the lookahead
ANCHOR_GAIN = 1 / 64  # of the streaming room: an anchor must lower it by this much (`anchors`)


def _reads(order: AccessOrder, position: int) -> tuple[str, ...]:
    """K_position without repeats, in read order."""
    return tuple(dict.fromkeys(order.reads[position]))


def _widest_window(order: AccessOrder, length: int) -> tuple[int, int]:
    """(bytes, i) of the first cyclic window K_i ∪ ... ∪ K_{i+length-1} (length >= 1)
    with the most bytes; a weight read by several of its kernels counts once.

    The window slides one kernel at a time, counting how many of its kernels
    read each weight, so the cost is the reads, not the reads x length.
    """
    n, sizes = len(order), order.sizes
    length = min(length, n)  # a longer cyclic window holds every kernel already
    sets = [frozenset(r) for r in order.reads]
    readers: dict[str, int] = {}  # weight -> kernels in the window that read it
    held = 0  # bytes of the window's union

    def enter(p: int) -> None:
        nonlocal held
        for w in sets[p % n]:
            readers[w] = readers.get(w, 0) + 1
            if readers[w] == 1:
                held += sizes[w]

    def leave(p: int) -> None:
        nonlocal held
        for w in sets[p % n]:
            readers[w] -= 1
            if readers[w] == 0:
                held -= sizes[w]

    for p in range(length):
        enter(p)
    best, at = held, 0
    for i in range(1, n):
        leave(i - 1)
        enter(i + length - 1)
        if held > best:  # strict: the first widest window wins
            best, at = held, i
    return best, at


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
    pair_bytes, pair_at = _widest_window(order, 2)  # the first maximal pair names the floor
    # K_{i+2} ∪ ... ∪ K_{i+L} over every i: every window of L - 1 kernels
    headroom = _widest_window(order, lookahead - 1)[0] if lookahead >= 2 else 0
    return Floor(
        bytes=pair_bytes + headroom,
        pair_bytes=pair_bytes,
        headroom_bytes=headroom,
        kernels=(order.kernels[pair_at], order.kernels[(pair_at + 1) % n]),
    )


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
            for w in _reads(order, p):
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
        at = _widest_window(rest, 2)[1]
        spots = [at, at + 1]
        if lookahead >= 2:
            at = _widest_window(rest, lookahead - 1)[1]
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
        self._reads = [_reads(order, p) for p in range(len(order))]
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
    need, biggest = _widest_window(order, 1)
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
