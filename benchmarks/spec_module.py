"""A spec model as a torch.nn.Module that hook-based offloaders (diffusers, accelerate) can drive.

Hook-based offloaders move a module's parameters in on its `__call__` and out
when it returns, so the math that reads them must run inside that call. The
spec forward (`engine.models.forward`) is one function over the kernel list, so
the module runs it on a worker thread that stops at block boundaries: the
block's `forward` (on the calling thread, inside the hooks) lets the worker run
exactly that block's kernels. Each linear is a real `nn.Linear`, called (inside
a TorchFunctionMode) wherever the spec forward does `F.linear` on its weight,
so leaf-level offloaders see one call per linear. Other weights (norm gains,
scale-shift tables) are direct parameters of their block (or of the root),
as in diffusers' own transformer classes.

The output is the spec forward's, bit for bit, when every parameter is
resident: the same ops in the same order on the same tensors.
"""
from __future__ import annotations

import re
import threading
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from engine.models import forward as spec_forward
from engine.models.spec import ModelSpec

_BLOCK = re.compile(r"^(blocks|double_blocks|single_blocks)\.(\d+)\.")


def _key(name: str) -> str:
    return name.replace(".", "__")


class _Block(nn.Module):
    """One block's weights: its linears (by module path) and its other parameters."""

    def __init__(self, owner: SpecModule, first: int, last: int):
        super().__init__()
        self.linears = nn.ModuleDict()
        self._owner = [owner]  # a list: not a registered submodule
        self.first, self.last = first, last

    def forward(self) -> None:
        self._owner[0]._run_until(self.last + 1)


class _LinearCall(TorchFunctionMode):
    """F.linear on the weight (and bias) an nn.Linear holds now becomes a call of that module."""

    def __init__(self) -> None:
        super().__init__()
        self.by_weight: dict[int, nn.Linear] = {}  # the current kernel's linears, by id of the weight handed out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2:
            lin = self.by_weight.get(id(args[1]))
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if lin is not None and (bias is None) == (lin.bias is None):
                return lin(args[0])
        return func(*args, **kwargs)


class SpecModule(nn.Module):
    """`forward(inputs)` = engine.models.forward(spec, <these parameters>, inputs), under torch.no_grad."""

    def __init__(self, spec: ModelSpec, weights: Mapping[str, torch.Tensor]):
        super().__init__()
        self.spec = spec
        linear_modules = {n[:-len(".weight")] for n, w in spec.weights.items()
                          if n.endswith(".weight") and len(w.shape) == 2 and "scale_shift_table" not in n}
        # Blocks by the spec's kernel names; a weight belongs to the block of the kernel that reads it.
        spans: dict[tuple[str, int], list[int]] = {}
        owner_of: dict[str, tuple[str, int] | None] = {}
        for i, k in enumerate(spec.kernels):
            m = _BLOCK.match(k.name)
            key = (m.group(1), int(m.group(2))) if m else None
            if key is not None:
                spans.setdefault(key, [i, i])[1] = i
            for w in k.weights:
                owner_of.setdefault(w, key)
        lists: dict[str, nn.ModuleList] = {}
        for (group, idx), (first, last) in sorted(spans.items(), key=lambda kv: kv[1][0]):
            lists.setdefault(group, nn.ModuleList()).append(_Block(self, first, last))
        for group, ml in lists.items():
            self.add_module(group, ml)
        self.linears = nn.ModuleDict()
        # weight name -> (module holding it now, attribute, the nn.Linear or None): read at each
        # fetch, since an offloader may replace a Parameter object (accelerate does).
        self._where: dict[str, tuple[nn.Module, str, nn.Linear | None]] = {}
        for name, t in weights.items():
            key = owner_of.get(name)
            holder = self if key is None else getattr(self, key[0])[key[1]]
            module, _, leaf = name.rpartition(".")
            if module in linear_modules:
                lin = holder.linears[_key(module)] if _key(module) in holder.linears else None
                if lin is None:
                    lin = nn.Linear(1, 1, bias=f"{module}.bias" in weights, device="meta")
                    holder.linears[_key(module)] = lin
                setattr(lin, leaf, nn.Parameter(t, requires_grad=False))
                if leaf == "weight":
                    lin.in_features, lin.out_features = t.shape[1], t.shape[0]
                self._where[name] = (lin, leaf, lin)
            else:
                holder.register_parameter(_key(name), nn.Parameter(t, requires_grad=False))
                self._where[name] = (holder, _key(name), None)
        self._blocks = [b for ml in lists.values() for b in ml]
        self._blocks.sort(key=lambda b: b.first)
        self._mode = _LinearCall()
        self._go = threading.Semaphore(0)
        self._paused = threading.Semaphore(0)
        self._stop = 0
        self._abort = False
        self._job: dict | None = None
        self._error: BaseException | None = None
        self._worker: threading.Thread | None = None

    # The worker side: one long-lived thread (a new thread per forward would build new
    # cuBLAS/cuDNN handles and workspaces every step), running the spec forward and
    # pausing before kernel `_stop`.
    def fetch(self, i: int) -> dict[str, torch.Tensor]:
        while i >= self._stop:  # a kernel past the stop runs only after the next go
            self._paused.release()
            self._go.acquire()
            if self._abort:
                raise RuntimeError("forward abandoned by the calling thread")
        out = {}
        self._mode.by_weight.clear()
        for w in self.spec.kernels[i].weights:
            module, attr, lin = self._where[w]
            out[w] = t = getattr(module, attr)
            if lin is not None and attr == "weight":
                self._mode.by_weight[id(t)] = lin
        return out

    def _serve(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        while True:
            self._go.acquire()
            job = self._job
            if job is None:
                return
            try:
                with torch.no_grad(), self._mode:
                    job["out"] = spec_forward(self.spec, self, job["inputs"])
            except BaseException as err:  # handed to the calling thread
                self._error = err
            finally:
                self._stop = len(self.spec.kernels) + 1
                self._paused.release()

    def _run_until(self, stop: int) -> None:
        self._stop = stop
        self._go.release()
        self._paused.acquire()
        if self._error is not None:
            raise self._error

    def forward(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self._worker is None:
            device = next(iter(inputs.values())).device
            self._worker = threading.Thread(target=self._serve, args=(device,), daemon=True)
            self._worker.start()
        self._job, self._error, self._stop = {"inputs": inputs}, None, 0
        try:
            for block in self._blocks:
                self._run_until(block.first)
                block()
            self._run_until(len(self.spec.kernels) + 1)
        except BaseException:
            if self._error is None:  # failed on this side: the worker waits in fetch; end its forward
                self._abort = True
                self._go.release()
                self._paused.acquire()
                self._abort = False
            raise
        finally:
            self._error = None
        return self._job.pop("out")

    def close(self) -> None:
        """End the worker thread (it holds the module)."""
        if self._worker is not None:
            self._job = None
            self._go.release()
            self._worker.join()
            self._worker = None
