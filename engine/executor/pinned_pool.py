"""Host slabs for spilled activations: exact size classes, allocated once.

The activation policy books slabs (engine.policy.saved.SizeClassPool);
this module owns the memory the bookings stand for. Every slab of every class
is carved from one host buffer allocated at init, so a step allocates no host
memory for pool hits. On CUDA the whole buffer is page-locked once with
cudaHostRegister, which makes spills and restores true asynchronous DMA.

Why not `torch.empty(..., pin_memory=True)`: torch's caching host allocator
rounds every pinned allocation up to a power of two (a 201 MB slab would take
256 MB, a 5 GB pool 8 GB) and keeps the blocks cached; the pool's point is
exact sizes.

Slabs start on page boundaries (so each DMA covers whole pages of the
registered range); the padding is under 4 KiB a slab.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from engine.errors import ExecutorError

PAGE = 4096


@dataclass(eq=False)
class Slab:
    """One slab: `data` is exactly its class size, in bytes (uint8)."""

    size_class: int
    data: torch.Tensor
    # The restore that last read this slab (an event, or None): the next spill
    # into it must not overwrite the bytes before that copy has read them.
    last_read: Any = None


def _aligned(n: int) -> int:
    return -(-n // PAGE) * PAGE


class SlabPool:
    """Free slabs per size class, carved from one buffer; `pin` registers it with CUDA."""

    def __init__(self, class_sizes_bytes: Sequence[int], slabs_per_class: Sequence[int], pin: bool):
        if len(class_sizes_bytes) != len(slabs_per_class):
            raise ExecutorError(f"{len(class_sizes_bytes)} size classes but {len(slabs_per_class)} slab counts; "
                                "give one slab count per class (activations.pool)")
        self.class_sizes_bytes = tuple(int(s) for s in class_sizes_bytes)
        self.slabs_per_class = tuple(int(n) for n in slabs_per_class)
        total = sum(_aligned(s) * n for s, n in zip(self.class_sizes_bytes, self.slabs_per_class))
        self.nbytes = total
        self.buffer = torch.empty(total, dtype=torch.uint8)
        self._registered = False
        if pin and total:
            _host_register(self.buffer, total)
            self._registered = True
        self._free: list[list[Slab]] = []
        offset = 0
        for c, (size, count) in enumerate(zip(self.class_sizes_bytes, self.slabs_per_class)):
            slabs = []
            for _ in range(count):
                slabs.append(Slab(c, self.buffer[offset:offset + size]))
                offset += _aligned(size)
            self._free.append(slabs)

    @property
    def pinned_bytes(self) -> int:
        """Page-locked bytes this pool holds now (0 when unpinned or closed)."""
        return self.nbytes if self._registered else 0

    def take(self, size_class: int) -> Slab:
        """A free slab of `size_class`; the policy booked it, so one must be free."""
        if not 0 <= size_class < len(self._free):
            raise ExecutorError(
                f"the activation policy booked size class {size_class} but the slab pool has "
                f"{len(self._free)} classes; build the policy and the offloader from the same "
                "activations config")
        free = self._free[size_class]
        if not free:
            raise ExecutorError(
                f"the activation policy booked a slab of size class {size_class} "
                f"({self.class_sizes_bytes[size_class]} bytes) but all {self.slabs_per_class[size_class]} "
                "are in use; the policy and the offloader disagree on the pool (same activations config?)")
        return free.pop()

    def give_back(self, slab: Slab, last_read: Any) -> None:
        slab.last_read = last_read
        self._free[slab.size_class].append(slab)

    def free_slabs(self, size_class: int) -> int:
        return len(self._free[size_class])

    def close(self) -> None:
        """Unregister the buffer (the caller has waited for every copy that uses it)."""
        if self._registered:
            err = torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self._registered = False
            if _code(err):
                raise ExecutorError(f"cudaHostUnregister of the slab pool failed (error {_code(err)}); "
                                    "report this with the CUDA version")
        self._free = []


def _code(err: Any) -> int:
    return int(getattr(err, "value", err))


def _host_register(buffer: torch.Tensor, nbytes: int) -> None:
    err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0)
    if _code(err):
        raise ExecutorError(
            f"cudaHostRegister of the {nbytes / 1e6:.0f} MB slab pool failed (error {_code(err)}); "
            "check `ulimit -l` (locked memory) and free host RAM, or shrink activations.pool "
            "(class_sizes_mb x slabs_per_class)")
