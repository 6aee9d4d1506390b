"""The cpu backend: a TEST backend that runs the executor's control path on the CPU.

"Device memory" is a capped host arena (a byte counter over real tensors) and
copies are host memcpys, so every decision path (hit, fetch, prefetch, evict),
stream-ordered reuse and failure mode runs in CI without a GPU. It measures
nothing about a GPU; it is not a way to run a model.

Everything runs in order on the CPU, so a free is complete when it returns
and marks are nothing; an allocation over the cap raises like the CUDA pool's
refusal. Freed blocks are kept by exact size and reused as on CUDA
(FreeBlocks), so that bookkeeping runs in CI too. With `granule` > 1 it
stands in for the vmm backend instead: every block takes whole granules of
the cap and nothing is kept by size.
"""
from __future__ import annotations

import logging
import time
from typing import Sequence

import torch

from engine.errors import ExecutorError
from engine.executor.backend import Block, FreeBlocks, LiveBlocks, warm_sizes
from engine.policy.placement import round_up

log = logging.getLogger(__name__)

PAGE = 4096


class CpuEvent:
    """Copies on the CPU finish before `copy_in` returns: every event is complete."""

    __slots__ = ()


_DONE = CpuEvent()


class CpuBackend:
    """Capped host arena + host copies (test backend; see the module docstring)."""

    name = "cpu"

    def __init__(self, cap_bytes: int, granule: int = 1):
        self.device = torch.device("cpu")
        self.cap_bytes = cap_bytes
        self.granule = granule
        self._reserved_peak = 0
        self._next_address = 1
        self._live = LiveBlocks("host arena")
        self._free = FreeBlocks(cap_bytes)
        self.registered: dict[int, int] = {}  # address -> nbytes
        log.info("cpu backend (a test backend, no GPU): capped arena of %d bytes", cap_bytes)

    def alloc(self, nbytes: int) -> Block:
        placed = round_up(nbytes, self.granule)
        block = self._free.take(nbytes)
        if block is None:
            self._free.overflow(self._live.bytes, nbytes)  # dropped: the arena gets them back
            used = self._live.bytes
            if used + placed > self.cap_bytes:
                raise ExecutorError(
                    f"host arena refused {nbytes} bytes: {used} in use of a cap of "
                    f"{self.cap_bytes}; the executor allocated past its budget (a bug in the runtime)")
            block = Block(self._next_address, nbytes, torch.empty(nbytes, dtype=torch.uint8))
            self._next_address += 1
        self._live.add(block.address, placed)
        self._reserved_peak = max(self._reserved_peak, self._live.bytes + self._free.bytes)
        return block

    def mark(self) -> None:
        return None

    def free_after(self, block: Block, mark: None) -> None:
        self._live.remove(block.address)
        if self.granule == 1:
            self._free.put(block)

    def copy_in(self, block: Block, src: torch.Tensor) -> CpuEvent:
        block.data.copy_(src.reshape(-1).view(torch.uint8))
        return _DONE

    def wait_ready(self, event: CpuEvent) -> None:
        pass

    def warm(self, sizes: Sequence[int]) -> None:
        if self.granule > 1:
            return  # nothing is kept by size: there is nothing to warm
        for block in [self.alloc(size) for size in warm_sizes(sizes, self.cap_bytes)]:
            self.free_after(block, None)
        self.reset_peak()

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def register(self, address: int, nbytes: int) -> None:
        if address % PAGE or nbytes % PAGE:
            raise ExecutorError(f"register: range {address:#x}+{nbytes} is not page-aligned (runtime bug)")
        if address in self.registered:
            raise ExecutorError(f"register: {address:#x} is already registered")
        self.registered[address] = nbytes

    def unregister(self, address: int) -> None:
        if self.registered.pop(address, None) is None:
            raise ExecutorError(f"unregister: {address:#x} was not registered")

    def check_stream(self) -> None:
        pass  # one thread on the CPU: there is no other stream to be on

    def timer(self) -> float:
        return time.perf_counter()

    def copy_timer(self) -> float:
        return time.perf_counter()  # copies run in order on the one CPU thread

    def elapsed_ms(self, start: float, end: float) -> float:
        return (end - start) * 1e3

    def used_bytes(self) -> int:
        """Bytes the arena holds in use: live weights plus kept free blocks."""
        return self._live.bytes + self._free.bytes

    def kept_bytes(self) -> int:
        return self._free.bytes

    def trim(self) -> None:
        self._free.drain()

    def defragment(self) -> None:
        self.trim()  # a byte counter never fragments: nothing else to release

    def reserved_bytes(self) -> int:
        return self.used_bytes()

    def reserved_peak_bytes(self) -> int:
        return self._reserved_peak

    def peak_bytes(self) -> int:
        return self._live.peak

    def held_peak_bytes(self) -> int:
        return self._live.peak

    def reset_peak(self) -> None:
        self._live.reset_peak()

    def synchronize(self) -> None:
        pass

    def live_blocks(self) -> int:
        return len(self._live)

    def close(self) -> None:
        self._live.drain()
        self.trim()
