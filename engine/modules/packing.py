"""One copy per kernel: a kernel's weights as one contiguous span of bytes.

A block of a real model has dozens of parameters; fetched one by one, each is a
policy decision, a pool allocation and a small copy, and the host falls behind
the GPU. Packed, the kernel reads one weight, `<kernel>.*`: a span of host
bytes holding all its parameters, copied in one piece into one pool block, its
parameters views of that block at their offsets.

The span is where the parameters already lie together: in a checkpoint shard
(safetensors stores a module's tensors next to each other) when they fill at
least PACKED_FILL of it and each lies a multiple of PART_ALIGN bytes from the
first, else in one pinned buffer packed kernel by kernel at ALIGN. Pool blocks
start ALIGN-aligned, so every parameter is at least PART_ALIGN-aligned on the
device, as the allocator's own are: kernels that pick code paths by pointer
alignment (vector widths up to 64 bytes) run as on the resident model, and the
outputs stay bitwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from engine.policy import AccessOrder

ALIGN = 256  # bytes: the caching allocator's alignment, which the resident model's parameters have
PART_ALIGN = 64  # bytes: the widest alignment a kernel's code path depends on (AVX-512; CUDA needs 16)
PACKED_FILL = 0.95  # the kernel's bytes over the span's: under this a span copies too much else
SUFFIX = ".*"


@dataclass(frozen=True)
class Part:
    """Where a weight lies in its kernel's packed span."""

    weight: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def view(self, block: torch.Tensor) -> torch.Tensor:
        return block[self.offset:self.offset + self.nbytes].view(self.dtype).view(self.shape)


@dataclass(frozen=True)
class Packed:
    """The packed order, the host span per packed weight, and each span's parts."""

    order: AccessOrder
    host: dict[str, torch.Tensor]
    parts: dict[str, tuple[Part, ...]]  # packed weight -> its parameters
    copied_bytes: int  # bytes copied into the buffer (the rest are views of the checkpoint mappings)


def unpacker(parts: Sequence[Part]) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    """A function from a packed block (uint8) to its parts' views, in `parts` order.
    Parts of one dtype (the common case) cost one typed view of the block plus one
    `as_strided` each, instead of three views each: this runs once a kernel a step."""
    dtypes = {p.dtype for p in parts}
    item = next(iter(dtypes)).itemsize if len(dtypes) == 1 else 0
    if not item or any(p.offset % item for p in parts):
        return lambda block: [p.view(block) for p in parts]
    dtype = next(iter(dtypes))
    layout = [(p.shape, _contiguous_strides(p.shape), p.offset // item) for p in parts]

    def views(block: torch.Tensor) -> list[torch.Tensor]:
        typed = block.view(dtype)
        base = typed.storage_offset()
        return [typed.as_strided(shape, stride, base + offset) for shape, stride, offset in layout]
    return views


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _part(weight: str, offset: int, t: torch.Tensor) -> Part:
    return Part(weight, offset, t.numel() * t.element_size(), t.dtype, tuple(t.shape))


def _in_file(weights: tuple[str, ...], host: Mapping[str, torch.Tensor],
             locate: Callable[[str], tuple[object, int, torch.Tensor]]) -> tuple[torch.Tensor, tuple[Part, ...]] | None:
    """The span of one checkpoint mapping holding `weights`, if they fill it."""
    where = [locate(w) for w in weights]
    files = {id(f) for f, _, _ in where}
    if len(files) != 1:
        return None
    start = min(b for _, b, _ in where)
    end = max(b + host[w].numel() * host[w].element_size() for w, (_, b, _) in zip(weights, where))
    used = sum(host[w].numel() * host[w].element_size() for w in weights)
    if used < PACKED_FILL * (end - start):
        return None
    parts = []
    for w, (_, b, _) in zip(weights, where):
        t = host[w]
        if (b - start) % PART_ALIGN:
            return None
        parts.append(_part(w, b - start, t))
    return where[0][2][start:end], tuple(parts)


def pack_kernels(order: AccessOrder, host: Mapping[str, torch.Tensor],
                 locate: Callable[[str], tuple[object, int, torch.Tensor]] | None,
                 buffer: Callable[[int], torch.Tensor]) -> Packed:
    """Each kernel reading two or more weights reads one packed weight instead.

    `locate(w)`, for weights in a checkpoint mapping: (its file, its byte offset in
    the mapping, the whole mapping as uint8). A kernel whose weights fill a span of
    one file reads that span; every other kernel's weights (all of them, without
    `locate`) are copied into one `buffer(nbytes)`, kernel by kernel."""
    groups: dict[str, tuple[str, ...]] = {}
    for name, reads in zip(order.kernels, order.reads):
        if len(reads) > 1:
            groups.setdefault(name + SUFFIX, tuple(reads))
        elif reads:
            groups.setdefault(reads[0], tuple(reads))  # one weight: its own name
    spans: dict[str, torch.Tensor] = {}
    parts: dict[str, tuple[Part, ...]] = {}
    copied: list[tuple[str, tuple[str, ...]]] = []
    for packed, weights in groups.items():
        if locate is not None and len(weights) == 1:
            spans[packed] = host[weights[0]]
            continue
        found = _in_file(weights, host, locate) if locate is not None else None
        if found is None:
            copied.append((packed, weights))
        else:
            spans[packed], parts[packed] = found
    layout: dict[str, tuple[int, int]] = {}
    total = 0
    for packed, weights in copied:
        begin = total
        own = []
        for w in weights:
            t = host[w]
            own.append(_part(w, total - begin, t))
            total += -(-(t.numel() * t.element_size()) // ALIGN) * ALIGN
        layout[packed] = (begin, total)
        if len(weights) > 1:
            parts[packed] = tuple(own)
    if copied:
        buf = buffer(total)
        for packed, weights in copied:
            begin, end = layout[packed]
            if packed in parts:
                spans[packed] = buf[begin:end]
                for p in parts[packed]:
                    p.view(spans[packed]).copy_(host[p.weight])
            else:
                t = host[weights[0]]
                spans[packed] = buf[begin:begin + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                spans[packed].copy_(t)
    reads = tuple((name + SUFFIX,) if len(r) > 1 else tuple(r) for name, r in zip(order.kernels, order.reads))
    sizes = {w: t.numel() * t.element_size() for w, t in spans.items()}
    return Packed(AccessOrder(order.kernels, reads, sizes), spans, parts, total)


def weight_views(packed: Packed) -> dict[str, torch.Tensor]:
    """Every original weight's host tensor, a view of its span."""
    out = {}
    for w, t in packed.host.items():
        if w in packed.parts:
            out.update({p.weight: p.view(t) for p in packed.parts[w]})
        else:
            out[w] = t
    return out
