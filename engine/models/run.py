"""The forward's side of the fetch contract, and the sources weights come from.

`engine.models.forward` walks `spec.kernels` in order: before the math of
kernel i it calls `source.fetch(i)` exactly once (weightless kernels too), and
it may use only the tensors that fetch returned, only until the next fetch
(the executor may evict them then). `Run` enforces both rules: a kernel out of
order, a weight used outside its kernel, a weight the kernel does not read, or
a declared weight left unused raises `ScheduleError`; a weight the source did
not hand over raises `MissingWeightError`.
"""
from __future__ import annotations

from typing import Any, Mapping, Protocol

import torch
import torch.nn.functional as F

from engine.models.spec import ModelSpec

TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}

Tensor = torch.Tensor


class WeightSource(Protocol):
    def fetch(self, kernel_index: int) -> Mapping[str, Tensor]:
        """The tensors (by weight name) that kernel `kernel_index` of `spec.kernels` reads."""


class MissingWeightError(LookupError):
    """A kernel needs a weight that its source did not hand over."""


class ScheduleError(RuntimeError):
    """The forward and the spec disagree on kernels or on which weights a kernel reads."""


class DictSource:
    """Everything resident: a WeightSource over a plain `{name: tensor}` dict."""

    def __init__(self, spec: ModelSpec, weights: Mapping[str, Tensor]):
        self.spec = spec
        self.weights = weights

    def fetch(self, kernel_index: int) -> Mapping[str, Tensor]:
        kernel = self.spec.kernels[kernel_index]
        missing = [n for n in kernel.weights if n not in self.weights]
        if missing:
            raise MissingWeightError(f"kernel {kernel.name} reads {missing[0]}, which the weight dict lacks; "
                                     "load the full checkpoint or use random_weights(spec)")
        return {n: self.weights[n] for n in kernel.weights}


class KernelWeights:
    """One kernel's fetched tensors, usable until the next kernel is fetched."""

    def __init__(self, spec: ModelSpec, index: int, fetched: Mapping[str, Tensor]):
        self.spec = spec
        self.kernel = spec.kernels[index]
        self.fetched = fetched
        self.used: set[str] = set()
        self.open = True

    def __getitem__(self, name: str) -> Tensor:
        k = self.kernel
        if not self.open:
            raise ScheduleError(f"weight {name} of kernel {k.name} used after the next kernel was fetched")
        if name not in k.weights:
            raise ScheduleError(f"kernel {k.name} does not read {name}; fix the spec builder or engine.models")
        if name not in self.fetched:
            raise MissingWeightError(f"kernel {k.name} needs {name} but its source returned none; "
                                     "the source must hand over every weight of the kernel")
        t = self.fetched[name]
        want = self.spec.weights[name].shape
        if tuple(t.shape) != want:
            raise ValueError(f"weight {name} has shape {tuple(t.shape)}, the spec says {want}; "
                             "use a checkpoint of this model")
        self.used.add(name)
        return t

    def close(self) -> None:
        unused = [n for n in self.kernel.weights if n not in self.used]
        if unused:
            raise ScheduleError(f"kernel {self.kernel.name} declares {unused[0]} but the forward never used it")
        self.open = False


class Run:
    """One forward pass: the kernel cursor, the LoRA adapters and the model config."""

    def __init__(self, spec: ModelSpec, source: WeightSource, lora: Mapping[str, Tensor] | None):
        self.spec = spec
        self.source = source
        self.lora = lora or {}
        self.lora_used: set[str] = set()
        self.cfg: dict[str, Any] = spec.meta["config"]
        self.eps: float = self.cfg["eps"]
        self.next = 0
        self.current: KernelWeights | None = None

    def kernel(self, name: str) -> KernelWeights:
        kernels = self.spec.kernels
        i = self.next
        if i >= len(kernels) or kernels[i].name != name:
            there = kernels[i].name if i < len(kernels) else "the end"
            raise ScheduleError(f"forward reached kernel {name} but spec.kernels[{i}] is {there}; "
                                "the spec builder and engine.models disagree")
        if self.current is not None:
            self.current.close()
        self.current = KernelWeights(self.spec, i, self.source.fetch(i))
        self.next += 1
        return self.current

    def linear(self, w: KernelWeights, module: str, x: Tensor, bias: bool = True) -> Tensor:
        y = F.linear(x, w[f"{module}.weight"], w[f"{module}.bias"] if bias else None)
        if f"{module}.lora_A" in self.lora:
            self.lora_used.add(module)
            y = y + F.linear(F.linear(x, self.lora[f"{module}.lora_A"]), self.lora[f"{module}.lora_B"])
        return y

    def finish(self) -> None:
        if self.current is not None:
            self.current.close()
        if self.next != len(self.spec.kernels):
            raise ScheduleError(f"forward ran {self.next} of {len(self.spec.kernels)} kernels; "
                                f"next is {self.spec.kernels[self.next].name}")
        unused = sorted({k.rsplit(".", 1)[0] for k in self.lora} - self.lora_used)
        if unused:
            raise ScheduleError(f"LoRA adapter {unused[0]} matches no linear of {self.spec.name}; "
                                "build it with init_lora(spec, ...)")
