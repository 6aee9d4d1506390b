"""Forward hooks that stream a module's kernels: fetch before, placeholders after.

`KernelHooks` puts a pre-hook on each kernel's module that asks the current
source for `fetch(position)` (the executor, or a timing wrapper around it)
and points the kernel's parameters at what it returns (views of the packed
block, engine/modules/packing.py); a post-hook points
them back at placeholders, so no reference outlives the kernel and the pool
reuses the memory. A kernel that did not run in the recording, or runs out of
the recorded order, is a schedule divergence named by its kernel.

Between kernels a streamed parameter's data is a NaN scalar expanded to its
shape on the compute device: dtype, shape and device queries still answer,
and a read that escaped the recording poisons the output instead of reading
stale memory.

`bound(source)` is the other way to run: every kernel's weights fetched once
from a source that keeps them (every weight resident) and pointed at for good,
and the hooks of the kernels that ran taken off, so a forward is the plain
module's, with none of the hooks' host work. A kernel the recording never ran
keeps its hook, and still fails loudly.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import torch
from torch import nn

from engine.errors import ExecutorError
from engine.modules.kernels import ModuleKernel
from engine.modules.packing import SUFFIX, Part, unpacker
from engine.policy import AccessOrder

RE_RECORD = ("the forward takes another path than the example inputs did: remove the offload "
             "(handle.remove()) and offload or record again with inputs that take this path")


class KernelSource(Protocol):
    def fetch(self, position: int) -> Mapping[str, torch.Tensor]: ...


def placeholder(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A NaN (0 for integers) scalar expanded to `p`'s shape on `device`: no memory."""
    fill = float("nan") if p.dtype.is_floating_point else 0
    return torch.full((), fill, dtype=p.dtype, device=device).expand(p.shape)


class KernelHooks:
    """Hooks streaming `kernels` in `order`; `forward(source)` scopes one forward."""

    def __init__(self, root: nn.Module, kernels: Sequence[ModuleKernel], order: AccessOrder,
                 placeholders: Mapping[int, torch.Tensor], parts: Mapping[str, Sequence[Part]]):
        self.root = root
        self.parts = parts
        self.order = order
        self.placeholders = placeholders
        self.source: KernelSource | None = None
        self.position = 0
        # Training with activation checkpointing: a kernel run again in backward (outside a
        # forward) gets its weights from recompute(name); they stay in place after it, as
        # the recomputed graph holds the parameters themselves until its backward, and go
        # back to placeholders at `release_recomputed` (the step's end). A checkpoint that
        # calls the block's forward directly (transformers >= 5) skips the block's hooks:
        # its children's pre-hooks point the block instead.
        self.recompute: Callable[[str], Mapping[str, torch.Tensor]] | None = None
        self._recomputing: set[str] = set()
        self._recomputed: set[str] = set()  # pointed by recompute since the last release
        ran = set(order.kernels)
        self._param_placeholders = {k.name: [(p, placeholders[id(p)]) for p in k.params.values()] for k in kernels
                           if k.name in ran}
        self._points = {k.name: self._pointer(k) for k in kernels if k.name in ran}
        self._ran = [k for k in kernels if k.name in ran]
        self._handles: list[Any] = []  # the hooks of the kernels that ran: off while bound
        self._never_handles = [k.module.register_forward_pre_hook(self._never(k))
                               for k in kernels if k.name not in ran]
        self._install()

    def _install(self) -> None:
        for k in self._ran:
            point = self._points[k.name]
            self._handles.append(k.module.register_forward_pre_hook(self._pre(k, point)))
            self._handles.append(k.module.register_forward_hook(self._post(k)))
            for child in k.module.children():
                self._handles.append(child.register_forward_pre_hook(self._recompute_from_child(k, point)))

    def _take_off(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pointer(self, k: ModuleKernel) -> Callable[[Mapping[str, torch.Tensor]], None]:
        """Points `k`'s parameters at a fetch's weights (views of its packed block)."""
        packed = k.name + SUFFIX
        parts = self.parts.get(packed, ())
        unpack = unpacker(parts) if parts else None
        targets = [k.params[part.weight] for part in parts]
        params = list(k.params.items())

        def point(weights: Mapping[str, torch.Tensor]) -> None:
            if unpack is not None:
                for p, view in zip(targets, unpack(weights[packed])):
                    p.data = view
            else:
                for w, p in params:
                    p.data = weights[w]
        return point

    def _recompute_from_child(self, k: ModuleKernel, point: Callable[[Mapping[str, torch.Tensor]], None]) -> Any:
        def hook(m: nn.Module, inputs: Any) -> None:
            if self.source is None and self.recompute is not None and k.name not in self._recomputing:
                self._recomputing.add(k.name)
                self._recomputed.add(k.name)
                point(self.recompute(k.name))
        return hook

    def _pre(self, k: ModuleKernel, point: Callable[[Mapping[str, torch.Tensor]], None]) -> Any:
        def hook(m: nn.Module, inputs: Any) -> None:
            if self.source is None and self.recompute is not None:
                self._recomputing.add(k.name)
                self._recomputed.add(k.name)
                point(self.recompute(k.name))
                return
            if self.source is None:
                raise ExecutorError(f"{k.name} was called on its own; its weights stream only inside a forward "
                                    f"of the offloaded {type(self.root).__name__}: call that module, or "
                                    "handle.remove() first")
            pos = self.position
            if pos >= len(self.order) or self.order.kernels[pos] != k.name:
                expected = self.order.kernels[pos] if pos < len(self.order) else "the end of the forward"
                raise ExecutorError(f"schedule divergence at kernel {pos}: {k.name} ran where the recording "
                                    f"ran {expected}; {RE_RECORD}")
            point(self.source.fetch(pos))
            self.position = pos + 1
        return hook

    def _post(self, k: ModuleKernel) -> Any:
        params = self._param_placeholders[k.name]

        def hook(m: nn.Module, inputs: Any, output: Any) -> None:
            if k.name in self._recomputing:
                self._recomputing.discard(k.name)
                return
            for p, ph in params:
                p.data = ph
        return hook

    def release_recomputed(self) -> int:
        """After a training step's backward: the parameters recompute pointed go back to
        their placeholders. Left in place they would hold the weights they view (a
        recorder's device copies: the whole model by the step's end) or view a pool block
        that is reused. Returns the bytes they viewed."""
        viewed = 0
        for name in self._recomputed:
            for p, ph in self._param_placeholders[name]:
                viewed += p.numel() * p.element_size()
                p.data = ph
        self._recomputed.clear()
        return viewed

    def _never(self, k: ModuleKernel) -> Any:
        def hook(m: nn.Module, inputs: Any) -> None:
            raise ExecutorError(f"schedule divergence: {k.name} ran but did not run in the recording forward; "
                                f"{RE_RECORD}")
        return hook

    @contextmanager
    def forward(self, source: KernelSource) -> Iterator[None]:
        """One forward of the root module, its kernels fetched from `source`."""
        if self.source is not None:
            raise ExecutorError(f"a forward of the offloaded {type(self.root).__name__} is already running "
                                "(a forward that calls itself, or another thread); run one at a time")
        self.source, self.position = source, 0
        self._recomputing.clear()  # last step's recomputed kernels: this forward points them afresh
        try:
            yield
            if self.position != len(self.order):
                missing = self.order.kernels[self.position]
                raise ExecutorError(f"schedule divergence: the forward ended after {self.position} of "
                                    f"{len(self.order)} kernels ({missing} did not run); {RE_RECORD}")
        finally:
            self.source = None

    @contextmanager
    def bound(self, source: KernelSource) -> Iterator[None]:
        """Every kernel's weights fetched once from `source` (one that keeps them: an executor
        with every weight resident) and bound, the hooks of the kernels that ran off: inside,
        a forward runs the plain module. On exit the hooks are back and the parameters point
        at placeholders again."""
        if self.source is not None:
            raise ExecutorError(f"a forward of the offloaded {type(self.root).__name__} is running; bind its "
                                "weights between forwards")
        for position, name in enumerate(self.order.kernels):
            self._points[name](source.fetch(position))
        self._take_off()
        try:
            yield
        finally:
            for k in self._ran:
                for p in k.params.values():
                    p.data = self.placeholders[id(p)]
            self._install()

    def remove(self) -> None:
        self._take_off()
        for h in self._never_handles:
            h.remove()
        self._never_handles.clear()
