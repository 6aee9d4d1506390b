"""Wan2.1 (`family: dit`, `variant: wan`): spec builder, forward, inputs.

The patch embedding is a Conv3d with kernel = stride = `patch_size`; the
forward has no RoPE and a plain sinusoidal timestep embedding (per sample)."""
from __future__ import annotations

from math import prod
from typing import TYPE_CHECKING, Any, Mapping

from engine.models.builder import Act, SpecBuilder
from engine.models.dit import DitModelConfig, caption, modulation_rows, output_layer
from engine.models.spec import WorkloadShape, require_tokens

if TYPE_CHECKING:
    from torch import Tensor

    from engine.models.run import Run
    from engine.models.seeded import Draw


def build(b: SpecBuilder, c: DitModelConfig) -> None:
    """Wan2.1's weights and kernels in launch order."""
    tok = b.tok
    require_tokens(tok.video, "video_tokens", c.name)
    require_tokens(tok.text, "text_tokens", c.name)
    bs, d = tok.batch, c.dim
    patch = prod(c.patch_size)
    # Conv3d with kernel = stride = patch: a matmul over patchified tokens.
    x_in = Act("video", bs * tok.video, c.in_channels * patch)
    v = Act("patch_embedding.out", x_in.rows, d, transposed=True)  # flatten(2).transpose(1, 2): features-major
    w = b.param("patch_embedding.weight", (d, c.in_channels, *c.patch_size))
    bias = b.param("patch_embedding.bias", (d,))
    b.kernel("patch_embedding", -1, "linear", (w, bias), 2 * x_in.rows * d * x_in.width,
             b.nbytes(x_in) + b.nbytes(v), shape=(x_in.rows, d, x_in.width))
    t = Act("timestep.freqs", bs, c.timestep_dim)
    h = b.linear("condition_embedder.time_embedder.linear_1", -1, t, d)
    h = b.linear("condition_embedder.time_embedder.linear_2", -1, h, d)
    b.linear("condition_embedder.time_proj", -1, h, 6 * d)
    h = b.linear("condition_embedder.text_embedder.linear_1", -1, Act("text", bs * tok.text, c.text_dim), d,
                 gelu=True)
    text = b.linear("condition_embedder.text_embedder.linear_2", -1, h, d)

    attn = dict(inner=d, heads=c.heads, head_dim=c.head_dim, out_dim=d)
    for i in range(c.num_layers):
        kp, wp = f"blocks.{i}", f"blocks.{i}"
        b.elementwise(f"{kp}.ada", i, [(f"{wp}.scale_shift_table", (1, 6, d))])
        (x,) = b.norm(f"{kp}.norm1", i, v, layer_norm=True)
        y = b.attention_layer(f"{kp}.attn1", f"{wp}.attn1", i, x, None, **attn)
        v = b.residual(f"{kp}.attn1.to_out", v, y, gated=True)
        (x,) = b.norm(f"{kp}.norm2", i, v, layer_norm=True, modulated=False,
                      weights=[(f"{wp}.norm2.weight", (d,)), (f"{wp}.norm2.bias", (d,))])
        v = b.residual(f"{kp}.attn2.to_out", v, b.attention_layer(f"{kp}.attn2", f"{wp}.attn2", i, x, text, **attn))
        (x,) = b.norm(f"{kp}.norm3", i, v, layer_norm=True)
        v = b.residual(f"{kp}.ffn.down", v, b.ffn(f"{kp}.ffn", f"{wp}.ffn", i, x, c.ffn_dim), gated=True)

    (x,) = b.norm("norm_out", -1, v, layer_norm=True, weights=[("scale_shift_table", (1, 2, d))])
    b.linear("proj_out", -1, x, c.in_channels * patch)


# ----- forward


def forward(run: Run, inp: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The kernels `build` declares, in order: {"video": ...}."""
    import torch.nn.functional as F

    from engine.models.layers import attention_layer, ffn, layer_norm, linear_kernel, modulate, timestep_freqs

    c, eps = run.cfg, run.eps
    w = run.kernel("patch_embedding")
    wp = w["patch_embedding.weight"]
    v = F.conv3d(inp["video"], wp, w["patch_embedding.bias"], stride=wp.shape[2:]).flatten(2).transpose(1, 2)
    freqs = timestep_freqs(inp["timestep"], c["timestep_dim"], v.dtype)
    temb = linear_kernel(run, "condition_embedder.time_embedder.linear_2",
                         F.silu(linear_kernel(run, "condition_embedder.time_embedder.linear_1", freqs)))
    tproj = linear_kernel(run, "condition_embedder.time_proj", F.silu(temb)).unflatten(-1, (6, -1))
    text = caption(run, "condition_embedder.text_embedder", inp["text"])

    for i in range(c["num_layers"]):
        kp = wp = f"blocks.{i}"
        w = run.kernel(f"{kp}.ada")
        shift_msa, scale_msa, gate_msa, c_shift, c_scale, c_gate = modulation_rows(w[f"{wp}.scale_shift_table"], tproj)
        run.kernel(f"{kp}.norm1")
        x = modulate(layer_norm(v, eps), shift_msa, scale_msa)
        v = v + attention_layer(run, f"{kp}.attn1", f"{wp}.attn1", x, None, c["heads"]) * gate_msa
        w = run.kernel(f"{kp}.norm2")
        x = layer_norm(v, eps, w[f"{wp}.norm2.weight"], w[f"{wp}.norm2.bias"])
        v = v + attention_layer(run, f"{kp}.attn2", f"{wp}.attn2", x, text, c["heads"])
        run.kernel(f"{kp}.norm3")
        v = v + ffn(run, f"{kp}.ffn", f"{wp}.ffn", modulate(layer_norm(v, eps), c_shift, c_scale)) * c_gate
    return {"video": output_layer(run, "norm_out", "scale_shift_table", "proj_out", v, temb)}


def inputs(c: Mapping[str, Any], workload: WorkloadShape, draw: Draw) -> dict[str, Tensor]:
    """A latent whose patches are the video tokens, text embeddings and timesteps."""
    bs = workload.batch
    pt, ph, pw = c["patch_size"]
    video = draw.randn(bs, c["in_channels"], pt * workload.video_tokens, ph, pw)
    return {"video": video, "text": draw.randn(bs, workload.text_tokens, c["text_dim"]), "timestep": draw.steps()}
