"""Copy backends of the activation offloader: where spills and restores run.

`CudaCopies` issues them on side streams beside the compute stream and answers
with CUDA events; `CpuCopies` (device="cpu", the "device" being host memory)
copies synchronously into the same slabs, so the offloader's data paths,
views, dtypes, checksums and pool accounting run in CI. Both move raw bytes
(`bytes_of`), so every dtype, float8 included, travels the same way.

Both answer the same calls: `spill` (D2H into host bytes, after the compute
work so far), `restore` (H2D into a new device tensor), `done`, `wait_host`
(the host waits), `wait` and `use` (the compute stream waits; timing events
around the wait where it may stall) and `synchronize`.
"""
from __future__ import annotations

from typing import Any, Sequence, Union

import torch

Tensor = torch.Tensor


def bytes_of(t: Tensor) -> Tensor:
    """The bytes of a dense tensor: uint8, over its own storage."""
    n = t.numel() * t.element_size()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(
        t.untyped_storage(), t.storage_offset() * t.element_size(), (n,), (1,))


class CpuCopies:
    """device="cpu" (CI): every copy finishes before it returns, so there are no events (None)."""

    def spill(self, dst: Tensor, src: Tensor, after: Sequence[Any]) -> None:
        dst.copy_(src)

    def restore(self, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, src: Tensor,
                after: Any, on_demand: bool = False) -> tuple[Tensor, None]:
        out = torch.empty_strided(shape, stride, dtype=dtype)
        bytes_of(out).copy_(src)
        return out, None

    def done(self, event: Any) -> bool:
        return True

    def wait_host(self, event: Any) -> None:
        pass

    def wait(self, event: Any) -> None:
        return None

    def use(self, tensor: Tensor, event: Any) -> None:
        return None

    def synchronize(self) -> None:
        pass


class CudaCopies:
    """A spill stream (D2H) and a restore stream (H2D) beside the compute stream.

    The compute stream is whatever stream is current when a hook runs (autograd
    runs backward nodes on their forward's stream). Restored tensors are
    allocated on the restore stream, so a restore never waits for compute work
    that freed the memory it lands in, and are recorded on the compute stream
    that uses them, so the allocator reuses them only after that use.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.spill_stream = torch.cuda.Stream(device)
        self.restore_stream = torch.cuda.Stream(device)
        # On-demand restores get a stream of their own: behind the restore stream's
        # queue they would wait for predictive restores gated on spills still in
        # flight, while the compute stream waits for them now.
        self.demand_stream = torch.cuda.Stream(device)

    def _compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def spill(self, dst: Tensor, src: Tensor, after: Sequence[torch.cuda.Event]) -> torch.cuda.Event:
        s = self.spill_stream
        s.wait_stream(self._compute())  # the tensor is produced by compute work issued so far
        for e in after:
            s.wait_event(e)
        with torch.cuda.stream(s):
            dst.copy_(src, non_blocking=True)
        src.record_stream(s)  # its memory may be freed before the copy has read it
        return s.record_event()

    def restore(self, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, src: Tensor,
                after: torch.cuda.Event | None, on_demand: bool = False) -> tuple[Tensor, torch.cuda.Event]:
        s = self.demand_stream if on_demand else self.restore_stream
        if after is not None:
            s.wait_event(after)
        with torch.cuda.stream(s):
            out = torch.empty_strided(shape, stride, dtype=dtype, device=self.device)
            bytes_of(out).copy_(src, non_blocking=True)
        return out, s.record_event()

    def done(self, event: torch.cuda.Event | None) -> bool:
        return event is None or event.query()

    def wait_host(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            event.synchronize()

    def wait(self, event: torch.cuda.Event) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """The compute stream waits for a copy; timing events around the wait when it may stall."""
        if event.query():
            return None  # landed already: later compute work sees it
        compute = self._compute()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(compute)
        compute.wait_event(event)
        end.record(compute)
        return start, end

    def use(self, tensor: Tensor, event: torch.cuda.Event) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """The compute stream takes over a restored tensor (the allocator reuses it only after that use)."""
        tensor.record_stream(self._compute())
        return self.wait(event)

    def synchronize(self) -> None:
        self.spill_stream.synchronize()
        self.restore_stream.synchronize()
        self.demand_stream.synchronize()


Copies = Union[CpuCopies, CudaCopies]
