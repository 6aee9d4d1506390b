"""The chunk books of a backend that maps device memory in granules (the vmm backend).

Device memory is a few large physical chunks, at most the cap's worth,
created once and never released before the end. A block of n bytes takes
ceil(n / granule) granules: one or more pieces (runs of granules inside a
chunk) mapped one after another at the start of a virtual range of its own.
No block needs physical contiguity, so a block the cap allows is never
refused, and no free ever waits.

Each piece is one driver call to map and one to unmap, and a call costs about
the same whatever its size (the record mode's probe measures it), so the
books move as few pieces as they can:

- a freed range keeps its pieces mapped, and a block of the same number of
  granules takes it as it is: no call at all (a transformer streams the same
  few sizes block after block);
- otherwise the block gets an empty range and the fewest loose pieces that
  add up to it (the smallest loose run that holds it, split; else the
  largest runs); adjacent loose pieces merge;
- when too few granules are loose, the oldest free ranges give up their
  pieces. A range whose free the copy stream has passed is unmapped then; one
  still read keeps its mappings (stale: nothing reads them any more) until its
  free has passed, and its address space is not reused before.

The same physical piece may be mapped at a stale range and at its new block's
range at once: writes to it are the new block's copy, which the backend
orders after the free's last reader (the copy stream waits for it). Both
drivers keep these books: the vmm backend with the CUDA driver, the simulator
with a driver that counts, so the calls it charges for are the executor's.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.errors import ExecutorError

CHUNK_BYTES = 1 << 30  # physical chunks are created this large (the last one up to the cap)


class Event(Protocol):
    def query(self) -> bool: ...


class Driver(Protocol):
    """The calls the books make (the CUDA driver's VMM calls, or a counter)."""

    granule: int

    def reserve(self, nbytes: int) -> int: ...
    def free_range(self, address: int, nbytes: int) -> None: ...
    def create(self, nbytes: int) -> Any: ...  # one chunk
    def release(self, chunk: Any) -> None: ...
    def map(self, address: int, chunk: Any, offset: int, nbytes: int) -> None: ...  # bytes of the chunk from offset
    def set_access(self, address: int, nbytes: int) -> None: ...
    def unmap(self, address: int, nbytes: int) -> None: ...


Piece = tuple[int, int, int]  # (chunk index, first granule, granules)


@dataclass(eq=False)
class _Range:
    address: int
    extent: int  # address space reserved for it
    pieces: list[Piece] = field(default_factory=list)  # mapped in order from `address`
    freed: Event | None = None  # the copy stream passed the free

    @property
    def granules(self) -> int:
        return sum(p[2] for p in self.pieces)


@dataclass
class ChunkBooks:
    """Chunks, the ranges that map their pieces, and counts of the driver calls made.

    `cap_bytes` caps the chunks held; `reserve_bytes` is the address space
    reserved at a time (more when a range needs it)."""

    driver: Driver
    cap_bytes: int
    reserve_bytes: int
    maps: int = 0  # map calls (one a piece)
    unmaps: int = 0
    creates: int = 0
    releases: int = 0
    reused: int = 0  # blocks placed in a free range as it was: no call at all

    def __post_init__(self) -> None:
        self.granule = self.driver.granule
        self.cap = self.cap_bytes // self.granule  # granules
        self.extent = self.granule
        self.held = 0  # granules in chunks created
        self.peak_held = 0
        self._chunks: list[Any] = []
        self._loose: dict[tuple[int, int], int] = {}  # (chunk, first granule) -> granules, unmapped by any block
        self._loose_ends: dict[tuple[int, int], int] = {}  # (chunk, granule after the run) -> its first granule
        self.loose = 0  # granules loose
        self._live: dict[int, _Range] = {}
        self._free: dict[int, _Range] = {}  # address -> free range, oldest free first
        self._by_size: dict[int, dict[int, _Range]] = {}  # granules -> free ranges of that many
        self._empty: list[_Range] = []  # ranges with nothing mapped
        self._stale: deque[_Range] = deque()  # ranges whose pieces moved on before their free passed
        self._reserved: list[tuple[int, int]] = []
        self._cursor = self._end = 0  # the unused rest of the newest reservation

    @property
    def live_bytes(self) -> int:
        return sum(r.granules for r in self._live.values()) * self.granule

    def grow(self, sizes: list[int]) -> None:
        """Create chunks for blocks of `sizes` (bytes) up to the cap; new ranges reserve room
        for the largest."""
        if not sizes:
            return
        self.extent = max(self.extent, self._round(max(sizes)))
        self._create_up_to(min(self.cap, sum(self._round(n) for n in sizes) // self.granule))

    def place(self, nbytes: int) -> int:
        """A range holding `nbytes` in whole granules, mapped; its address."""
        size = self._round(nbytes)
        n = size // self.granule
        self._sweep()
        same = self._by_size.get(n)
        if same:
            r = next(iter(same.values()))
            self._unfree(r)
            r.freed = None
            self.reused += 1
        else:
            pieces = self._take(n)
            r = self._empty_range(size)
            try:
                self._map(r, pieces)
            except BaseException:
                for p in pieces:
                    self._loosen(p)
                self._empty.append(r)
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
        self._free[r.address] = r
        self._by_size.setdefault(r.granules, {})[r.address] = r

    def close(self) -> None:
        """Unmap every range, release every chunk and the address space (nothing may
        still read them)."""
        for r in [*self._live.values(), *self._free.values(), *self._stale]:
            self._unmap(r)
        self._live.clear()
        self._free.clear()
        self._by_size.clear()
        self._stale.clear()
        self._empty.clear()
        for chunk in self._chunks:
            self.driver.release(chunk)
            self.releases += 1
        self._chunks.clear()
        self._loose.clear()
        self._loose_ends.clear()
        self.held = self.loose = 0
        for address, nbytes in self._reserved:
            self.driver.free_range(address, nbytes)
        self._reserved.clear()
        self._cursor = self._end = 0

    def _round(self, nbytes: int) -> int:
        return -(-nbytes // self.granule) * self.granule

    def _create_up_to(self, granules: int) -> None:
        per_chunk = max(1, CHUNK_BYTES // self.granule)
        while self.held < granules:
            n = min(per_chunk, self.cap - self.held)
            self._chunks.append(self.driver.create(n * self.granule))
            self.creates += 1
            self.held += n
            self.peak_held = max(self.peak_held, self.held)
            self._loosen((len(self._chunks) - 1, 0, n))

    def _unfree(self, r: _Range) -> None:
        del self._free[r.address]
        same = self._by_size[r.granules]
        del same[r.address]
        if not same:
            del self._by_size[r.granules]

    def _take(self, n: int) -> list[Piece]:
        """The fewest loose pieces adding up to `n` granules, made loose first by
        creating chunks under the cap or by taking the oldest free ranges' pieces."""
        while self.loose < n:
            if self.held < self.cap:
                self._create_up_to(self.held + 1)  # one more chunk
                continue
            if not self._free:
                raise ExecutorError(
                    f"vmm backend: a block of {n * self.granule} bytes does not fit: "
                    f"{(self.held - self.loose) * self.granule} bytes of the cap's {self.cap_bytes} are held by "
                    "live blocks; the executor allocated past its budget (a bug in the runtime)")
            r = next(iter(self._free.values()))
            self._unfree(r)
            self._release_range(r)
        fit = None
        for key, m in self._loose.items():
            if m >= n and (fit is None or m < fit[1]):
                fit = key, m
                if m == n:
                    break
        if fit is not None:
            return [self._unloose(fit[0], n)]
        pieces = []
        for key, m in sorted(self._loose.items(), key=lambda kv: -kv[1]):
            pieces.append(self._unloose(key, min(m, n)))
            n -= pieces[-1][2]
            if not n:
                return pieces
        raise AssertionError("loose granules miscounted")  # self.loose >= n above

    def _release_range(self, r: _Range) -> None:
        """A free range's pieces come loose: unmapped now if its free has passed, else
        later (`_sweep`), its address space unused until then."""
        for p in r.pieces:
            self._loosen(p)
        if r.freed is None or r.freed.query():
            self._unmap(r)
            self._empty.append(r)
        else:
            self._stale.append(r)

    def _sweep(self) -> None:
        """Unmap the stale ranges whose frees have passed, oldest first."""
        while self._stale and self._stale[0].freed.query():
            r = self._stale.popleft()
            self._unmap(r)
            self._empty.append(r)

    def _empty_range(self, size: int) -> _Range:
        for i in range(len(self._empty) - 1, -1, -1):
            if self._empty[i].extent >= size:
                return self._empty.pop(i)
        extent = max(size, self.extent)
        if self._end - self._cursor < extent:
            nbytes = max(extent, self.reserve_bytes)
            address = self.driver.reserve(nbytes)
            self._reserved.append((address, nbytes))
            self._cursor, self._end = address, address + nbytes
        r = _Range(self._cursor, extent)
        self._cursor += extent
        return r

    def _map(self, r: _Range, pieces: list[Piece]) -> None:
        g = self.granule
        offset = 0
        try:
            for p in pieces:
                chunk, first, n = p
                self.driver.map(r.address + offset, self._chunks[chunk], first * g, n * g)
                r.pieces.append(p)
                self.maps += 1
                offset += n * g
            self.driver.set_access(r.address, offset)
        except BaseException:
            self._unmap(r)  # nothing of this block stays mapped
            raise

    def _unmap(self, r: _Range) -> None:
        offset = 0
        for _, _, n in r.pieces:
            self.driver.unmap(r.address + offset, n * self.granule)
            self.unmaps += 1
            offset += n * self.granule
        r.pieces = []
        r.freed = None

    def _loosen(self, p: Piece) -> None:
        """`p` is loose: merged with the loose runs either side of it in its chunk."""
        chunk, first, n = p
        before = self._loose_ends.pop((chunk, first), None)
        if before is not None:
            n += self._loose.pop((chunk, before))
            first = before
        after = self._loose.pop((chunk, first + n), None)
        if after is not None:
            del self._loose_ends[(chunk, first + n + after)]
            n += after
        self._loose[(chunk, first)] = n
        self._loose_ends[(chunk, first + n)] = first
        self.loose += p[2]

    def _unloose(self, key: tuple[int, int], n: int) -> Piece:
        """The first `n` granules of the loose run at `key`; the rest stays loose."""
        chunk, first = key
        m = self._loose.pop(key)
        del self._loose_ends[(chunk, first + m)]
        if m > n:
            self._loose[(chunk, first + n)] = m - n
            self._loose_ends[(chunk, first + m)] = first + n
        self.loose -= n
        return chunk, first, n


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

    def map(self, address: int, chunk: Any, offset: int, nbytes: int) -> None:
        pass

    def set_access(self, address: int, nbytes: int) -> None:
        pass

    def unmap(self, address: int, nbytes: int) -> None:
        pass
