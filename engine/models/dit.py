"""The DiT family (`family: dit`): its schema and checks, and the forward pieces
its variants share. Each variant (`variant:` in the model yaml) has its own file
with its spec builder, forward and inputs: engine/models/ltx.py (LTX-Video,
LTX-2) and engine/models/wan.py (Wan2.1)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from omegaconf import MISSING

from engine.models.spec import ModelConfig, SpecError, check_positive, check_product

if TYPE_CHECKING:
    from torch import Tensor

    from engine.models.run import Run

# Adapted linears when the workload names none (module-name suffixes).
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


@dataclass
class DitModelConfig(ModelConfig):
    """Diffusion transformers: LTX-Video / LTX-2 (variant "ltx") and Wan2.1 (variant "wan").

    `audio_dim > 0` adds LTX-2's audio stream with its a2v/v2a cross attentions;
    0 is the single-stream LTX-Video. Wan keeps some norms and embedders in fp32
    in diffusers; here every weight has `dtype` (parameter counts are unchanged).
    """

    family: str = "dit"
    variant: str = "ltx"  # ltx | wan
    dim: int = MISSING  # width of the (video) stream
    heads: int = MISSING
    head_dim: int = MISSING
    ffn_dim: int = MISSING  # the MLP's hidden width
    in_channels: int = 128  # latent channels per token (LTX: already patchified)
    patch_size: list[int] = field(default_factory=lambda: [1, 1, 1])  # (t, h, w); wan: conv3d patches
    text_dim: int = 4096  # width of the text encoder's embeddings
    timestep_dim: int = 256  # sinusoidal timestep features
    audio_dim: int = 0  # width of LTX-2's audio stream; 0 = none
    audio_heads: int = 32
    audio_head_dim: int = 64
    audio_ffn_dim: int = 8192
    audio_in_channels: int = 128
    eps: float = 1e-6  # of every norm


def check(cfg: DitModelConfig) -> None:
    """What the schema's types cannot say (the variant name is checked by the registry)."""
    check_positive(cfg, "dim", "heads", "head_dim", "ffn_dim", "in_channels", "text_dim", "timestep_dim")
    check_product(cfg, "heads", "head_dim", "dim")
    if len(cfg.patch_size) != 3 or min(cfg.patch_size) <= 0:
        raise SpecError(f"model.patch_size={list(cfg.patch_size)} must be three positive sizes (t, h, w)")
    if cfg.variant == "ltx" and list(cfg.patch_size) != [1, 1, 1]:
        raise SpecError("model.patch_size must be [1, 1, 1] for variant ltx (its latents come "
                        "patchified); drop patch_size or use variant wan")
    if cfg.audio_dim < 0:
        raise SpecError(f"model.audio_dim={cfg.audio_dim} must be 0 (no audio) or positive")
    if cfg.audio_dim:
        if cfg.variant != "ltx":
            raise SpecError("model.audio_dim > 0 needs variant ltx (the LTX-2 audio stream); set audio_dim: 0")
        check_positive(cfg, "audio_heads", "audio_head_dim", "audio_ffn_dim", "audio_in_channels")
        check_product(cfg, "audio_heads", "audio_head_dim", "audio_dim")


# ----- forward pieces of both variants (torch is imported where they run: see engine/models/__init__.py)


def caption(run: Run, module: str, text: Tensor) -> Tensor:
    """PixArt caption projection: linear_1, GELU-tanh, linear_2."""
    from engine.models.layers import gelu, linear_kernel

    return linear_kernel(run, f"{module}.linear_2", gelu(linear_kernel(run, f"{module}.linear_1", text)))


def modulation_rows(table: Tensor, values: Tensor) -> list[Tensor]:
    """Table (k, d) + per-sample values (B, k, d) -> k tensors (B, 1, d) that broadcast over tokens."""
    return list((table.reshape(values.shape[1:]) + values).unsqueeze(2).unbind(1))


def output_layer(run: Run, norm: str, table: str, proj: str, x: Tensor, emb: Tensor) -> Tensor:
    """Final LayerNorm modulated by (table + embedded timestep), then the output projection."""
    from engine.models.layers import layer_norm, linear_kernel, modulate

    w = run.kernel(norm)
    shift, scale = (w[table].reshape(2, -1) + emb[:, None]).unsqueeze(2).unbind(1)
    return linear_kernel(run, proj, modulate(layer_norm(x, run.eps), shift, scale))
