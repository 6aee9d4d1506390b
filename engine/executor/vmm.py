"""The vmm backend: weights in physical chunks of whole granules, mapped on demand.

Device memory is a set of physical chunks of 1 to 16 granules of the device's
allocation granularity (cuMemCreate; 2 MiB on an H100), at most the budget's
worth and the books' slack (chunks.conversion_slack), mapped into a virtual
range per block (cuMemMap, cuMemSetAccess). Which chunks and ranges a block
gets, and when a range is mapped or unmapped, is engine/policy/chunks.py's
ChunkBooks; this module makes the driver calls and keeps the stream order.
Internal waste is under one granule a block; placement.py has the policy plan
with the rounded sizes, so the chunks in use never exceed the budget, and a
block the budget allows is never refused.

Stream order, as in the pool backend: `free_after` makes the copy stream wait
for the block's last reader; the block's chunks may then serve the next block
at once, whose copy runs on the copy stream after that wait. `freed` is the
reader's mark (a block never read: an event after its copy on the copy stream),
and a range is unmapped only once it has completed.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable, Sequence

import torch

from engine.errors import ExecutorError
from engine.executor.backend import Block, LiveBlocks
from engine.executor.cuda import CudaStreams
from engine.policy.chunks import ChunkBooks, conversion_slack
from engine.policy.placement import round_up

try:
    from cuda.bindings import driver as cudadrv
except ImportError:  # reported when the backend is asked for, not at import
    cudadrv = None

RESERVE_FACTOR = 2  # virtual address space reserved at a time, in budgets


def _check(result: tuple, what: str, fix: str = "report this with the CUDA driver version") -> Any:
    err = result[0]
    if err != cudadrv.CUresult.CUDA_SUCCESS:
        name = cudadrv.cuGetErrorName(err)[1]
        raise ExecutorError(f"{what} failed: {name.decode() if name else err}; {fix}")
    return result[1] if len(result) == 2 else None


def _timed(call: Callable[..., Any]) -> Callable[..., Any]:
    """A driver call whose host time adds to its CudaVmm's `call_ns`."""
    @functools.wraps(call)
    def timed(self: "CudaVmm", *args: Any) -> Any:
        start = time.perf_counter_ns()
        try:
            return call(self, *args)
        finally:
            self.call_ns += time.perf_counter_ns() - start
    return timed


class CudaVmm:
    """The CUDA driver's virtual memory management calls for one device; `call_ns` is
    the host time they took."""

    def __init__(self, device: torch.device):
        self.call_ns = 0
        if cudadrv is None:
            raise ExecutorError("weights.backend=vmm needs cuda-python's driver bindings (cuda.bindings.driver); "
                                "pip install 'offload-engine[cuda]'")
        torch.cuda.synchronize(device)  # the primary context, current on this thread
        attr = cudadrv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        supported = _check(cudadrv.cuDeviceGetAttribute(attr, device.index), "cuDeviceGetAttribute")
        if not supported:
            raise ExecutorError(f"device {device.index} or its driver does not support virtual memory management "
                                "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0); use "
                                "weights.backend=cuda")
        location = cudadrv.CUmemLocation()
        location.type = cudadrv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        location.id = device.index
        self._prop = cudadrv.CUmemAllocationProp()
        self._prop.type = cudadrv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location = location
        self._access = cudadrv.CUmemAccessDesc()
        self._access.location = location
        self._access.flags = cudadrv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        option = cudadrv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        self.granule = int(_check(cudadrv.cuMemGetAllocationGranularity(self._prop, option),
                                  "cuMemGetAllocationGranularity"))

    @_timed
    def reserve(self, nbytes: int) -> int:
        return int(_check(cudadrv.cuMemAddressReserve(nbytes, self.granule, 0, 0),
                          f"cuMemAddressReserve of {nbytes} bytes of address space"))

    @_timed
    def free_range(self, address: int, nbytes: int) -> None:
        _check(cudadrv.cuMemAddressFree(address, nbytes), "cuMemAddressFree")

    @_timed
    def create(self, nbytes: int) -> Any:
        return _check(cudadrv.cuMemCreate(nbytes, self._prop, 0), f"cuMemCreate of {nbytes} bytes",
                      "the device has no free memory for the budget: free device memory held elsewhere or "
                      "lower the budget")

    @_timed
    def release(self, chunk: Any) -> None:
        _check(cudadrv.cuMemRelease(chunk), "cuMemRelease")

    @_timed
    def map(self, address: int, chunk: Any, nbytes: int) -> None:
        _check(cudadrv.cuMemMap(address, nbytes, 0, chunk, 0), "cuMemMap")

    @_timed
    def set_access(self, address: int, nbytes: int) -> None:
        _check(cudadrv.cuMemSetAccess(address, nbytes, [self._access], 1), "cuMemSetAccess")

    @_timed
    def unmap(self, address: int, nbytes: int) -> None:
        _check(cudadrv.cuMemUnmap(address, nbytes), "cuMemUnmap")


def vmm_granule(device: torch.device | None = None) -> int:
    """The allocation granularity of the vmm backend on `device` (the current one)."""
    if not torch.cuda.is_available():
        raise ExecutorError("weights.backend=vmm needs a CUDA device; use mode=simulate here")
    return CudaVmm(device or torch.device("cuda", torch.cuda.current_device())).granule


class _TimedEvent:
    """A free's event whose host waits (the chunk books' `synchronize`) are timed."""

    def __init__(self, event: torch.cuda.Event, backend: "VmmBackend"):
        self.event, self.backend = event, backend

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        start = time.perf_counter_ns()
        self.event.synchronize()
        self.backend.wait_ns += time.perf_counter_ns() - start


class VmmBackend(CudaStreams):
    """Budget-capped physical chunks mapped into per-block virtual ranges (module docstring)."""

    name = "vmm"

    def __init__(self, budget_bytes: int, largest_block_bytes: int = 0):
        super().__init__()
        driver = CudaVmm(self.device)
        self.granule = driver.granule
        if budget_bytes < self.granule:
            raise ExecutorError(f"budget {budget_bytes} bytes is under one granule of the vmm backend "
                                f"({self.granule} bytes); raise the budget")
        self.budget_bytes = budget_bytes
        self.cap_bytes = budget_bytes // self.granule * self.granule
        self.chunks = ChunkBooks(driver, self.cap_bytes, RESERVE_FACTOR * self.cap_bytes,
                                 conversion_slack(largest_block_bytes, self.granule))
        self._live = LiveBlocks("vmm backend")  # placed bytes (whole granules)
        self._closed = False
        self.host_ns = 0  # host time in the chunk books and their driver calls
        self.wait_ns = 0  # of it, waiting for a free to pass

    def alloc(self, nbytes: int) -> Block:
        start = time.perf_counter_ns()
        address = self.chunks.place(nbytes)
        self.host_ns += time.perf_counter_ns() - start
        self._live.add(address, round_up(nbytes, self.granule))
        return Block(address, nbytes, self.device_bytes(address, nbytes))

    def free_after(self, block: Block, mark: torch.cuda.Event | None) -> None:
        self._live.remove(block.address)  # a second free raises here
        start = time.perf_counter_ns()
        if mark is not None:
            self.copy.wait_event(mark)  # every later write to the chunks is on the copy stream
            freed = mark  # its copy landed before its reader ran: the reader's end frees the chunks
        else:  # never read: its copy's landing, on the copy stream
            freed = torch.cuda.Event()
            freed.record(self.copy)
        self.chunks.free(block.address, _TimedEvent(freed, self))
        self.host_ns += time.perf_counter_ns() - start

    def warm(self, sizes: Sequence[int]) -> None:
        self.chunks.grow(list(sizes))

    def live_blocks(self) -> int:
        return len(self._live)

    def used_bytes(self) -> int:
        """Bytes of chunks mapped by live blocks."""
        return self._live.bytes

    def kept_bytes(self) -> int:
        return 0  # free ranges' chunks serve any block that needs them: nothing is held back by size

    def trim(self) -> None:
        pass

    def defragment(self) -> None:
        pass

    def reserved_bytes(self) -> int:
        """Device memory the chunks hold now (created, mapped or not)."""
        return self.chunks.held * self.granule

    def reserved_peak_bytes(self) -> int:
        """High-water of the device memory the chunks held (the conversion slack included)."""
        return self.chunks.peak_held * self.granule

    def peak_bytes(self) -> int:
        return self._live.peak

    def held_peak_bytes(self) -> int:
        return max(self._live.peak, self.reserved_peak_bytes())

    def reset_peak(self) -> None:
        self._live.reset_peak()

    def map_counts(self) -> dict:
        """Chunks mapped and unmapped since creation, blocks placed with no driver call,
        and the host ms spent placing and freeing blocks (of it, waiting for frees, and in
        the driver's calls; the rest is the books' own Python)."""
        b = self.chunks
        return {"maps": b.maps, "unmaps": b.unmaps, "creates": b.creates, "releases": b.releases,
                "waits": b.waits, "reused": b.reused, "host_ms": self.host_ns / 1e6, "wait_ms": self.wait_ns / 1e6,
                "driver_ms": b.driver.call_ns / 1e6}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.synchronize()  # no kernel or copy still uses a mapping
        self._live.drain()
        self.chunks.close()
