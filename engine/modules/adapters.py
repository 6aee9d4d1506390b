"""A real module made ready for LoRA training from a config: peft adapters, per-block
activation checkpointing, and the step's loss.

    add_lora               freeze the base, inject peft LoRA adapters (seeded, on the device)
    enable_checkpointing   each block recomputed in backward (diffusers' or transformers' own switch)
    TrainingLoss           the loss the CLI's training step takes: mean square error of every
                           output of the forward against fixed seeded targets

peft renames what it wraps (`to_q.weight` becomes `to_q.base_layer.weight`); the
checkpoint still holds the base model's names (engine/modules/checkpoint.py
`state_dict_name` maps one to the other).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from engine.errors import ConfigError
from engine.modules.build import MODELS_EXTRA

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
    if not isinstance(targets, str):
        _refuse_containers(module, targets)
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
                if device.type == "meta":  # shapes only (a synthesized trace): no values to draw
                    value = torch.empty(tuple(p.shape), device=device, dtype=dtype)
                else:
                    value = (ADAPTER_SCALE * torch.randn(tuple(p.shape), generator=g)).to(device=device, dtype=dtype)
                m._parameters[name] = nn.Parameter(value)
    return module


def _refuse_containers(module: nn.Module, targets: Sequence[str]) -> None:
    """A suffix naming a module list or sequence (diffusers' `attn.to_out` in most blocks), which
    peft refuses with the container's whole repr: one line naming it and the ways out."""
    for name, m in module.named_modules():
        hit = next((t for t in targets if name == t or name.endswith("." + t)), None)
        if hit is not None and isinstance(m, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            inner = next((f"{hit}.{n}" for n, c in m.named_children() if isinstance(c, nn.Linear)), None)
            raise ConfigError(
                f"model.lora_targets: {hit!r} matches {name}, a {type(m).__name__}, which peft cannot adapt; name "
                + (f"its linear ({inner!r}), " if inner else "the linears inside it, ")
                + "or give one regular expression string that peft matches whole (conf/model/flux2_diffusers.yaml)")


def checkpointed(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A diffusers block's forward under non-reentrant checkpointing, keyword arguments passed
    through (diffusers' own function passes positional ones only, and HunyuanImage's blocks take
    their mask and rotary embedding by keyword)."""
    return checkpoint(block.__call__, *args, use_reentrant=False, **kwargs)


def enable_checkpointing(module: nn.Module) -> None:
    """Per-block activation checkpointing by the module's own switch (non-reentrant)."""
    if hasattr(module, "activation_checkpointing_enable"):  # transformers >= 5.2x
        module.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(module, "gradient_checkpointing_enable"):  # earlier transformers
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(module, "enable_gradient_checkpointing"):  # diffusers
        module.enable_gradient_checkpointing(checkpointed)
    else:
        raise ConfigError(f"workload.checkpointing=true: this {type(module).__name__} has no gradient "
                          "checkpointing switch (diffusers' enable_gradient_checkpointing, transformers' "
                          "gradient_checkpointing_enable); set workload.checkpointing=false")
    module.train()


def _outputs(out: Any) -> list[torch.Tensor]:
    """Every floating-point tensor of a forward's output that carries a gradient."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() and out.requires_grad else []
    if isinstance(out, Mapping):  # transformers' ModelOutput too
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _outputs(o)]
    return []


class TrainingLoss:
    """Mean square error of every output of the forward (each floating-point tensor that
    carries a gradient: LTX-2's video and audio, a language model's logits) against a
    seeded normal target of its shape (made at the first call, float32), summed: the same
    loss every step, and a backward that reaches every branch of the graph."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.targets: list[torch.Tensor] = []

    def __call__(self, output: Any) -> torch.Tensor:
        outs = [o.float() for o in _outputs(output)]
        if not outs:
            raise ConfigError("the forward's output carries no gradient: no LoRA target is on its path; "
                              "name model.lora_targets the model's output depends on")
        if [t.shape for t in self.targets] != [o.shape for o in outs]:
            g = torch.Generator().manual_seed(self.seed)
            self.targets = [torch.empty(o.shape, device=o.device) if o.is_meta  # shapes only: a synthesized step
                            else torch.randn(tuple(o.shape), generator=g).to(o.device) for o in outs]
        return sum((o - t).pow(2).mean() for o, t in zip(outs, self.targets))
