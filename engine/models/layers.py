"""Torch pieces the families' forwards share: norms, modulation, attention, MLP.

Each function that takes a `Run` fetches the kernels it runs, in the order and
under the names the matching `SpecBuilder` method declared them."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.models.run import Run, Tensor


def rms_norm(x: Tensor, eps: float, w: Tensor | None = None) -> Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def layer_norm(x: Tensor, eps: float, w: Tensor | None = None, b: Tensor | None = None) -> Tensor:
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """adaLN: x * (1 + scale) + shift."""
    return x * (1 + scale) + shift


def gelu(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


def sdpa(q: Tensor, k: Tensor, v: Tensor, heads: int, kv_heads: int | None = None,
         causal: bool = False) -> Tensor:
    """(B, L, heads*hd) in and out; grouped-query when kv_heads < heads."""
    kvh = kv_heads or heads
    qh = q.unflatten(-1, (heads, -1)).transpose(1, 2)
    kh = k.unflatten(-1, (kvh, -1)).transpose(1, 2)
    vh = v.unflatten(-1, (kvh, -1)).transpose(1, 2)
    o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, enable_gqa=kvh != heads)
    return o.transpose(1, 2).flatten(2)


def timestep_freqs(t: Tensor, dim: int, dtype: torch.dtype) -> Tensor:
    """Sinusoidal timestep features, (B,) -> (B, dim), cos half first."""
    half = dim // 2
    f = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    arg = t.float()[:, None] * f[None]
    return torch.cat([torch.cos(arg), torch.sin(arg)], dim=-1).to(dtype)


def per_head_rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """RMSNorm over each head (FLUX): the weight is one head wide."""
    return F.rms_norm(x.unflatten(-1, (-1, w.shape[0])), (w.shape[0],), w, eps).flatten(-2)


def linear_kernel(run: Run, module: str, x: Tensor) -> Tensor:
    """A kernel of one linear named after its module (SpecBuilder.linear)."""
    return run.linear(run.kernel(module), module, x)


def attention_layer(run: Run, kp: str, wp: str, x: Tensor, ctx: Tensor | None, heads: int) -> Tensor:
    """SpecBuilder.attention_layer's kernels: q/k/v (+ q/k RMSNorm), the core, to_out.0."""
    eps = run.eps
    if ctx is None:
        w = run.kernel(f"{kp}.qkv")
        q = rms_norm(run.linear(w, f"{wp}.to_q", x), eps, w[f"{wp}.norm_q.weight"])
        k = rms_norm(run.linear(w, f"{wp}.to_k", x), eps, w[f"{wp}.norm_k.weight"])
        v = run.linear(w, f"{wp}.to_v", x)
    else:
        w = run.kernel(f"{kp}.q")
        q = rms_norm(run.linear(w, f"{wp}.to_q", x), eps, w[f"{wp}.norm_q.weight"])
        w = run.kernel(f"{kp}.kv")
        k = rms_norm(run.linear(w, f"{wp}.to_k", ctx), eps, w[f"{wp}.norm_k.weight"])
        v = run.linear(w, f"{wp}.to_v", ctx)
    run.kernel(f"{kp}.attention")
    o = sdpa(q, k, v, heads)
    return run.linear(run.kernel(f"{kp}.to_out"), f"{wp}.to_out.0", o)


def ffn(run: Run, kp: str, wp: str, x: Tensor) -> Tensor:
    """SpecBuilder.ffn's kernels: `{kp}.up` (net.0.proj + GELU-tanh) and `{kp}.down` (net.2)."""
    h = gelu(run.linear(run.kernel(f"{kp}.up"), f"{wp}.net.0.proj", x))
    return run.linear(run.kernel(f"{kp}.down"), f"{wp}.net.2", h)
