"""A module made streamable: host copies, placeholders, the recorded order, the hooks.

`StreamedModule(module, example_inputs, ...)` does everything `offload` and
`record` share, in this order, and `remove()` undoes it:

1. partition the module into kernels (engine/modules/kernels.py);
2. the host side of every streamed weight: views of a checkpoint's mappings,
   registered for DMA (`checkpoint=`; the module may be built on the meta
   device, it is never materialized on the host), or one pinned copy of the
   module's own CPU parameters; kept parameters and buffers go to the device;
3. placeholders where the streamed parameters were;
4. one recording forward (each kernel's weights copied in on demand, so the
   model never has to fit on the device): the access order, and parameters read
   outside their kernel, which stay resident from then on;
5. each kernel's weights packed into one span, one copy a fetch
   (engine/modules/packing.py);
6. the hooks that stream each kernel from a source (the executor, or a timer);
   `bind(executor)` instead binds every weight once and takes them off.
"""
from __future__ import annotations

import logging
import time
import traceback
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from engine.errors import ExecutorError, WeightFileError
from engine.executor.runtime import WeightExecutor, host_registrar
from engine.executor.sources import pageable_buffer, register_file
from engine.modules.checkpoint import Checkpoint, module_weights, state_dict_name
from engine.modules.hooks import KernelHooks, placeholder
from engine.modules.kernels import Recording, buffer_bytes, forward_live_bytes, partition, record_order, weight_names
from engine.modules.packing import pack_kernels, weight_views
from engine.units import MB

log = logging.getLogger(__name__)


@contextmanager
def stage(times: dict[str, float], name: str) -> Iterator[None]:
    """Adds the seconds the block takes to times[name] (a set-up's breakdown)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        times[name] = round(times.get(name, 0.0) + time.perf_counter() - t0, 3)


def call_args(example_inputs: Any) -> tuple[tuple, dict]:
    """Positional and keyword arguments from a tuple, a dict, or one tensor (one argument, never its rows)."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    return tuple(example_inputs), {}


class _Restore:
    """Where every parameter and buffer of the module lived, to put them back."""

    def __init__(self, module: nn.Module):
        self.params = {id(p): (p, p.device, p.data) for p in module.parameters()}
        self.slots = [(m, name, p) for m in module.modules() for name, p in m._parameters.items() if p is not None]
        self.buffers = [(m, name, b) for m in module.modules() for name, b in m._buffers.items() if b is not None]
        self.host: dict[int, torch.Tensor] = {}  # param id -> its host copy (streamed ones)

    def stream(self, host: dict[int, torch.Tensor]) -> None:
        """These parameters now live in `host`: forget their original data (device
        memory that must go back to the pool, or the CPU copy just packed)."""
        self.host = host
        for key in host:
            p, device, _ = self.params[key]
            self.params[key] = (p, device, None)

    def restore(self) -> None:
        for m, name, p in self.slots:
            m._parameters[name] = p
        for key, (p, device, original) in self.params.items():
            if p.is_meta:
                continue
            host = self.host.get(key)
            if host is None:
                p.data = original
            elif device.type == "cpu":
                p.data = host.clone()  # out of the shared (pinned) buffer or the read-only mapping
            else:
                p.data = host.to(device)
        for m, name, b in self.buffers:
            m._buffers[name] = b
        self.host = {}  # views of a checkpoint's mapping: dropped, so it can close


class StreamedModule:
    """`module` with its kernels streamable (module docstring); `remove()` puts it back."""

    def __init__(self, module: nn.Module, example_inputs: Any, *, device: torch.device, backend: str,
                 grouping: str = "block", blocks: Sequence[str] | None = None,
                 checkpoint: str | Path | None = None, source: str = "mmap_registered", training: bool = False,
                 loaded: Callable[[], None] | None = None):
        self.module = module
        self.device = device
        self.grouping = grouping
        self.args, self.kwargs = call_args(example_inputs)
        self._restore = _Restore(module)
        self._holder = host_registrar(backend)  # keeps the host registration for every executor
        self._registered: list[int] = []
        self._checkpoint: Checkpoint | None = None
        self._loaded = loaded
        self.hooks: KernelHooks | None = None
        # Seconds per set-up stage: map, register, order (the recording forward), pack, hooks;
        # offload adds record, simulate and executor.
        self.setup_s: dict[str, float] = {}
        try:
            self._setup(grouping, blocks, checkpoint, source, training)
        except BaseException as err:
            # The failure's frames hold views of the mapping; cleared, the checkpoint can close.
            traceback.clear_frames(err.__traceback__)
            self.remove()
            raise

    def _setup(self, grouping: str, blocks: Sequence[str] | None, checkpoint: str | Path | None,
               source: str, training: bool) -> None:
        module, device = self.module, self.device
        files = None
        if checkpoint is not None:
            with stage(self.setup_s, "map"):
                self._checkpoint = Checkpoint(checkpoint, module_weights(module, frozen_only=training))
                files = self._checkpoint.tensors()
        unfilled = [n for n, p in module.named_parameters()
                    if p.is_meta and (files is None or state_dict_name(n) not in files)]
        if unfilled and files is None:
            raise ExecutorError(f"this {type(module).__name__} has parameters on the meta device and no "
                                "checkpoint; pass checkpoint=PATH (safetensors file or model directory)")
        if unfilled:
            raise ExecutorError(f"{unfilled[0]} is on the meta device and not in the checkpoint (a trainable "
                                "adapter?); create adapters with real weights before offloading")
        self._materialize_meta()
        kernels, kept = partition(module, grouping, blocks, keep_trainable=training)
        names = weight_names(module)
        streamed = {id(p): p for k in kernels for p in k.params.values()}
        if files is not None:
            if source == "mmap_registered":
                with stage(self.setup_s, "register"):
                    self._register()
            host = {names[k]: files[names[k]] for k in streamed}
        else:  # the module's own data, on the host until packed (device copies are freed now)
            host = {names[k]: p.data if p.device.type == "cpu" else p.data.cpu() for k, p in streamed.items()}
        self.placeholders = {k: placeholder(p, device) for k, p in streamed.items()}
        for k, p in streamed.items():
            p.data = self.placeholders[k]
        for p in kept:
            saved = files.get(names[id(p)]) if files is not None else None
            # From the checkpoint, a copy: on the CPU `.to` would keep a view of the read-only mapping.
            p.data = p.data.to(device) if saved is None else saved.to(device, copy=True)
        self._buffers_to(device, files)
        self.buffer_bytes = buffer_bytes(self.module)
        if self._loaded is not None:  # the buffers as set-up leaves them (untouched's Baseline.take_buffers)
            self._loaded()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # what the streamed parameters held goes back for the pool

        def bring(w: str, p: nn.Parameter) -> None:
            # From registered or pinned memory the host does not wait for the copy: the kernel
            # reading it runs after it on the same stream, and the source outlives the forward.
            p.data = host[w].to(device, copy=True, non_blocking=True)

        def release(w: str, p: nn.Parameter) -> None:
            p.data = self.placeholders[id(p)]

        # The order forward also traces the bytes its ops hold live (offload's census prices from them).
        live, self.input_bytes = forward_live_bytes(module, [*self.args, *self.kwargs.values()])
        with torch.no_grad(), stage(self.setup_s, "order"):
            self.recording: Recording = record_order(module, self.run, kernels, bring, release, live)
        for p in self.recording.outside:  # read outside their kernel: resident from now on
            for k in kernels:
                k.params.pop(names[id(p)], None)
            self.placeholders.pop(id(p), None)
        in_file = files is not None and source in ("mmap_registered", "mmap")
        pinned = device.type == "cuda" if files is None else source == "pinned"
        with stage(self.setup_s, "pack"):
            packed = pack_kernels(self.recording.order, host, self._checkpoint.locate if in_file else None,
                                  self._holder.host_buffer if pinned else pageable_buffer)
        views = weight_views(packed)
        self._restore.stream({k: views[names[k]] for k in streamed
                              if k in self._restore.params and names[k] in views})
        del views
        self.copied_bytes = packed.copied_bytes  # host bytes copied out of the checkpoint or the module
        self.order = packed.order
        self.host = packed.host
        self.kernels = kernels
        self.resident_params = [names[id(p)] for p in [*kept, *self.recording.outside]]
        self.resident_bytes = sum(p.numel() * p.element_size() for p in [*kept, *self.recording.outside])
        with stage(self.setup_s, "hooks"):
            self.hooks = KernelHooks(module, kernels, self.order, self.placeholders, packed.parts)
        log.info("%s: %d kernels (%s), %.1f MB streamed as %d weights (%.1f MB copied to host buffers), "
                 "%d kept resident (%.1f MB)", type(module).__name__, len(self.order), grouping,
                 sum(self.order.sizes.values()) / MB, len(self.order.sizes), self.copied_bytes / MB,
                 len(self.resident_params), self.resident_bytes / MB)

    def _materialize_meta(self) -> None:
        """Parameters on the meta device become placeholders on the compute device
        (a tied parameter stays one parameter); the checkpoint fills them."""
        new: dict[int, nn.Parameter] = {}
        for m in self.module.modules():
            for name, p in m._parameters.items():
                if p is not None and p.is_meta:
                    if id(p) not in new:
                        new[id(p)] = nn.Parameter(placeholder(p, self.device), requires_grad=p.requires_grad)
                    m._parameters[name] = new[id(p)]

    def _register(self) -> None:
        for wf in self._checkpoint.files:
            self._registered.append(register_file(wf, self._holder))

    def _buffers_to(self, device: torch.device, files: dict[str, torch.Tensor] | None) -> None:
        for qual, m in self.module.named_modules():
            for name, b in m._buffers.items():
                if b is None:
                    continue
                full = f"{qual}.{name}" if qual else name
                key = state_dict_name(full)  # as the checkpoint holds it (peft's wrapping undone)
                if files is not None and key in files:
                    m._buffers[name] = files[key].to(device, copy=True)  # writable, as for kept parameters
                elif b.is_meta:
                    raise WeightFileError(f"buffer {full} is on the meta device and not in the checkpoint; build "
                                          "the module with its buffers on the CPU (only parameters on meta)")
                else:
                    m._buffers[name] = b.to(device)

    def bind(self, executor: WeightExecutor) -> ExitStack:
        """Every weight fetched once by `executor` (one that evicts none; over the forward's
        order or a training order) and bound, the hooks off (`KernelHooks.bound`): the plain
        module's forward, and its backward, until the returned stack closes."""
        stack = ExitStack()
        with executor.step():
            stack.enter_context(self.hooks.bound(executor))
            for position in range(len(self.order), len(executor.order)):
                executor.fetch(position)  # a training order's mirror: the same weights, resident
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the copies landed before any stream reads them
        return stack

    def run(self) -> Any:
        """One forward on the example inputs."""
        return self.module(*self.args, **self.kwargs)

    def remove(self) -> None:
        """Remove the hooks, unregister, close the checkpoint and put every parameter back."""
        if self.hooks is not None:
            self.hooks.remove()
            self.hooks = None
        for address in self._registered:
            self._holder.unregister(address)
        self._registered.clear()
        self.host = {}
        self._restore.restore()
        if self._checkpoint is not None:
            self._checkpoint.close()
            self._checkpoint = None
        self._holder.close()


