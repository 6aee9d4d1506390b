"""Where the host copy of each weight lives (`weights.source`).

- mmap_registered (default): views of the read-only file mapping, registered
  with the backend so H2D copies from it run at pinned speed. The page cache is
  the host copy; nothing is duplicated.
- mmap: the same views, unregistered (pageable-speed copies).
- pinned: one copy of every weight in pinned host memory (small models, tests).
- pageable: one copy in ordinary host memory.
"""
from __future__ import annotations

import logging
import mmap
from typing import Callable, Mapping

import torch

from engine.errors import ExecutorError
from engine.executor.backend import Backend, page_span
from engine.weightfile import WeightFile

log = logging.getLogger(__name__)

SOURCES = ("pinned", "mmap_registered", "mmap", "pageable")


class HostWeights:
    """Host tensors by weight name, and the registration that must outlive the copies."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], backend: Backend, registered: int | None = None):
        self.tensors = dict(tensors)
        self._backend = backend
        self._registered = registered

    def close(self) -> None:
        """Unregister (if registered) and drop the views; call after the executor closed."""
        if self._registered is not None:
            self._backend.unregister(self._registered)
            self._registered = None
        self.tensors.clear()


ALIGN = 64  # bytes; any dtype's view of the packed buffer is aligned


def pageable_buffer(nbytes: int) -> torch.Tensor:
    """Ordinary host bytes (the `buffer` of `pack` for unpinned copies)."""
    return torch.empty(nbytes, dtype=torch.uint8)


def register_file(wf: WeightFile, backend: Backend) -> int:
    """Register `wf`'s whole mapping (page-aligned) with `backend` for DMA; its address,
    for `backend.unregister`. Call before any view exists: a refusal (locked-memory
    limit) then leaves no view in its traceback's frames, and the file can close."""
    address, nbytes = page_span(wf.base_address(), wf.file_bytes, mmap.PAGESIZE)
    backend.register(address, nbytes)
    log.info("registered %d bytes of %s with the %s backend", nbytes, wf.path, backend.name)
    return address


def pack(tensors: Mapping[str, torch.Tensor], buffer: Callable[[int], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copy `tensors` into one host buffer from `buffer(nbytes)`; returns views of it."""
    spans, total = {}, 0
    for name, t in tensors.items():
        spans[name] = total
        total += -(-(t.numel() * t.element_size()) // ALIGN) * ALIGN
    buf = buffer(total)
    out = {}
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        dst = buf[spans[name]:spans[name] + n].view(t.dtype).view(t.shape)
        dst.copy_(t)
        out[name] = dst
    return out


def host_weights(wf: WeightFile, source: str, backend: Backend) -> HostWeights:
    """The host side of every weight in `wf` as `source` says (module docstring)."""
    if source == "mmap":
        return HostWeights(wf.tensors(), backend)
    if source == "mmap_registered":
        address = register_file(wf, backend)
        return HostWeights(wf.tensors(), backend, registered=address)
    if source in ("pinned", "pageable"):
        views = wf.tensors()
        return HostWeights(pack(views, backend.host_buffer if source == "pinned" else pageable_buffer), backend)
    raise ExecutorError(f"weights.source={source!r} is not one of {', '.join(SOURCES)}; pick one of those")
