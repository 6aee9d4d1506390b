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
    twice fails loudly instead of corrupting the pool."""

    def __init__(self, pool: str):
        self.pool = pool
        self._nbytes: dict[int, int] = {}
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._nbytes)

    def add(self, address: int, nbytes: int) -> None:
        self._nbytes[address] = nbytes
        self.bytes += nbytes

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


class Backend(Protocol):
    name: str
    device: torch.device
    cap_bytes: int  # the most device bytes the pool may hold at once

    def alloc(self, nbytes: int) -> Block:
        """Allocate on the copy stream; raises ExecutorError over the cap."""
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

    def elapsed_ms(self, start: Any, end: Any) -> float:
        ...

    def used_bytes(self) -> int:
        ...

    def reserved_peak_bytes(self) -> int:
        """High-water of memory the pool held (used or not) since it was created."""
        ...

    def peak_bytes(self) -> int:
        """High-water of used bytes since the last `reset_peak`."""
        ...

    def reset_peak(self) -> None:
        ...

    def synchronize(self) -> None:
        ...

    def close(self) -> None:
        ...


def page_span(address: int, nbytes: int, page: int) -> tuple[int, int]:
    """The page-aligned range covering [address, address + nbytes)."""
    start = address - address % page
    end = address + nbytes
    return start, -(-end // page) * page - start
