"""The chunk books of a backend that maps device memory in granules (the vmm backend).

Device memory is a set of physical chunks of one granule, at most the cap's
worth. A block of n bytes takes ceil(n / granule) chunks, any of them, mapped
one after another into a virtual range of its own: no block needs physical
contiguity, so a block the budget allows is never refused.

Mapping costs host time (the record mode's probe measures it), so the books
map as little as they can. A freed range keeps its chunks mapped, and the
next block of the same size takes the whole range as it is: no driver call
at all. A transformer streams the same few sizes block after block, so in
the steady state nearly every block is such a reuse. A block of a size with
no free range takes loose chunks, creates new ones under the cap, and last
takes the chunks of the oldest free ranges of other sizes: that range's
addresses stay mapped (nothing reads them any more) until a range of its size
is wanted again and the copy stream has passed the free (`freed`), when they
are unmapped and mapped afresh. Address space is reserved as needed.

Stream order is the caller's: a chunk may be written by its next block as
soon as it is freed, because the backend orders every write after the free's
last reader (the copy stream waits for it). Both drivers keep these books:
the vmm backend with the CUDA driver, the simulator with a driver that counts,
so the map and unmap calls it charges are the executor's.
"""
from __future__ import annotations

from collections import deque
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


@dataclass
class _Range:
    address: int
    nbytes: int  # whole granules
    chunks: list  # mapped at address + i * granule, in order
    owned: bool = True  # False: its chunks were taken; the mapping is stale
    freed: Event | None = None  # the copy stream passed the free


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
        self._live: dict[int, _Range] = {}
        self._free: dict[int, _Range] = {}  # address -> range owning its chunks, oldest first
        self._free_by_size: dict[int, dict[int, _Range]] = {}
        self._stale: dict[int, deque[_Range]] = {}  # nbytes -> ranges whose chunks were taken
        self._reserved: list[tuple[int, int]] = []
        self._cursor = self._end = 0  # the unused rest of the newest reservation

    @property
    def live_bytes(self) -> int:
        return sum(r.nbytes for r in self._live.values())

    def grow(self, nbytes: int) -> None:
        """Create chunks until `nbytes` of them exist (at most the cap)."""
        while (len(self.chunks) + 1) * self.granule <= min(nbytes, self.cap_bytes):
            self._create()

    def place(self, nbytes: int) -> int:
        """A range of whole granules holding `nbytes`, mapped; its address."""
        size = -(-nbytes // self.granule) * self.granule
        same = self._free_by_size.get(size)
        if same:
            address, r = same.popitem()
            del self._free[address]
            self._live[address] = r
            self.reused += 1
            return address
        chunks = self._take(size // self.granule, nbytes)
        r = self._range(size)
        try:
            for i, chunk in enumerate(chunks):
                self.driver.map(r.address + i * self.granule, chunk)
                r.chunks.append(chunk)
                self.maps += 1
            self.driver.set_access(r.address, size)
        except BaseException:
            self._unmap(r)  # nothing of this range stays mapped
            self.loose.extend(chunks)
            self._stale.setdefault(size, deque()).appendleft(r)
            raise
        self._live[r.address] = r
        return r.address

    def free(self, address: int, freed: Event) -> None:
        """The block at `address` is free once `freed` completes; its range, still
        mapped, serves the next block of its size."""
        r = self._live.pop(address, None)
        if r is None:
            raise ExecutorError(f"vmm backend: block {address:#x} freed twice or never allocated "
                                "(a bug in the runtime; nothing was freed)")
        r.freed = freed
        self._free[address] = r
        self._free_by_size.setdefault(r.nbytes, {})[address] = r

    def close(self) -> None:
        """Unmap every range, release every chunk and the address space."""
        ranges = list(self._live.values()) + list(self._free.values())
        for r in ranges + [r for q in self._stale.values() for r in q]:
            self._unmap(r)
        self._live.clear()
        self._free.clear()
        self._free_by_size.clear()
        self._stale.clear()
        for chunk in self.chunks:
            self.driver.release(chunk)
        self.chunks.clear()
        self.loose.clear()
        for address, nbytes in self._reserved:
            self.driver.free_range(address, nbytes)
        self._reserved.clear()
        self._cursor = self._end = 0

    def _create(self) -> None:
        chunk = self.driver.create()
        self.chunks.append(chunk)
        self.loose.append(chunk)

    def _take(self, need: int, nbytes: int) -> list:
        """`need` chunks: loose ones, new ones under the cap, then the oldest free ranges'."""
        while len(self.loose) < need and (len(self.chunks) + 1) * self.granule <= self.cap_bytes:
            self._create()
        while len(self.loose) < need and self._free:
            address = next(iter(self._free))
            r = self._free.pop(address)
            del self._free_by_size[r.nbytes][address]
            self.loose.extend(r.chunks)
            r.owned = False
            self._stale.setdefault(r.nbytes, deque()).append(r)
        if len(self.loose) < need:
            raise ExecutorError(
                f"vmm backend: {nbytes} bytes need {need} chunks but only {len(self.loose)} of the cap's "
                f"{self.cap_bytes // self.granule} are free; the executor allocated past its budget (a bug "
                "in the runtime)")
        out = self.loose[-need:]
        del self.loose[-need:]
        return out

    def _range(self, size: int) -> _Range:
        """An unmapped range of `size` bytes: a stale one the copy stream is done with, else a new one."""
        q = self._stale.get(size)
        if q and (q[0].freed is None or q[0].freed.query()):
            r = q.popleft()
            self._unmap(r)
            r.owned, r.freed = True, None
            return r
        if self._end - self._cursor < size:
            nbytes = max(size, self.reserve_bytes)
            address = self.driver.reserve(nbytes)
            self._reserved.append((address, nbytes))
            self._cursor, self._end = address, address + nbytes
        r = _Range(self._cursor, size, [])
        self._cursor += size
        return r

    def _unmap(self, r: _Range) -> None:
        for i in range(len(r.chunks)):
            self.driver.unmap(r.address + i * self.granule)
            self.unmaps += 1
        r.chunks = []


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
