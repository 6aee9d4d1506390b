"""The vmm backend: weights in physical chunks of one granule, mapped on demand.

Device memory is a set of physical chunks of the device's allocation
granularity (cuMemCreate; 2 MiB on an H100), at most the budget's worth. A
block of n bytes takes ceil(n / granule) chunks, any of them, mapped one
after another into a virtual range of its own (cuMemMap, cuMemSetAccess):
no block needs contiguous physical memory, so the chunks never fragment and
a block the budget allows is never refused. Internal waste is under one
granule a block; placement.py has the policy plan with the rounded sizes,
so the chunks in use never exceed the budget.

Stream order, as in the pool backend: `free_after` makes the copy stream wait
for the block's last reader and hands its chunks back at once, so the next
block's copy into them runs after that reader. The freed range keeps its
mapping (aliasing chunks that another range may map now; nothing reads it
any more) until it is reused for a block of the same size, once the copy
stream passed the free; only then is it unmapped (cuMemUnmap) and mapped
again. Virtual ranges are reserved as needed (cuMemAddressReserve); address
space is plentiful, so a new range is always at hand.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

from engine.errors import ExecutorError
from engine.executor.backend import Block, LiveBlocks
from engine.executor.cuda import CudaStreams
from engine.policy.placement import round_up

try:
    from cuda.bindings import driver as cudadrv
except ImportError:  # reported when the backend is asked for, not at import
    cudadrv = None

RESERVE_FACTOR = 2  # virtual address space reserved at a time, in budgets


class Event(Protocol):
    def query(self) -> bool: ...


class Driver(Protocol):
    """The driver calls the chunk map makes (CudaVmm on a GPU; a fake in the tests)."""

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
    freed: Event | None = None  # the copy stream passed the free (a free range only)


@dataclass
class ChunkMap:
    """Physical chunks and the virtual ranges that map them (module docstring).

    `cap_bytes` caps the chunks ever created; `counts` are granules mapped and
    unmapped since creation."""

    driver: Driver
    cap_bytes: int
    reserve_bytes: int
    free_chunks: list = field(default_factory=list)
    chunks: list = field(default_factory=list)  # every chunk created, released at close
    maps: int = 0
    unmaps: int = 0

    def __post_init__(self) -> None:
        self.granule = self.driver.granule
        self._live: dict[int, _Range] = {}
        self._free: dict[int, deque[_Range]] = {}  # nbytes -> free ranges, oldest first
        self._reserved: list[tuple[int, int]] = []  # (address, nbytes) of each reservation
        self._cursor = self._end = 0  # the unused rest of the newest reservation

    @property
    def live_bytes(self) -> int:
        return sum(r.nbytes for r in self._live.values())

    def grow(self, nbytes: int) -> None:
        """Create chunks until `nbytes` of them exist (at most the cap)."""
        while (len(self.chunks) + 1) * self.granule <= min(nbytes, self.cap_bytes):
            self._create()

    def place(self, nbytes: int) -> int:
        """Map whole granules for `nbytes` into a range of their own; its address."""
        size = round_up(nbytes, self.granule)
        need = size // self.granule
        while len(self.free_chunks) < need:
            if (len(self.chunks) + 1) * self.granule > self.cap_bytes:
                raise ExecutorError(
                    f"vmm backend: {nbytes} bytes need {need} chunks but only {len(self.free_chunks)} of the "
                    f"budget's {self.cap_bytes // self.granule} are free; the executor allocated past its "
                    "budget (a bug in the runtime)")
            self._create()
        chunks = [self.free_chunks.pop() for _ in range(need)]
        r = self._range(size)
        r.chunks = []
        try:
            for i, chunk in enumerate(chunks):
                self.driver.map(r.address + i * self.granule, chunk)
                r.chunks.append(chunk)
                self.maps += 1
            self.driver.set_access(r.address, size)
        except BaseException:
            self._unmap(r)  # nothing mapped is left behind
            self.free_chunks.extend(chunks)
            self._free.setdefault(size, deque()).appendleft(r)
            raise
        self._live[r.address] = r
        return r.address

    def free(self, address: int, freed: Event) -> None:
        """The block at `address` is free once `freed` completes; its chunks may be
        mapped elsewhere at once (their next writer is ordered after it)."""
        r = self._live.pop(address, None)
        if r is None:
            raise ExecutorError(f"vmm backend: block {address:#x} freed twice or never allocated "
                                "(a bug in the runtime; nothing was freed)")
        self.free_chunks.extend(r.chunks)
        r.freed = freed
        self._free.setdefault(r.nbytes, deque()).append(r)

    def close(self) -> None:
        """Unmap every range, release every chunk and the address space."""
        for r in list(self._live.values()) + [r for q in self._free.values() for r in q]:
            self._unmap(r)
        self._live.clear()
        self._free.clear()
        for chunk in self.chunks:
            self.driver.release(chunk)
        self.chunks.clear()
        self.free_chunks.clear()
        for address, nbytes in self._reserved:
            self.driver.free_range(address, nbytes)
        self._reserved.clear()
        self._cursor = self._end = 0

    def _create(self) -> None:
        chunk = self.driver.create()
        self.chunks.append(chunk)
        self.free_chunks.append(chunk)

    def _range(self, size: int) -> _Range:
        """A free range of `size` bytes the copy stream is done with, unmapped; else a new one."""
        q = self._free.get(size)
        if q and q[0].freed.query():
            r = q.popleft()
            self._unmap(r)
            r.freed = None
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


def _check(result: tuple, what: str, fix: str = "report this with the CUDA driver version") -> Any:
    err = result[0]
    if err != cudadrv.CUresult.CUDA_SUCCESS:
        name = cudadrv.cuGetErrorName(err)[1]
        raise ExecutorError(f"{what} failed: {name.decode() if name else err}; {fix}")
    return result[1] if len(result) == 2 else None


class CudaVmm:
    """The CUDA driver's virtual memory management calls for one device."""

    def __init__(self, device: torch.device):
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

    def reserve(self, nbytes: int) -> int:
        return int(_check(cudadrv.cuMemAddressReserve(nbytes, self.granule, 0, 0),
                          f"cuMemAddressReserve of {nbytes} bytes of address space"))

    def free_range(self, address: int, nbytes: int) -> None:
        _check(cudadrv.cuMemAddressFree(address, nbytes), "cuMemAddressFree")

    def create(self) -> Any:
        return _check(cudadrv.cuMemCreate(self.granule, self._prop, 0), f"cuMemCreate of {self.granule} bytes",
                      "the device has no free memory for the budget: free device memory held elsewhere or "
                      "lower the budget")

    def release(self, chunk: Any) -> None:
        _check(cudadrv.cuMemRelease(chunk), "cuMemRelease")

    def map(self, address: int, chunk: Any) -> None:
        _check(cudadrv.cuMemMap(address, self.granule, 0, chunk, 0), "cuMemMap")

    def set_access(self, address: int, nbytes: int) -> None:
        _check(cudadrv.cuMemSetAccess(address, nbytes, [self._access], 1), "cuMemSetAccess")

    def unmap(self, address: int) -> None:
        _check(cudadrv.cuMemUnmap(address, self.granule), "cuMemUnmap")


def vmm_granule(device: torch.device | None = None) -> int:
    """The allocation granularity of the vmm backend on `device` (the current one)."""
    if not torch.cuda.is_available():
        raise ExecutorError("weights.backend=vmm needs a CUDA device; use mode=simulate here")
    return CudaVmm(device or torch.device("cuda", torch.cuda.current_device())).granule


class VmmBackend(CudaStreams):
    """Budget-capped physical chunks mapped into per-block virtual ranges (module docstring)."""

    name = "vmm"

    def __init__(self, budget_bytes: int):
        super().__init__()
        driver = CudaVmm(self.device)
        self.granule = driver.granule
        if budget_bytes < self.granule:
            raise ExecutorError(f"budget {budget_bytes} bytes is under one granule of the vmm backend "
                                f"({self.granule} bytes); raise the budget")
        self.budget_bytes = budget_bytes
        self.cap_bytes = budget_bytes // self.granule * self.granule
        self.chunks = ChunkMap(driver, self.cap_bytes, RESERVE_FACTOR * self.cap_bytes)
        self._live = LiveBlocks("vmm backend")  # placed bytes (whole granules)
        self._closed = False

    def alloc(self, nbytes: int) -> Block:
        address = self.chunks.place(nbytes)
        self._live.add(address, round_up(nbytes, self.granule))
        return Block(address, nbytes, self.device_bytes(address, nbytes))

    def free_after(self, block: Block, mark: torch.cuda.Event | None) -> None:
        self._live.remove(block.address)  # a second free raises here
        if mark is not None:
            self.copy.wait_event(mark)  # every later write to the chunks is on the copy stream
        freed = torch.cuda.Event()
        freed.record(self.copy)
        self.chunks.free(block.address, freed)

    def warm(self, sizes: Sequence[int]) -> None:
        self.chunks.grow(sum(round_up(n, self.granule) for n in sizes))

    def live_blocks(self) -> int:
        return len(self._live)

    def used_bytes(self) -> int:
        """Bytes of chunks mapped by live blocks."""
        return self._live.bytes

    def kept_bytes(self) -> int:
        return 0  # a free chunk serves a block of any size: nothing is kept by size

    def trim(self) -> None:
        pass

    def placement_at_risk(self, nbytes: int) -> bool:
        return False  # any free chunks serve any block

    def defragment(self) -> None:
        pass

    def reserved_peak_bytes(self) -> int:
        """Device memory the chunks hold (created, mapped or not)."""
        return len(self.chunks.chunks) * self.granule

    def peak_bytes(self) -> int:
        return self._live.peak

    def reset_peak(self) -> None:
        self._live.reset_peak()

    def map_counts(self) -> dict:
        """Granules mapped and unmapped since creation."""
        return {"maps": self.chunks.maps, "unmaps": self.chunks.unmaps}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.synchronize()  # no kernel or copy still uses a mapping
        self._live.drain()
        self.chunks.close()
