"""The activation bytes a spec's forward keeps alive at its peak, traced on the meta device.

The simulator counts the weights a step holds (the pool) and the tensors training
saves; what else the forward allocates comes and goes inside it: each kernel's
inputs and outputs, its norms' and epilogues' temporaries, the residual streams,
the step's inputs (a decode's KV cache). `activation_peak_bytes` runs the spec's
own forward (engine/models/<family>.py) on meta tensors, which allocate nothing,
and counts the bytes of every live storage an op made, plus the inputs, at each
op: the most at any one time is what torch's allocator holds beside the weights.
Attention counts as the fused kernel the GPU runs (its output only), not the
score matrix the meta device's reference implementation would build.

A model's repeated blocks hold the same bytes each, so the trace runs its family's
shortest model with every kind of block (`engine.models.shortest`) and adds the
inputs the cut blocks would read (a decode's KV cache is one per layer).
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engine.models.run import TORCH_DTYPES, DictSource
from engine.models.seeded import Draw
from engine.models.spec import ModelSpec, WorkloadShape

META = torch.device("meta")


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops made that a tensor still refers to, and their peak, over
    `held` (tensors alive all along: their bytes count once, their views not again)."""

    def __init__(self, held: list[torch.Tensor]):
        super().__init__()
        self.refs: dict[int, list[int]] = {}  # storage -> [bytes, live tensors on it]
        self.held = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in held}
        self.total = self.peak = 0
        self.paused = False  # ops run meanwhile (a recorder bringing weights in) make nothing counted

    def adopt(self, tensors: list[torch.Tensor]) -> None:
        """Count `tensors` as live from now until they are freed: inputs the forward replaces
        (a KV cache's keys and values, each layer's concatenated anew), not held all along."""
        for t in tensors:
            self._count(t)

    def _count(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.held:
            return
        if key not in self.refs:
            self.refs[key] = [storage.nbytes(), 0]
            self.total += storage.nbytes()
            self.peak = max(self.peak, self.total)
        self.refs[key][1] += 1
        weakref.finalize(t, self._drop, key)

    def _drop(self, key: int) -> None:
        entry = self.refs[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.total -= entry[0]
            del self.refs[key]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._count(t)
        return out


class _FusedAttention(TorchFunctionMode):
    """scaled_dot_product_attention as one fused kernel: it allocates its output only."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is F.scaled_dot_product_attention:
            q, v = args[0], args[2]
            return torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        return func(*args, **(kwargs or {}))


class _MetaDraw(Draw):
    """Inputs of the right shapes and dtypes on the meta device, drawn from nothing."""

    def __init__(self, batch: int, dtype: torch.dtype):
        super().__init__(0, batch, META, dtype)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=self.dtype, device=META)

    def steps(self) -> torch.Tensor:
        return torch.empty(self.batch, device=META)

    def tokens(self, vocab: int, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.long, device=META)


def activation_peak_bytes(spec: ModelSpec, workload: WorkloadShape) -> int:
    """The most bytes the forward of `spec` on `workload`'s inputs holds at once beside
    its weights: its inputs and every live tensor its ops made (module docstring)."""
    from engine.models import shortest

    short = shortest(spec, workload)
    return traced_peak_bytes(short, workload) - _input_bytes(short, workload) + _input_bytes(spec, workload)


def _inputs(spec: ModelSpec, workload: WorkloadShape) -> dict[str, torch.Tensor]:
    from engine.models import architecture

    cfg = spec.meta["config"]
    return architecture(spec).inputs(cfg, workload, _MetaDraw(workload.batch, TORCH_DTYPES[cfg["dtype"]]))


def _input_bytes(spec: ModelSpec, workload: WorkloadShape) -> int:
    return sum(t.untyped_storage().nbytes() for t in _inputs(spec, workload).values())


def traced_peak_bytes(spec: ModelSpec, workload: WorkloadShape) -> int:
    """The peak of `spec`'s own forward with every block of it traced: what
    activation_peak_bytes gives, in time proportional to the model's depth."""
    from engine.models import forward

    weights = {n: torch.empty(w.shape, dtype=TORCH_DTYPES[w.dtype], device=META) for n, w in spec.weights.items()}
    inputs = _inputs(spec, workload)
    live = LiveBytes([*weights.values(), *inputs.values()])
    with torch.no_grad(), live, _FusedAttention():
        forward(spec, DictSource(spec, weights), inputs)
    return live.peak + sum(t.untyped_storage().nbytes() for t in inputs.values())
