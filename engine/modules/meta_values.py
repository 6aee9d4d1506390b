"""The values a forward reads off its tensors on the meta device, which holds none.

A synthesized forward (engine/modules/synthesize.py) runs on the meta device with inputs
whose masks are all ones. Where the forward reads a value it takes the one those inputs
give: a truth test of a boolean reads True (transformers' checks on a mask before it builds
one: no packed sequences in the position ids, every token attended), and a mask selects
every element (`nonzero`, `x[mask]`: a processor gathering a prompt's valid tokens by its
mask gathers them all). A mask made of zeros (`torch.zeros`, `zeros_like`, `new_zeros`,
`full` of 0), its views and casts, and the negation of a mask of ones select none, so
`cat([x[mask], x[~mask]])`, a prompt's valid tokens then its padding, keeps the prompt's
length. Any other value still fails (a data-dependent shape or size).

On a GPU a selection by mask synchronizes the host with the device: `syncs` are the
positions the host would wait at, as the recorder counts them (engine/modules/record.py
host_syncs). Inside, torch.autocast on the meta device is a no-op (`MetaAutocast`).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

META = torch.device("meta")
_aten = torch.ops.aten
_ZEROS = {_aten.zeros.default, _aten.zeros_like.default, _aten.new_zeros.default}
_FULL = {_aten.full.default, _aten.full_like.default, _aten.new_full.default}  # zeros where the value is 0
_SAME_VALUES = {_aten._to_copy.default, _aten.clone.default, _aten.view.default, _aten._unsafe_view.default,
                _aten.unsqueeze.default, _aten.squeeze.dim, _aten.expand.default, _aten.slice.Tensor,
                _aten.select.int, _aten.alias.default, _aten.detach.default, _aten.unbind.int, _aten.t.default,
                _aten.transpose.int, _aten.permute.default, _aten.contiguous.default}
_NEGATIONS = {_aten.bitwise_not.default, _aten.logical_not.default}
_AUTOCAST = torch.autocast


class MetaValues(TorchDispatchMode):
    """The values a forward reads on the meta device (module docstring); `position()` is the
    record running, for `syncs` (the record after it)."""

    def __init__(self, position: Callable[[], int] = lambda: -1):
        super().__init__()
        self.position = position
        self.syncs: set[int] = set()
        self._zeros: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is _aten._local_scalar_dense.default and args[0].is_meta and args[0].dtype == torch.bool:
            return True
        if func is _aten.nonzero.default and args[0].is_meta:
            self.syncs.add(self.position() + 1)
            found = 0 if self._is_zero(args[0]) else args[0].numel()
            return torch.empty((found, args[0].dim()), dtype=torch.long, device=META)
        if func is _aten.index.Tensor and args[0].is_meta and any(_is_mask(i) for i in args[1]):
            # x[mask]: index's own meta kernel runs the mask's nonzero, out of this mode's sight
            indices = []
            for i in args[1]:
                if _is_mask(i):
                    self.syncs.add(self.position() + 1)
                    found = 0 if self._is_zero(i) else i.numel()
                    indices += [torch.empty(found, dtype=torch.long, device=META)] * i.dim()
                else:
                    indices.append(i)
            return func(args[0], indices)
        out = func(*args, **(kwargs or {}))
        self._track(func, args, out)
        return out

    def _track(self, func: Any, args: tuple, out: Any) -> None:
        """Note `out` as all zeros where `func` makes it so from `args`."""
        if func in _ZEROS:
            zero = True
        elif func in _FULL:
            zero = _is_zero_scalar(args[-1] if func is not _aten.new_full.default else args[2])
        elif func in _SAME_VALUES:
            zero = isinstance(args[0], torch.Tensor) and self._is_zero(args[0])
        elif func in _NEGATIONS:
            zero = isinstance(args[0], torch.Tensor) and args[0].dtype == torch.bool and not self._is_zero(args[0])
        else:
            return
        if zero:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.is_meta:
                    self._zeros[id(t)] = weakref.ref(t)

    def _is_zero(self, t: torch.Tensor) -> bool:
        ref = self._zeros.get(id(t))
        return ref is not None and ref() is t

    def __enter__(self) -> "MetaValues":
        torch.autocast = torch.amp.autocast = MetaAutocast
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.autocast = torch.amp.autocast = _AUTOCAST
        return super().__exit__(*exc)


def _is_mask(index: Any) -> bool:
    """A boolean index tensor (x[mask]) on the meta device."""
    return isinstance(index, torch.Tensor) and index.is_meta and index.dtype in (torch.bool, torch.uint8)


def _is_zero_scalar(value: Any) -> bool:
    return isinstance(value, (bool, int, float)) and value == 0


class MetaAutocast(_AUTOCAST):
    """torch.autocast, but a no-op on the meta device, which autocast refuses: models that pin a
    region's dtype (Mochi's rotary embedding at float32, Helios' and others' with autocast off)
    by their tensors' device type. On meta only the shapes and dtypes the region's own ops give
    count, and the synthesized forward runs under no autocast to leave."""

    def __init__(self, device_type: str, *args: Any, **kwargs: Any):
        self._meta = device_type == "meta"
        if not self._meta:
            super().__init__(device_type, *args, **kwargs)

    def __enter__(self) -> Any:
        return None if self._meta else super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return None if self._meta else super().__exit__(*exc)

    def __call__(self, func: Any) -> Any:
        return func if self._meta else super().__call__(func)
