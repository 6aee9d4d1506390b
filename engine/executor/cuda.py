"""The CUDA backend: a capped cudaMemPool, a copy stream, registered host memory.

Mapping of the runtime's requests to CUDA (cuda-python's runtime bindings):
- alloc      -> cudaMallocFromPoolAsync(n, pool, copy stream), one allocation
                per weight at its own size; the pool's maxSize caps it, so an
                over-allocation fails with cudaErrorMemoryAllocation instead
                of growing past the budget.
- copy_in    -> cudaMemcpyAsync(H2D, copy stream), then an event recorded there
                (the ready event the compute stream waits on).
- mark       -> an event recorded on the compute stream after a kernel.
- free_after -> the copy stream waits on the last reader's mark, then
                cudaFreeAsync(ptr, copy stream): later allocations on the copy
                stream reuse the memory in stream order. The pool's internal
                dependencies are switched off, so a missing dependency fails
                loudly instead of being patched over by the driver.
- device tensors wrap pool pointers through __cuda_array_interface__, no copy.
- register   -> cudaHostRegister(ReadOnly | Portable) of a page-aligned range.

Fragmentation. The pool places blocks itself and never moves them; with
weights of many sizes it can refuse a block while the policy's logical bytes
are under the budget, and capped at exactly the budget it does. The pool is
therefore capped at budget + `pool_slack_bytes` (engine/policy/placement.py: 4 x
the largest weight, in whole 32 MiB chunks, which is also how the pool reserves);
the policy still plans with the exact budget. Over many steps a slack alone is not enough when
every eviction goes back to the pool: its reserve creeps up step after step
(benchmarks/soak.py). So freed blocks are kept by exact size and reused
(FreeBlocks), and the pool is asked less often; and a refusal of a block the
budget allows is a PlacementError, on which the runtime has `defragment`
release the pool's unused reserve and asks again; refused again, it gives the
resident blocks back (all but the current and the previous kernel's), releases
the reserve, and those weights are copied in again largest first (a relocation:
one stall of resident bytes / H2D bandwidth, counted in the step's telemetry).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from engine.errors import ConfigError, ExecutorError, PlacementError
from engine.executor.backend import Block, FreeBlocks, LiveBlocks, warm_sizes

try:
    from cuda.bindings import driver as cudadrv
    from cuda.bindings import runtime as cudart
except ImportError:  # reported when a CUDA backend is asked for, not at import
    cudart = cudadrv = None

_UNLIMITED = 2**64 - 1


def _check(result: tuple, what: str, fix: str) -> Any:
    err = result[0]
    if err != cudart.cudaError_t.cudaSuccess:
        name = cudart.cudaGetErrorName(err)[1].decode()
        text = cudart.cudaGetErrorString(err)[1].decode()
        raise ExecutorError(f"{what} failed: {name} ({text}); {fix}")
    return result[1] if len(result) == 2 else None


class _DeviceBytes:
    """`nbytes` of device memory at `ptr`, in the form torch.as_tensor wraps without a copy."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


class CudaStreams:
    """What every CUDA backend shares: the compute and copy streams, host to
    device copies and their events, and host memory registered for DMA. A
    subclass places the blocks (`alloc`, `free_after`)."""

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise ExecutorError("no CUDA device; use mode=simulate (or weights.backend=cpu to "
                                "exercise the executor on the CPU)")
        if cudart is None:
            raise ExecutorError("the CUDA backends need cuda-python's bindings (cuda.bindings); "
                                "pip install 'offload-engine[cuda]'")
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.compute = torch.cuda.current_stream(self.device)
        self.copy = torch.cuda.Stream(self.device)
        self._copy_handle = self.copy.cuda_stream
        self._h2d = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        self.registered: dict[int, int] = {}  # address -> nbytes of registered host ranges

    def device_bytes(self, ptr: int, nbytes: int) -> torch.Tensor:
        """A uint8 tensor over `nbytes` of device memory at `ptr` (no copy)."""
        return torch.as_tensor(_DeviceBytes(ptr, nbytes), device=self.device)

    def mark(self) -> torch.cuda.Event:
        done = torch.cuda.Event()
        done.record(self.compute)
        return done

    def copy_in(self, block: Block, src: torch.Tensor) -> torch.cuda.Event:
        _check(cudart.cudaMemcpyAsync(block.address, src.data_ptr(), block.nbytes, self._h2d,
                                      self._copy_handle),
               f"cudaMemcpyAsync of {block.nbytes} bytes host to device", "check the host tensor is alive")
        ready = torch.cuda.Event()
        ready.record(self.copy)
        return ready

    def wait_ready(self, event: torch.cuda.Event) -> None:
        self.compute.wait_event(event)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def register(self, address: int, nbytes: int) -> None:
        flags = cudart.cudaHostRegisterReadOnly | cudart.cudaHostRegisterPortable
        _check(cudart.cudaHostRegister(address, nbytes, flags),
               f"cudaHostRegister of {nbytes} bytes of the weight file (read-only)",
               "the mapping could not be pinned: check `ulimit -l` (locked memory) and free host RAM, "
               "or use weights.source=mmap (unregistered, slower) or weights.source=pinned (a copy)")
        self.registered[address] = nbytes

    def unregister(self, address: int) -> None:
        _check(cudart.cudaHostUnregister(address), "cudaHostUnregister", "report this")
        del self.registered[address]

    def check_stream(self) -> None:
        current = torch.cuda.current_stream(self.device)
        if current != self.compute:
            raise ExecutorError(
                f"the forward runs on {current} but the executor was created on {self.compute}; "
                "create the executor on the stream the model runs on")

    def timer(self) -> torch.cuda.Event:
        mark = torch.cuda.Event(enable_timing=True)
        mark.record(self.compute)
        return mark

    def copy_timer(self) -> torch.cuda.Event:
        mark = torch.cuda.Event(enable_timing=True)
        mark.record(self.copy)
        return mark

    def elapsed_ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        end.synchronize()
        return start.elapsed_time(end)

    def synchronize(self) -> None:
        self.copy.synchronize()
        self.compute.synchronize()


def check_room(held_bytes: int) -> None:
    """Refuse, before any pool exists, weights that cannot fit the current device's free
    memory (the blocks torch's allocator caches given back first: the pool cannot use them)."""
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    if held_bytes > free:
        raise ConfigError(f"the weights would hold {held_bytes / 1e9:.2f} GB on cuda:{torch.cuda.current_device()} "
                          f"(the budget, or every weight without one) but it has {free / 1e9:.2f} GB free; give a "
                          f"budget under {free / 1e6:.0f} MB, leaving room for the activations")


class CudaBackend(CudaStreams):
    """Capped stream-ordered pool + copy stream on the current CUDA device.

    The pool's maxSize is budget + slack; the driver reserves whole 32 MiB
    chunks, so the reserved high-water can reach maxSize rounded up to one."""

    name = "cuda"
    granule = 1  # blocks are placed at their own size

    def __init__(self, budget_bytes: int, slack_bytes: int):
        super().__init__()
        self.budget_bytes = budget_bytes
        self.slack_bytes = slack_bytes
        self.cap_bytes = budget_bytes + self.slack_bytes
        self.pool = self._create_pool()
        self._live = LiveBlocks("cuda pool")
        self._free = FreeBlocks(budget_bytes)

    def _create_pool(self) -> Any:
        props = cudart.cudaMemPoolProps()
        props.allocType = cudart.cudaMemAllocationType.cudaMemAllocationTypePinned
        props.handleTypes = cudart.cudaMemAllocationHandleType.cudaMemHandleTypeNone
        props.location.type = cudart.cudaMemLocationType.cudaMemLocationTypeDevice
        props.location.id = self.device.index
        props.maxSize = self.cap_bytes
        pool = _check(cudart.cudaMemPoolCreate(props), f"cudaMemPoolCreate(maxSize={self.cap_bytes})",
                      "check the device supports memory pools (CUDA >= 11.2 driver) and that the "
                      "budget fits in free device memory")
        attr = cudart.cudaMemPoolAttr
        # Keep reserved memory between steps instead of returning it at every synchronize.
        _check(cudart.cudaMemPoolSetAttribute(pool, attr.cudaMemPoolAttrReleaseThreshold,
                                              cudadrv.cuuint64_t(_UNLIMITED)),
               "setting the pool's release threshold", "report this with the CUDA version")
        # Reuse only through the dependencies the runtime makes: a missing one fails loudly.
        _check(cudart.cudaMemPoolSetAttribute(pool, attr.cudaMemPoolReuseAllowInternalDependencies, 0),
               "disabling the pool's internal dependencies", "report this with the CUDA version")
        return pool

    def _attribute(self, attr: Any) -> int:
        return int(_check(cudart.cudaMemPoolGetAttribute(self.pool, attr), "cudaMemPoolGetAttribute",
                          "report this with the CUDA version"))

    def alloc(self, nbytes: int) -> Block:
        block = self._free.take(nbytes)
        if block is None:
            for kept in self._free.overflow(self._live.bytes, nbytes):
                self._release(kept.address)
            block = self._pool_alloc(nbytes)
        self._live.add(block.address, nbytes)
        return block

    def _pool_alloc(self, nbytes: int) -> Block:
        err, ptr = cudart.cudaMallocFromPoolAsync(nbytes, self.pool, self._copy_handle)
        if err != cudart.cudaError_t.cudaSuccess and len(self._free):
            self.trim()  # kept blocks of other sizes may be what splits the free space
            err, ptr = cudart.cudaMallocFromPoolAsync(nbytes, self.pool, self._copy_handle)
        if err != cudart.cudaError_t.cudaSuccess:
            used = self._attribute(cudart.cudaMemPoolAttr.cudaMemPoolAttrUsedMemCurrent)
            reserved = self._attribute(cudart.cudaMemPoolAttr.cudaMemPoolAttrReservedMemCurrent)
            what = (f"cudaMallocFromPoolAsync({nbytes}) with {used} bytes in use and {reserved} "
                    f"reserved of a cap of {self.cap_bytes}")
            if err == cudart.cudaError_t.cudaErrorMemoryAllocation and used + nbytes <= self.cap_bytes:
                device_free = torch.cuda.mem_get_info(self.device)[0]
                raise PlacementError(
                    f"{what} failed although the budget allows it: the pool's free space is split into "
                    f"pieces smaller than the block (fragmentation) or the device has too little free "
                    f"memory for the pool to grow into ({device_free / 1e6:.0f} MB free); free device "
                    "memory held elsewhere, raise the budget, or use weights.backend=vmm (never fragments)")
            _check((err,), what, "the pool could not place the block under its cap; raise the "
                   "budget or report this with the telemetry")
        return Block(ptr, nbytes, self.device_bytes(ptr, nbytes))

    def _release(self, address: int) -> None:
        _check(cudart.cudaFreeAsync(address, self._copy_handle), "cudaFreeAsync", "report this")

    def free_after(self, block: Block, mark: torch.cuda.Event | None) -> None:
        self._live.remove(block.address)  # a second free raises here, before the pool sees it
        if mark is not None:
            self.copy.wait_event(mark)  # every later use of the block is on the copy stream
        self._free.put(block)

    def warm(self, sizes: Sequence[int]) -> None:
        # Freed on the stream that allocated them: reusable at once.
        for block in [self.alloc(size) for size in warm_sizes(sizes, self.budget_bytes)]:
            self.free_after(block, None)
        self.copy.synchronize()
        self.reset_peak()

    def live_blocks(self) -> int:
        return len(self._live)

    def used_bytes(self) -> int:
        """Bytes the pool holds in use: live weights plus kept free blocks."""
        return self._attribute(cudart.cudaMemPoolAttr.cudaMemPoolAttrUsedMemCurrent)

    def kept_bytes(self) -> int:
        return self._free.bytes

    def trim(self) -> None:
        for kept in self._free.drain():
            self._release(kept.address)

    def defragment(self) -> None:
        self.trim()
        self.copy.synchronize()  # frees are stream-ordered: the pool can release them once they ran
        _check(cudart.cudaMemPoolTrimTo(self.pool, 0), "cudaMemPoolTrimTo", "report this with the CUDA version")

    def reserved_bytes(self) -> int:
        return self._attribute(cudart.cudaMemPoolAttr.cudaMemPoolAttrReservedMemCurrent)

    def reserved_peak_bytes(self) -> int:
        """High-water of memory the pool reserved from the device since creation."""
        return self._attribute(cudart.cudaMemPoolAttr.cudaMemPoolAttrReservedMemHigh)

    def peak_bytes(self) -> int:
        return self._live.peak

    def held_peak_bytes(self) -> int:
        return self._live.peak

    def reset_peak(self) -> None:
        self._live.reset_peak()

    def close(self) -> None:
        if self.pool is None:
            return
        self.synchronize()
        # Destroying a pool with blocks out would defer its release.
        for address in self._live.drain() + [b.address for b in self._free.drain()]:
            self._release(address)
        self.copy.synchronize()
        _check(cudart.cudaMemPoolDestroy(self.pool), "cudaMemPoolDestroy", "report this")
        self.pool = None

