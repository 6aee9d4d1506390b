"""A real module made ready for LoRA training from a config: peft adapters, per-block
activation checkpointing, and the step's loss.

    add_lora               freeze the base, inject peft LoRA adapters (seeded, on the device)
    enable_checkpointing   each block recomputed in backward (diffusers' or transformers' own switch)
    TrainingLoss           the loss the CLI's training step takes: mean square error of the
                           forward's first output against a fixed seeded target

peft renames what it wraps (`to_q.weight` becomes `to_q.base_layer.weight`); the
checkpoint still holds the base model's names (engine/modules/checkpoint.py
`state_dict_name` maps one to the other).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from engine.errors import ConfigError
from engine.modules.build import MODELS_EXTRA, first_output

ALL_LINEAR = "all-linear"  # peft's: every linear layer but the output head
ADAPTER_SCALE = 0.01  # seeded adapters small beside the base weights, both A and B non-zero (gradients everywhere)


def add_lora(module: nn.Module, rank: int, targets: str | Sequence[str] = ALL_LINEAR, *, device: torch.device,
             seed: int = 0) -> nn.Module:
    """Freeze `module` and inject peft LoRA adapters of `rank` (alpha = rank) into `targets`
    (module name suffixes, or "all-linear"), in place. The adapters get seeded normal
    weights on `device` in the module's dtype (peft's zero B would leave A without a
    gradient in the first step); returns the module."""
    try:
        import peft
    except ModuleNotFoundError:
        raise ConfigError(f"workload=train_lora on a real module adds peft LoRA adapters; {MODELS_EXTRA}") from None
    if rank < 1:
        raise ConfigError(f"workload.lora_rank={rank}: LoRA training needs a rank of 1 or more")
    targets = targets if isinstance(targets, str) else list(targets)
    module.requires_grad_(False)
    config = peft.LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=targets)
    try:
        peft.inject_adapter_in_model(config, module)
    except ValueError as err:  # peft: "Target modules {...} not found in the base model"
        raise ConfigError(f"model.lora_targets={targets}: {str(err).splitlines()[0]}; name module suffixes of "
                          f"this {type(module).__name__} (named_modules()) or use {ALL_LINEAR}") from None
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
    g = torch.Generator().manual_seed(seed)
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and p.requires_grad:
                value = ADAPTER_SCALE * torch.randn(tuple(p.shape), generator=g)
                m._parameters[name] = nn.Parameter(value.to(device=device, dtype=dtype))
    return module


def enable_checkpointing(module: nn.Module) -> None:
    """Per-block activation checkpointing by the module's own switch (non-reentrant)."""
    if hasattr(module, "gradient_checkpointing_enable"):  # transformers
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(module, "enable_gradient_checkpointing"):  # diffusers
        module.enable_gradient_checkpointing()
    else:
        raise ConfigError(f"workload.checkpointing=true: this {type(module).__name__} has no gradient "
                          "checkpointing switch (diffusers' enable_gradient_checkpointing, transformers' "
                          "gradient_checkpointing_enable); set workload.checkpointing=false")
    module.train()


class TrainingLoss:
    """Mean square error of the forward's first output against a seeded normal target
    (made at the first call, the output's shape, float32): the same loss every step."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.target: torch.Tensor | None = None

    def __call__(self, output: Any) -> torch.Tensor:
        out = first_output(output).float()
        if self.target is None or self.target.shape != out.shape:
            g = torch.Generator().manual_seed(self.seed)
            self.target = torch.randn(tuple(out.shape), generator=g).to(out.device)
        return (out - self.target).pow(2).mean()
