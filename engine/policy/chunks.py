"""The chunk books of a backend that maps device memory in granules (the vmm backend).

Device memory is a set of physical chunks, at most the cap's worth. A block
of n bytes takes ceil(n / granule) granules, mapped one chunk after another
at the start of a virtual range of its own: no block needs physical
contiguity, so a block the budget allows is never refused.

Chunks come in sizes of 16, 8, 4, 2 and 1 granules (CLASSES), and a block is
made of the fewest that add up to it, largest first: each chunk is one driver
call to map and one to unmap, and a call costs about the same whatever its
size (the record mode's probe measures it), so a 100 MiB block on a 2 MiB
granule takes 5 calls instead of 50. Chunks of a size the books lack are
made from unmapped chunks of another size (released, created again).

The books also move as few chunks as they can. Every range reserves address
space for the largest block (`grow`); a freed range keeps its chunks mapped,
and a new block takes the free range whose chunks need the fewest calls to
become its own: it keeps the longest run of chunks its own layout starts
with and unmaps the rest. A block of a freed size costs no call at all, and a
transformer streams the same few sizes block after block. A chunk is unmapped
only once its range's free has passed (`freed`: the block's last reader ran, or,
never read, its copy landed): a range still read may be reused only as it is or
grown. A chunk taken from a free range still read stays mapped there too
(stale: nothing reads it there any more) and is unmapped from it once the free
has passed. A chunk with a stale mapping is never released (its memory would
outlive the release).

A chunk size the books lack is created in a slack beyond the cap
(`conversion_slack`: two of the largest block) before anything else: converting
chunks of other sizes costs a release and a create each, and taking a free
range's chunks unmaps what a later block of that range's layout would have
reused as it is. The slack's chunks stay (the chunks held exceed the cap by at
most the slack; live blocks never do). Only past the slack are clean loose
chunks converted, free ranges' chunks taken, and, when every chunk left is
still read, the host waits for a free.

Stream order is the caller's: a chunk may be written by its next block as
soon as it is freed, because the backend orders every write after the free's
last reader (the copy stream waits for it). Both drivers keep these books:
the vmm backend with the CUDA driver, the simulator with a driver that counts,
so the calls it charges for are the executor's.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.errors import ExecutorError

CLASSES = (16, 8, 4, 2, 1)  # chunk sizes, in granules, largest first
SLACK_LARGEST = 2  # the conversion slack, in units of the largest block


def conversion_slack(largest_block_bytes: int, granule: int) -> int:
    """Bytes of chunks the books may hold beyond the cap, where a chunk size they lack
    is created (module docstring), in whole granules."""
    return SLACK_LARGEST * (-(-largest_block_bytes // granule) * granule)


class Event(Protocol):
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class Driver(Protocol):
    """The calls the books make (the CUDA driver's VMM calls, or a counter)."""

    granule: int

    def reserve(self, nbytes: int) -> int: ...
    def free_range(self, address: int, nbytes: int) -> None: ...
    def create(self, nbytes: int) -> Any: ...  # one chunk
    def release(self, chunk: Any) -> None: ...
    def map(self, address: int, chunk: Any, nbytes: int) -> None: ...
    def set_access(self, address: int, nbytes: int) -> None: ...
    def unmap(self, address: int, nbytes: int) -> None: ...


def layout(granules: int) -> list[int]:
    """The chunk sizes (granules) of a block of `granules`: the fewest, largest first."""
    out = []
    for c in CLASSES:
        out += [c] * (granules // c)
        granules %= c
    return out


@dataclass(eq=False)
class _Range:
    address: int
    extent: int  # address space reserved for it
    chunks: list = field(default_factory=list)  # (chunk, granules), mapped in order from `address`
    freed: Event | None = None  # passes once the freed block's last reader ran (never read: its copy landed)
    stale: list = field(default_factory=list)  # (chunk, granules, offset, freed) taken while still read

    def ready(self) -> bool:
        return self.freed is None or self.freed.query()


@dataclass
class ChunkBooks:
    """Chunks, the ranges that map them, and counts of the driver calls made.

    `cap_bytes` caps the live blocks' chunks; the chunks held may exceed it by
    `slack_bytes`; `reserve_bytes` is the address space reserved at a time (more
    when a range needs it)."""

    driver: Driver
    cap_bytes: int
    reserve_bytes: int
    slack_bytes: int = 0
    maps: int = 0  # map calls (one a chunk)
    unmaps: int = 0
    creates: int = 0
    releases: int = 0
    waits: int = 0  # times the host waited for a free to pass before unmapping its range
    reused: int = 0  # blocks placed in a free range as it was: no call at all

    def __post_init__(self) -> None:
        self.granule = self.driver.granule
        self.extent = self.granule
        self.held = 0  # granules in chunks created and not released
        self.peak_held = 0
        self._loose: dict[int, list] = {c: [] for c in CLASSES}  # unmapped chunks by size
        self._live: dict[int, _Range] = {}
        self._free: dict[int, _Range] = {}  # address -> free range, oldest free first
        self._by_layout: dict[tuple, dict[int, _Range]] = {}  # chunk sizes -> free ranges of that layout
        self._dirty: dict[Any, int] = {}  # chunk -> its stale mappings
        self._staled: deque[_Range] = deque()  # ranges with stale mappings, in the order they got them
        self._reserved: list[tuple[int, int]] = []
        self._cursor = self._end = 0  # the unused rest of the newest reservation

    @property
    def live_bytes(self) -> int:
        return sum(g for r in self._live.values() for _, g in r.chunks) * self.granule

    def grow(self, sizes: list[int]) -> None:
        """Create the chunks of blocks of `sizes` (bytes), in turn and over again, until
        the cap is held, so the chunks' sizes are the blocks' mix; new ranges reserve
        room for the largest."""
        if not sizes:
            return
        self.extent = max(self.extent, self._round(max(sizes)))
        cap = self.cap_bytes // self.granule
        units = [c for n in sizes for c in layout(self._round(n) // self.granule)]
        while True:
            for c in units:
                if self.held + c > cap:
                    return
                self._create(c)

    def place(self, nbytes: int) -> int:
        """A range holding `nbytes` in whole granules, mapped; its address."""
        size = self._round(nbytes)
        want = layout(size // self.granule)
        self._sweep()
        r, keep = self._nearest(want, size)
        if r is None:
            r, keep = self._new_range(size), 0
        else:
            self._unfree(r)
            r.freed = None
            if len(want) > keep:
                self._unstale(r, wait=True)  # chunks will be mapped where stale ones may sit
        if keep == len(r.chunks) == len(want):
            self.reused += 1
        self._unmap_from(r, keep)
        try:
            self._map_tail(r, want[keep:])
        except BaseException:
            self._refree(r)  # as far as it got: it serves a later block
            raise
        self._live[r.address] = r
        return r.address

    def free(self, address: int, freed: Event) -> None:
        """The block at `address` is free once `freed` completes; its range, still
        mapped, serves a later block."""
        r = self._live.pop(address, None)
        if r is None:
            raise ExecutorError(f"vmm backend: block {address:#x} freed twice or never allocated "
                                "(a bug in the runtime; nothing was freed)")
        r.freed = freed
        self._refree(r)

    def close(self) -> None:
        """Unmap every range, release every chunk and the address space."""
        for r in list(self._live.values()) + list(self._free.values()):
            self._unmap_from(r, 0)
            self._unstale(r, wait=True)
        self._staled.clear()
        self._live.clear()
        self._free.clear()
        self._by_layout.clear()
        for c, chunks in self._loose.items():
            for chunk in chunks:
                self.driver.release(chunk)
            self.held -= c * len(chunks)
            chunks.clear()
        for address, nbytes in self._reserved:
            self.driver.free_range(address, nbytes)
        self._reserved.clear()
        self._cursor = self._end = 0

    def _round(self, nbytes: int) -> int:
        return -(-nbytes // self.granule) * self.granule

    def _create(self, c: int) -> None:
        self._loose[c].append(self.driver.create(c * self.granule))
        self.creates += 1
        self.held += c
        self.peak_held = max(self.peak_held, self.held)

    def _refree(self, r: _Range) -> None:
        self._free[r.address] = r
        self._by_layout.setdefault(tuple(g for _, g in r.chunks), {})[r.address] = r

    def _unfree(self, r: _Range) -> None:
        del self._free[r.address]
        del self._by_layout[tuple(g for _, g in r.chunks)][r.address]

    def _nearest(self, want: list[int], size: int) -> tuple[_Range | None, int]:
        """The free range that takes the fewest calls to become `want`, and how many
        of its chunks it keeps. A range whose free the copy stream has not passed
        may still be read: it qualifies only if it keeps every chunk it has."""
        same = self._by_layout.get(tuple(want))
        if same:
            for r in same.values():
                if r.extent >= size:
                    return r, len(want)
        best, best_keep, best_cost = None, 0, None
        for r in self._free.values():
            if r.extent < size:
                continue
            keep = 0
            for (_, g), w in zip(r.chunks, want):
                if g != w:
                    break
                keep += 1
            if keep < len(r.chunks) and not r.ready():
                continue
            if r.stale and len(want) > keep and not self._unstale(r, wait=False):
                continue
            cost = (len(r.chunks) - keep) + (len(want) - keep)
            if best_cost is None or cost < best_cost:
                best, best_keep, best_cost = r, keep, cost
                if cost == 0:
                    break
        return best, best_keep

    def _new_range(self, size: int) -> _Range:
        extent = max(size, self.extent)
        if self._end - self._cursor < extent:
            nbytes = max(extent, self.reserve_bytes)
            address = self.driver.reserve(nbytes)
            self._reserved.append((address, nbytes))
            self._cursor, self._end = address, address + nbytes
        r = _Range(self._cursor, extent)
        self._cursor += extent
        return r

    def _take(self, c: int) -> Any:
        """A chunk of `c` granules: a loose one, a new one within the cap and its
        slack, one made from clean loose chunks of other sizes, or a free range's
        last chunk."""
        limit = (self.cap_bytes + self.slack_bytes) // self.granule
        while True:
            if self._loose[c]:
                return self._loose[c].pop()
            if self.held + c <= limit:
                self._create(c)
                continue
            clean = sum(k for k, v in self._loose.items() for chunk in v if chunk not in self._dirty)
            if self.held - clean + c <= limit:
                self._release_loose(c, limit)
                continue
            r = self._victim(c)
            if r is None:
                if self._staled:  # every chunk left has a stale mapping: wait for the oldest free
                    self._unstale(self._staled.popleft(), wait=True)
                    continue
                raise ExecutorError(
                    f"vmm backend: a chunk of {c * self.granule} bytes does not fit: {self.held * self.granule} "
                    f"bytes of the cap's {self.cap_bytes} are held by live blocks; the executor allocated past "
                    "its budget (a bug in the runtime)")
            self._unfree(r)
            chunk, k = r.chunks[-1]
            if r.ready():
                self._unmap_from(r, len(r.chunks) - 1)  # its last chunk comes loose
            else:  # still read: the chunk stays mapped there until the free passed
                r.chunks.pop()
                offset = sum(g for _, g in r.chunks) * self.granule
                r.stale.append((chunk, k, offset, r.freed))
                self._dirty[chunk] = self._dirty.get(chunk, 0) + 1
                self._staled.append(r)
                self._loose[k].append(chunk)
            self._refree(r)

    def _victim(self, c: int) -> _Range | None:
        """The free range to take a chunk from: the oldest whose free has passed and
        whose last chunk is of size `c`, else the oldest passed, else the oldest."""
        passed = oldest = None
        for r in self._free.values():
            if not r.chunks:
                continue
            if oldest is None:
                oldest = r
            if r.ready():
                if r.chunks[-1][1] == c:
                    return r
                passed = passed or r
        return passed or oldest

    def _sweep(self) -> None:
        """Unmap the stale mappings whose frees have passed, oldest first."""
        while self._staled and self._unstale(self._staled[0], wait=False):
            self._staled.popleft()

    def _unstale(self, r: _Range, wait: bool) -> bool:
        """Unmap `r`'s stale mappings whose frees have passed (`wait`: all, waiting
        for the frees); whether none is left."""
        left = []
        for chunk, k, offset, freed in r.stale:
            if not freed.query():
                if not wait:
                    left.append((chunk, k, offset, freed))
                    continue
                freed.synchronize()
                self.waits += 1
            self.driver.unmap(r.address + offset, k * self.granule)
            self.unmaps += 1
            self._dirty[chunk] -= 1
            if not self._dirty[chunk]:
                del self._dirty[chunk]
        r.stale = left
        return not left

    def _release_loose(self, c: int, limit: int) -> None:
        """Release clean loose chunks of other sizes, smallest first, until `c` granules more fit `limit`."""
        for k in reversed(CLASSES):
            if k == c:
                continue
            keep = []
            while self._loose[k] and self.held + c > limit:
                chunk = self._loose[k].pop()
                if chunk in self._dirty:
                    keep.append(chunk)
                    continue
                self.driver.release(chunk)
                self.releases += 1
                self.held -= k
            self._loose[k].extend(keep)

    def _map_tail(self, r: _Range, sizes: list[int]) -> None:
        if not sizes:
            return
        kept = len(r.chunks)
        start = offset = sum(g for _, g in r.chunks) * self.granule
        try:
            for c in sizes:
                chunk = self._take(c)
                try:
                    self.driver.map(r.address + offset, chunk, c * self.granule)
                except BaseException:
                    self._loose[c].append(chunk)
                    raise
                r.chunks.append((chunk, c))
                self.maps += 1
                offset += c * self.granule
            self.driver.set_access(r.address + start, offset - start)
        except BaseException:
            self._unmap_from(r, kept)  # nothing of this block stays mapped
            raise

    def _unmap_from(self, r: _Range, keep: int) -> None:
        """Unmap `r`'s chunks after its first `keep`; they come loose."""
        offset = sum(g for _, g in r.chunks[:keep]) * self.granule
        for chunk, c in r.chunks[keep:]:
            self.driver.unmap(r.address + offset, c * self.granule)
            self._loose[c].append(chunk)
            self.unmaps += 1
            offset += c * self.granule
        del r.chunks[keep:]


class CountingDriver:
    """A driver that only hands out addresses and chunks: the simulator's, which
    charges the map and unmap calls the books count."""

    def __init__(self, granule: int):
        self.granule = granule
        self._next = 0

    def reserve(self, nbytes: int) -> int:
        address = self._next
        self._next += nbytes
        return address

    def free_range(self, address: int, nbytes: int) -> None:
        pass

    def create(self, nbytes: int) -> int:
        self._next += 1
        return self._next

    def release(self, chunk: Any) -> None:
        pass

    def map(self, address: int, chunk: Any, nbytes: int) -> None:
        pass

    def set_access(self, address: int, nbytes: int) -> None:
        pass

    def unmap(self, address: int, nbytes: int) -> None:
        pass
