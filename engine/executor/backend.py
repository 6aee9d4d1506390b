"""What the runtime asks of device memory and streams: the backend protocol.

Two streams exist on a backend. The compute stream runs the model and leaves
a mark after each kernel. The copy stream allocates, copies host to device and
frees: a free waits for the mark of the block's last reader, so memory is
reused, in the copy stream's own order, only after every kernel that read it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from engine.errors import ExecutorError


@dataclass
class Block:
    """Device memory holding one weight: `data` views its bytes (uint8)."""

    address: int
    nbytes: int
    data: torch.Tensor


class LiveBlocks:
    """The blocks a backend handed out and has not freed, by address.

    Every free is checked against it before the pool sees it, so a block freed
    twice fails loudly instead of corrupting the pool. `peak` is the high-water
    of live bytes since the last `reset_peak` (the weights' device bytes; the
    pool may hold more in reusable blocks, see FreeBlocks)."""

    def __init__(self, pool: str):
        self.pool = pool
        self._nbytes: dict[int, int] = {}
        self.bytes = 0
        self.peak = 0

    def __len__(self) -> int:
        return len(self._nbytes)

    def add(self, address: int, nbytes: int) -> None:
        self._nbytes[address] = nbytes
        self.bytes += nbytes
        self.peak = max(self.peak, self.bytes)

    def reset_peak(self) -> None:
        self.peak = self.bytes

    def remove(self, address: int) -> None:
        nbytes = self._nbytes.pop(address, None)
        if nbytes is None:
            raise ExecutorError(f"{self.pool}: block {address:#x} freed twice or never allocated "
                                "(a bug in the runtime; nothing was freed)")
        self.bytes -= nbytes

    def drain(self) -> list[int]:
        """Forget every block (the pool is going away); their addresses."""
        addresses = list(self._nbytes)
        self._nbytes.clear()
        self.bytes = 0
        return addresses


class FreeBlocks:
    """Freed blocks kept by exact size for the next allocation of that size.

    Why: a stream-ordered pool places every allocation itself, and weights of
    many sizes freed and allocated in a cycle fragment it: its reserve creeps up
    step after step until it refuses a block under its cap (benchmarks/soak.py
    runs that cycle). A transformer's streamed weights repeat the same few
    sizes block after block, so the weight that replaces an evicted one nearly
    always fits the evicted block exactly: reusing it keeps the pool's own
    placement out of the steady state.

    The books hold live + kept bytes within `limit_bytes` (the budget): before
    a new block is taken from the pool, `overflow` names the kept blocks to give
    back, oldest first, so the pool never holds more than the budget in use.
    A kept block was freed after its last reader on the copy stream, so a later
    allocation on that stream reuses it in stream order, as the pool would."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self._by_size: dict[int, dict[int, Block]] = {}  # nbytes -> address -> block
        self._order: dict[int, Block] = {}  # address -> block, oldest first
        self.bytes = 0
        self.reused = 0

    def __len__(self) -> int:
        return len(self._order)

    def put(self, block: Block) -> None:
        self._by_size.setdefault(block.nbytes, {})[block.address] = block
        self._order[block.address] = block
        self.bytes += block.nbytes

    def take(self, nbytes: int) -> Block | None:
        """A kept block of exactly `nbytes`, or None."""
        same = self._by_size.get(nbytes)
        if not same:
            return None
        _, block = same.popitem()
        del self._order[block.address]
        self.bytes -= nbytes
        self.reused += 1
        return block

    def overflow(self, live_bytes: int, nbytes: int) -> list[Block]:
        """Remove and return the oldest kept blocks until live + kept + `nbytes`
        fits the limit (all of them if it never does)."""
        out = []
        while self._order and live_bytes + self.bytes + nbytes > self.limit_bytes:
            out.append(self._pop_oldest())
        return out

    def drain(self) -> list[Block]:
        return [self._pop_oldest() for _ in range(len(self._order))]

    def _pop_oldest(self) -> Block:
        address = next(iter(self._order))
        block = self._order.pop(address)
        del self._by_size[block.nbytes][address]
        self.bytes -= block.nbytes
        return block


class Backend(Protocol):
    name: str
    device: torch.device
    cap_bytes: int  # the most device bytes the pool may hold at once
    granule: int  # blocks take whole granules (engine/policy/placement.py); 1: their own size

    def alloc(self, nbytes: int) -> Block:
        """Allocate on the copy stream; raises ExecutorError over the cap and
        PlacementError when the pool's free bytes would hold it but not in one piece."""
        ...

    def mark(self) -> Any:
        """A mark on the compute stream after the work issued so far."""
        ...

    def free_after(self, block: Block, mark: Any) -> None:
        """Free on the copy stream once the compute stream passed `mark` (None:
        no kernel read the block; the copy stream's order suffices). Raises
        ExecutorError, freeing nothing, for a block that is not allocated."""
        ...

    def live_blocks(self) -> int:
        """Blocks allocated and not freed yet (close() frees them with the pool)."""
        ...

    def copy_in(self, block: Block, src: torch.Tensor) -> Any:
        """Copy `src` (host, contiguous) into `block` on the copy stream; returns
        the ready event the compute stream waits on."""
        ...

    def wait_ready(self, event: Any) -> None:
        """Make the compute stream wait for a ready event (no host wait)."""
        ...

    def warm(self, sizes: Sequence[int]) -> None:
        """Allocate and free one block per distinct size (up to the cap) so the
        first step does not pay for growing the pool."""
        ...

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """Host bytes that copy at full speed (pinned on CUDA)."""
        ...

    def register(self, address: int, nbytes: int) -> None:
        """Make a host range (a read-only file mapping) copy at pinned speed."""
        ...

    def unregister(self, address: int) -> None:
        ...

    def check_stream(self) -> None:
        """Raise ExecutorError unless the caller runs on the compute stream."""
        ...

    def timer(self) -> Any:
        """A mark on the compute stream; `elapsed_ms(a, b)` reads the time between."""
        ...

    def copy_timer(self) -> Any:
        """A mark on the copy stream, on the same clock as `timer`."""
        ...

    def elapsed_ms(self, start: Any, end: Any) -> float:
        ...

    def used_bytes(self) -> int:
        """Bytes the pool holds in use: live blocks plus freed blocks kept for reuse."""
        ...

    def kept_bytes(self) -> int:
        """Bytes in freed blocks kept for reuse (within the budget with the live ones)."""
        ...

    def trim(self) -> None:
        """Give every kept block back to the pool (the next allocation of any size
        is placed by the pool)."""
        ...

    def defragment(self) -> None:
        """Give kept blocks back, wait for the frees, and let the pool release the
        reserve no live block uses, so the next allocations are placed afresh."""
        ...

    def reserved_bytes(self) -> int:
        """Memory the pool holds now (used or not)."""
        ...

    def reserved_peak_bytes(self) -> int:
        """High-water of memory the pool held (used or not) since it was created."""
        ...

    def peak_bytes(self) -> int:
        """High-water of live block bytes (the weights held) since the last `reset_peak`."""
        ...

    def held_peak_bytes(self) -> int:
        """High-water of the device bytes the weights hold, as the simulator counts them: the
        live blocks since the last `reset_peak` on a pool; on vmm at least its chunks' high-water
        since creation (a chunk holds its memory mapped or not: the conversion slack too)."""
        ...

    def reset_peak(self) -> None:
        ...

    def synchronize(self) -> None:
        ...

    def close(self) -> None:
        ...


def warm_sizes(sizes: Sequence[int], limit_bytes: int) -> list[int]:
    """The blocks `Backend.warm` allocates: one per distinct size, largest first,
    each while the blocks so far and it fit `limit_bytes`."""
    chosen, total = [], 0
    for size in sorted(set(sizes), reverse=True):
        if total + size <= limit_bytes:
            chosen.append(size)
            total += size
    return chosen


def page_span(address: int, nbytes: int, page: int) -> tuple[int, int]:
    """The page-aligned range covering [address, address + nbytes)."""
    start = address - address % page
    end = address + nbytes
    return start, -(-end // page) * page - start
