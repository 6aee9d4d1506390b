"""The chunk books of a backend that maps device memory in granules (the vmm backend).

Device memory is a set of physical chunks of one granule, at most the cap's
worth. A block of n bytes takes ceil(n / granule) chunks, any of them, mapped
one after another at the start of a virtual range of its own: no block needs
physical contiguity, so a block the budget allows is never refused.

Mapping and unmapping cost host time per granule (the record mode's probe
measures them), so the books move as few granules as they can. Every range
reserves address space for the largest block (`extent`, from `grow`); a freed
range keeps its chunks mapped, and a new block takes the free range whose
mapped size is nearest its own, then maps chunks onto its end or unmaps its
tail to fit: a block of a freed size costs no driver call at all, and a
transformer streams the same few sizes block after block. Chunks come from
trimmed tails, then new ones under the cap, then the tails of the oldest free
ranges. A tail is unmapped once the copy stream has passed the range's free
(`freed`); taken sooner, it stays mapped (stale; nothing reads it) until the
range is wanted again after that.

Stream order is the caller's: a chunk may be written by its next block as
soon as it is freed, because the backend orders every write after the free's
last reader (the copy stream waits for it). Both drivers keep these books:
the vmm backend with the CUDA driver, the simulator with a driver that counts,
so the granules it charges for are the executor's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.errors import ExecutorError


class Event(Protocol):
    def query(self) -> bool: ...


class Driver(Protocol):
    """The calls the books make (the CUDA driver's VMM calls, or a counter)."""

    granule: int

    def reserve(self, nbytes: int) -> int: ...
    def free_range(self, address: int, nbytes: int) -> None: ...
    def create(self) -> Any: ...  # one chunk of `granule` bytes
    def release(self, chunk: Any) -> None: ...
    def map(self, address: int, chunk: Any) -> None: ...
    def set_access(self, address: int, nbytes: int) -> None: ...
    def unmap(self, address: int) -> None: ...  # the granule mapped at `address`


@dataclass(eq=False)
class _Range:
    address: int
    extent: int  # address space reserved for it
    chunks: list = field(default_factory=list)  # owned, mapped at address + i * granule
    stale: int = 0  # granules mapped after them whose chunks were taken before the free passed
    freed: Event | None = None  # the copy stream passed the free

    def ready(self) -> bool:
        return self.freed is None or self.freed.query()


@dataclass
class ChunkBooks:
    """Chunks, the ranges that map them, and counts of the driver calls made.

    `cap_bytes` caps the chunks ever created; `reserve_bytes` is the address
    space reserved at a time (more when a range needs it)."""

    driver: Driver
    cap_bytes: int
    reserve_bytes: int
    chunks: list = field(default_factory=list)  # every chunk created, released at close
    loose: list = field(default_factory=list)  # chunks no range owns
    maps: int = 0  # granules mapped
    unmaps: int = 0  # granules unmapped
    reused: int = 0  # blocks placed in a free range of their size: no driver call

    def __post_init__(self) -> None:
        self.granule = self.driver.granule
        self.extent = self.granule
        self._live: dict[int, _Range] = {}
        self._free: dict[int, _Range] = {}  # address -> free range, oldest free first
        self._reserved: list[tuple[int, int]] = []
        self._cursor = self._end = 0  # the unused rest of the newest reservation

    @property
    def live_bytes(self) -> int:
        return sum(len(r.chunks) for r in self._live.values()) * self.granule

    def grow(self, nbytes: int, largest: int = 0) -> None:
        """Create chunks until `nbytes` of them exist (at most the cap); new ranges
        reserve room for a block of `largest` bytes."""
        self.extent = max(self.extent, self._round(largest))
        while (len(self.chunks) + 1) * self.granule <= min(nbytes, self.cap_bytes):
            self._create()

    def place(self, nbytes: int) -> int:
        """A range holding `nbytes` in whole granules, mapped; its address."""
        size = self._round(nbytes)
        need = size // self.granule
        r = self._nearest(need, size)
        if r is None:
            r = self._new_range(size)
        else:
            del self._free[r.address]
            self._unmap_tail(r, r.stale, len(r.chunks))
            r.stale, r.freed = 0, None
        have = len(r.chunks)
        if have == need:
            self.reused += 1
        elif have > need:
            self._unmap_tail(r, have - need, need)
            self.loose.extend(r.chunks[need:])
            del r.chunks[need:]
        else:
            self._map_tail(r, self._take(need - have, nbytes))
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
        self._free[address] = r

    def close(self) -> None:
        """Unmap every range, release every chunk and the address space."""
        for r in list(self._live.values()) + list(self._free.values()):
            self._unmap_tail(r, len(r.chunks) + r.stale, 0)
        self._live.clear()
        self._free.clear()
        for chunk in self.chunks:
            self.driver.release(chunk)
        self.chunks.clear()
        self.loose.clear()
        for address, nbytes in self._reserved:
            self.driver.free_range(address, nbytes)
        self._reserved.clear()
        self._cursor = self._end = 0

    def _round(self, nbytes: int) -> int:
        return -(-nbytes // self.granule) * self.granule

    def _create(self) -> None:
        chunk = self.driver.create()
        self.chunks.append(chunk)
        self.loose.append(chunk)

    def _nearest(self, need: int, size: int) -> _Range | None:
        """The free range that maps and unmaps the fewest granules to hold `need`. A
        range whose free the copy stream has not passed may still be read: it can
        take more chunks, or serve as it is, but nothing of it may be unmapped yet."""
        best, cost = None, None
        for r in self._free.values():
            if r.extent < size or ((r.stale or len(r.chunks) > need) and not r.ready()):
                continue
            c = abs(len(r.chunks) - need) + r.stale
            if cost is None or c < cost:
                best, cost = r, c
                if c == 0:
                    break
        return best

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

    def _take(self, need: int, nbytes: int) -> list:
        """`need` chunks: loose ones, new ones under the cap, then the oldest free ranges' tails."""
        while len(self.loose) < need and (len(self.chunks) + 1) * self.granule <= self.cap_bytes:
            self._create()
        for r in list(self._free.values()):
            if len(self.loose) >= need:
                break
            k = min(len(r.chunks), need - len(self.loose))
            if k == 0:
                continue
            keep = len(r.chunks) - k
            if r.ready():
                self._unmap_tail(r, k + r.stale, keep)
                r.stale = 0
            else:
                r.stale += k  # still mapped after the chunks it keeps, unmapped once the free passed
            self.loose.extend(r.chunks[keep:])
            del r.chunks[keep:]
        if len(self.loose) < need:
            raise ExecutorError(
                f"vmm backend: {nbytes} bytes need {need} more chunks but only {len(self.loose)} of the cap's "
                f"{self.cap_bytes // self.granule} are free; the executor allocated past its budget (a bug "
                "in the runtime)")
        out = self.loose[-need:]
        del self.loose[-need:]
        return out

    def _map_tail(self, r: _Range, chunks: list) -> None:
        start = len(r.chunks)
        try:
            for i, chunk in enumerate(chunks):
                self.driver.map(r.address + (start + i) * self.granule, chunk)
                r.chunks.append(chunk)
                self.maps += 1
            self.driver.set_access(r.address + start * self.granule, len(chunks) * self.granule)
        except BaseException:
            mapped = len(r.chunks) - start
            self._unmap_tail(r, mapped, start)  # nothing of this block stays mapped
            del r.chunks[start:]
            self.loose.extend(chunks)
            self._free[r.address] = r  # the range, as it was, serves a later block
            raise

    def _unmap_tail(self, r: _Range, count: int, start: int) -> None:
        """Unmap `count` granules of `r` from granule `start` on."""
        for i in range(start, start + count):
            self.driver.unmap(r.address + i * self.granule)
        self.unmaps += count


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

    def create(self) -> int:
        self._next += 1
        return self._next

    def release(self, chunk: Any) -> None:
        pass

    def map(self, address: int, chunk: Any) -> None:
        pass

    def set_access(self, address: int, nbytes: int) -> None:
        pass

    def unmap(self, address: int) -> None:
        pass
