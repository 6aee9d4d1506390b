"""What set-up's own forwards and backwards must leave as they found it.

Recording a module runs it several times: forwards (training: with their backward)
before the user's first step. Those runs may change state the user's training or
inference reads: the gradients the backward accumulates into trainable parameters,
buffers a forward updates in place (a BatchNorm's running statistics, a step
counter), and the random generators dropout draws from. `untouched(module)`
snapshots them and puts them back, so the user's first step is the one it would
have been without the set-up. Set-up loads a checkpoint's buffers (and moves the
module's to the device) before its first forward: it then calls the yielded
baseline's `take_buffers`, and those values, not the module's as built, are the
ones put back. Only the first call counts: set-up may make the module streamable
again (another grouping) after forwards that changed its buffers. Without a call no
forward ran, and no buffer is put back. The copies wait on the host (a learned
positional table is hundreds of MB; a device copy would hold that much beside the
module through set-up, and for as long as anything kept the baseline) and are let go
once put back.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn


class Baseline:
    """The state `untouched` puts back: the trainable parameters' `.grad`, the buffers'
    values and the CPU and CUDA random generators."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.grads = [(p, None if p.grad is None else p.grad.detach().clone())
                      for p in module.parameters() if p.requires_grad]
        self.buffers: dict[str, torch.Tensor] = {}
        self._taken = False
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def take_buffers(self) -> None:
        """At the first call, the buffers' present values become the ones to put back."""
        if not self._taken:
            self.buffers = {n: b.detach().to("cpu", copy=True) for n, b in self.module.named_buffers()
                            if b.device.type != "meta"}
            self._taken = True

    def restore(self) -> None:
        for p, g in self.grads:
            p.grad = g
        now = dict(self.module.named_buffers())  # set-up may have moved a buffer to the device
        with torch.no_grad():
            for name, saved in self.buffers.items():
                if name in now and now[name].shape == saved.shape:
                    now[name].copy_(saved)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        self.grads, self.buffers = [], {}  # put back once; the copies are let go


@contextmanager
def untouched(module: nn.Module) -> Iterator[Baseline]:
    """Inside, run `module` freely; on exit its parameters' `.grad` and the random
    generators are what they were on entry, its buffers what they were at the baseline's
    first `take_buffers`."""
    baseline = Baseline(module)
    try:
        yield baseline
    finally:
        baseline.restore()
