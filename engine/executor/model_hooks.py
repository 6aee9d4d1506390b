"""Where a model meets the activation offloader: which kernel or layer runs,
and weights autograd saves that stay on the device.

- `KernelTracking` wraps a spec model's WeightSource: each kernel's fetch tells
  the offloader the kernel and its layer, so saved tensors carry the kernel's
  name and layer boundaries reach the policy where the simulator asks them;
- `layer_boundary` (or `ActivationOffloader.layer_hooks`) marks the layers of
  any model;
- `ResidentWeights` holds saved views of weights that stay on the device as
  handles (ManagedWeights), so autograd never holds them as activations.
"""
from __future__ import annotations

from typing import Any, Hashable, Mapping

import torch

from engine.errors import ExecutorError
from engine.executor.offloader import ActivationOffloader
from engine.models.spec import ModelSpec

Tensor = torch.Tensor


class ResidentWeights:
    """ManagedWeights for weights that stay on the device (a DictSource, or a module's
    weights bound into packed blocks, several to a storage): the handle is a weight of
    the viewed storage and dtype, and the view's geometry over it."""

    def __init__(self, weights: Mapping[str, Tensor]):
        self.weights = weights
        self._by_view = {(t.untyped_storage().data_ptr(), t.dtype): name for name, t in weights.items()}
        self._by_storage = {ptr: name for (ptr, _), name in self._by_view.items()}

    def handle(self, tensor: Tensor) -> Hashable | None:
        if tensor.requires_grad:
            return None  # a frozen weight's view never requires grad: an activation (the common case)
        ptr = tensor.untyped_storage().data_ptr()
        name = self._by_view.get((ptr, tensor.dtype))
        if name is None:
            other = self._by_storage.get(ptr)
            if other is None:
                return None
            raise ExecutorError(f"a saved tensor views weight {other} as {tensor.dtype} (the weight is "
                                f"{self.weights[other].dtype}); ResidentWeights rebuilds views of the weight's own "
                                "dtype only")
        w = self.weights[name]
        return name, tuple(tensor.shape), tensor.stride(), tensor.storage_offset() - w.storage_offset()

    def fetch(self, handle: Hashable) -> Tensor:
        name, size, stride, offset = handle
        w = self.weights[name]
        return w.as_strided(size, stride, w.storage_offset() + offset)


class KernelTracking:
    """A WeightSource that tells the offloader which spec kernel runs next, so
    saved tensors carry the kernel's name and layer, and layer boundaries reach
    the policy where the simulator asks them (engine.models calls fetch(i) once
    per kernel, before its math)."""

    def __init__(self, source: Any, spec: ModelSpec, offloader: ActivationOffloader):
        self.source = source
        self.kernels = spec.kernels
        self.offloader = offloader

    def fetch(self, kernel_index: int) -> Mapping[str, Tensor]:
        k = self.kernels[kernel_index]
        self.offloader.on_kernel(k.name, k.layer)
        return self.source.fetch(kernel_index)


class _LayerBoundary(torch.autograd.Function):
    """Identity whose forward enters a layer and whose backward says the layer's backward is done."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, layer: int, offloader: ActivationOffloader) -> Tensor:
        ctx.offloader = offloader
        ctx.boundary = offloader.enter_layer(layer)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        ctx.offloader.layer_backward_done(ctx.boundary)
        return grad, None, None


def layer_boundary(x: Tensor, layer: int, offloader: ActivationOffloader) -> Tensor:
    """Call on a layer's input as the layer starts: `x = layer_boundary(x, i, off)`.

    Forward: the following saves belong to `layer`. Backward: once the gradient
    of `x` is computed (the layer's backward is done), the policy hears
    on_layer_end("bwd", layer), which is when sync mode issues its reloads."""
    return _LayerBoundary.apply(x, layer, offloader)
