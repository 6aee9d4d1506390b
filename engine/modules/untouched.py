"""What set-up's own forwards and backwards must leave as they found it.

Recording a module runs it several times: forwards (training: with their backward)
before the user's first step. Those runs may change state the user's training or
inference reads: the gradients the backward accumulates into trainable parameters,
buffers a forward updates in place (a BatchNorm's running statistics, a step
counter), and the random generators dropout draws from. `untouched(module)`
snapshots them and puts them back, so the user's first step is the one it would
have been without the set-up. Buffers are taken as set-up's first forward finds
them: set-up loads a checkpoint's buffers (and moves the module's to the device)
before it, and those values, not the module's as built, are the ones to keep.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn


@contextmanager
def untouched(module: nn.Module) -> Iterator[None]:
    """Inside, run `module` freely; on exit its parameters' `.grad` and the CPU and CUDA
    random generators are what they were on entry, its buffers' values what they were
    when its first forward inside began."""
    grads = [(p, None if p.grad is None else p.grad.detach().clone())
             for p in module.parameters() if p.requires_grad]
    buffers: dict[str, torch.Tensor] = {}
    taken = False

    def snapshot(_module: nn.Module, _args: tuple) -> None:
        nonlocal taken
        if not taken:
            buffers.update({n: b.detach().clone() for n, b in module.named_buffers() if b.device.type != "meta"})
            taken = True

    first_forward = module.register_forward_pre_hook(snapshot, prepend=True)
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        first_forward.remove()
        for p, g in grads:
            p.grad = g
        now = dict(module.named_buffers())  # set-up may have moved a buffer to the device
        with torch.no_grad():
            for name, saved in buffers.items():
                if name in now and now[name].shape == saved.shape:
                    now[name].copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
