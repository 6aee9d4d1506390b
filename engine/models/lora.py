"""LoRA on spec-built models: the adapters, the step's loss and its update.

`forward(spec, source, inputs, lora)` adds `B(A(x))` to every linear an adapter
targets; a step is `lora_loss(out).backward()` (`lora_backward` does both),
then `lora_sgd` (the base weights stay frozen)."""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

from engine.models import FAMILIES, forward
from engine.models.run import TORCH_DTYPES, Tensor, WeightSource
from engine.models.seeded import generator
from engine.models.spec import ModelSpec, is_adapted


def init_lora(spec: ModelSpec, rank: int, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
              seed: int = 0, targets: Sequence[str] | None = None) -> dict[str, Tensor]:
    """Trainable `{module}.lora_A` (rank, in) and `{module}.lora_B` (out, rank) for every targeted linear.

    `targets` default to the family's (FAMILIES[family].lora_targets). B starts
    small but not zero, so both A and B get non-trivial gradients to compare."""
    if rank <= 0:
        raise ValueError(f"LoRA rank={rank} must be positive")
    targets = tuple(targets or FAMILIES[spec.family].lora_targets)
    dt = dtype or TORCH_DTYPES[spec.meta["config"]["dtype"]]
    g = generator(seed)
    lora: dict[str, Tensor] = {}
    for k in spec.kernels:
        if k.op != "linear":
            continue
        for name in k.weights:
            module, _, leaf = name.rpartition(".")
            shape = spec.weights[name].shape
            if leaf != "weight" or len(shape) != 2 or not is_adapted(module, targets):
                continue
            out_f, in_f = shape
            a = torch.randn(rank, in_f, generator=g) / math.sqrt(in_f)
            b = torch.randn(out_f, rank, generator=g) * (0.01 / math.sqrt(rank))
            lora[f"{module}.lora_A"] = a.to(device, dt).requires_grad_(True)
            lora[f"{module}.lora_B"] = b.to(device, dt).requires_grad_(True)
    if not lora:
        raise ValueError(f"LoRA targets {targets} match no linear of {spec.name}")
    return lora


def lora_loss(out: Mapping[str, Tensor]) -> Tensor:
    """The step's objective: the mean square of every output, summed, in fp32."""
    return sum(o.float().pow(2).mean() for o in out.values())


def lora_backward(spec: ModelSpec, source: WeightSource, inputs: Mapping[str, Tensor],
                  lora: Mapping[str, Tensor]) -> Tensor:
    """One step's forward, loss and backward; afterwards the adapters' `.grad` hold
    this step's gradients alone. Returns the loss, detached."""
    for t in lora.values():
        t.grad = None
    loss = lora_loss(forward(spec, source, inputs, lora))
    loss.backward()
    return loss.detach()


def lora_sgd(lora: Mapping[str, Tensor], learning_rate: float) -> dict[str, Tensor]:
    """A plain SGD update of the adapters; returns the gradients it took (and clears them)."""
    grads = {}
    with torch.no_grad():
        for k, p in lora.items():
            grads[k] = p.grad
            p.sub_(p.grad, alpha=learning_rate)
            p.grad = None
    return grads
