"""Seeded random tensors for tests, references and benchmarks: a model's inputs
(`Draw`, used by each family's `inputs`) and its weights (`random_weights`).

Drawn on the CPU, then moved: the same seed gives the same tensors on any device."""
from __future__ import annotations

import math

import torch

from engine.models.run import TORCH_DTYPES, Tensor
from engine.models.spec import ModelSpec


def generator(seed: int) -> torch.Generator:
    """A CPU generator at `seed`."""
    return torch.Generator().manual_seed(seed)


class Draw:
    """Random inputs of one batch, in the order a family's `inputs` asks for them."""

    def __init__(self, seed: int, batch: int, device: torch.device | str, dtype: torch.dtype):
        self.g = generator(seed)
        self.batch = batch
        self.device = device
        self.dtype = dtype

    def randn(self, *shape: int) -> Tensor:
        """Standard normal values in the inputs' dtype."""
        return torch.randn(*shape, generator=self.g).to(self.device, self.dtype)

    def steps(self) -> Tensor:
        """One diffusion timestep per sample, uniform in [0, 1000), fp32."""
        return (torch.rand(self.batch, generator=self.g) * 1000).to(self.device)

    def tokens(self, vocab: int, shape: tuple[int, ...]) -> Tensor:
        """Token ids below `vocab`."""
        return torch.randint(0, vocab, shape, generator=self.g).to(self.device)


def random_weights(spec: ModelSpec, seed: int = 0, device: torch.device | str = "cpu",
                   dtype: torch.dtype | None = None, draw_on_device: bool = False) -> dict[str, Tensor]:
    """Seeded weights at sane scales: linears ~ 1/sqrt(fan_in), biases small,
    norm weights near 1, scale_shift tables ~ 1/sqrt(width).

    `draw_on_device` draws with the device's own generator (other values than
    the CPU's for the same seed): for models too large to draw on the host."""
    g = torch.Generator(device=device).manual_seed(seed) if draw_on_device else generator(seed)
    out = {}
    for name, ws in spec.weights.items():
        r = _scaled(name, torch.randn(ws.shape, generator=g, device=g.device))
        out[name] = r.to(device, dtype or TORCH_DTYPES[ws.dtype])
        del r  # a large model's fp32 draw is not kept beside the next one
    return out


def _scaled(name: str, r: Tensor) -> Tensor:
    """A standard normal draw `r` brought to the scale of weight `name`."""
    shape = r.shape
    if name.endswith(".bias"):
        return r * 0.02
    if len(shape) == 1:
        return 1 + 0.1 * r
    if "scale_shift_table" in name:
        return r / math.sqrt(shape[-1])
    return r / math.sqrt(math.prod(shape[1:]))
