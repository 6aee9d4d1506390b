"""FLUX.1 (`family: flux`): schema, checks, spec builder, forward, inputs.

`num_double_layers` double-stream blocks (image and text each with their own
weights, joint attention over [text, image]), then single-stream blocks over
the concatenation. The forward has no RoPE and a plain sinusoidal timestep
embedding (per sample)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from omegaconf import MISSING

from engine.models.builder import ONE_PASS, Act, Out, SpecBuilder
from engine.models.spec import ModelConfig, SpecError, WorkloadShape, check_positive, check_product, require_tokens

if TYPE_CHECKING:
    from torch import Tensor

    from engine.models.run import KernelWeights, Run
    from engine.models.seeded import Draw

# Adapted linears when the workload names none (module-name suffixes).
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


@dataclass
class FluxModelConfig(ModelConfig):
    """FLUX.1: `num_double_layers` double-stream blocks, then the rest single-stream."""

    family: str = "flux"
    num_double_layers: int = MISSING  # of num_layers, which counts double + single blocks
    dim: int = 3072  # width of both streams
    heads: int = 24
    head_dim: int = 128
    ffn_dim: int = 12288  # the MLP's hidden width
    in_channels: int = 64  # packed latent channels per image token
    text_dim: int = 4096  # T5
    pooled_dim: int = 768  # CLIP pooled
    timestep_dim: int = 256  # sinusoidal timestep (and guidance) features
    guidance_embeds: bool = True  # FLUX.1-dev's guidance embedder
    eps: float = 1e-6  # of every norm


def check(cfg: FluxModelConfig) -> None:
    """What the schema's types cannot say."""
    check_positive(cfg, "num_double_layers", "dim", "heads", "head_dim", "ffn_dim", "in_channels",
                   "text_dim", "pooled_dim", "timestep_dim")
    check_product(cfg, "heads", "head_dim", "dim")
    if cfg.num_double_layers > cfg.num_layers:
        raise SpecError(f"model.num_double_layers={cfg.num_double_layers} exceeds model.num_layers="
                        f"{cfg.num_layers} (double + single blocks); raise num_layers")


def build(b: SpecBuilder, c: FluxModelConfig) -> None:
    """FLUX.1's weights and kernels in launch order."""
    tok = b.tok
    require_tokens(tok.video, "video_tokens", c.name)
    require_tokens(tok.text, "text_tokens", c.name)
    bs, d = tok.batch, c.dim
    img = b.linear("x_embedder", -1, Act("image", bs * tok.video, c.in_channels), d)
    t = Act("timestep.freqs", bs, c.timestep_dim)
    embedders = [("timestep_embedder", t)]
    if c.guidance_embeds:
        embedders.append(("guidance_embedder", Act("guidance.freqs", bs, c.timestep_dim)))
    embedders.append(("text_embedder", Act("pooled", bs, c.pooled_dim)))
    for name, x in embedders:
        h = b.linear(f"time_text_embed.{name}.linear_1", -1, x, d)
        b.linear(f"time_text_embed.{name}.linear_2", -1, h, d)
    temb = Act("temb", bs, d)
    txt = b.linear("context_embedder", -1, Act("text", bs * tok.text, c.text_dim), d)
    heads, hd = c.heads, c.head_dim

    for i in range(c.num_double_layers):
        kp, wp = f"double_blocks.{i}", f"transformer_blocks.{i}"
        b.proj(f"{kp}.norm1.linear", i, temb, [Out(f"{wp}.norm1.linear", 6 * d)])
        b.proj(f"{kp}.norm1_context.linear", i, temb, [Out(f"{wp}.norm1_context.linear", 6 * d)])
        (x,) = b.norm(f"{kp}.norm1", i, img, layer_norm=True)
        (cx,) = b.norm(f"{kp}.norm1_context", i, txt, layer_norm=True)
        q, k, v = b.proj(f"{kp}.attn.qkv", i, x, [
            Out(f"{wp}.attn.to_q", d, f"{wp}.attn.norm_q.weight"),
            Out(f"{wp}.attn.to_k", d, f"{wp}.attn.norm_k.weight"),
            Out(f"{wp}.attn.to_v", d)], norm_width=hd)
        cq, ck, cv = b.proj(f"{kp}.attn.add_qkv", i, cx, [
            Out(f"{wp}.attn.add_q_proj", d, f"{wp}.attn.norm_added_q.weight"),
            Out(f"{wp}.attn.add_k_proj", d, f"{wp}.attn.norm_added_k.weight"),
            Out(f"{wp}.attn.add_v_proj", d)], norm_width=hd)
        # Joint attention over [text, image]: the concatenations are new tensors.
        joint = [Act(f"{kp}.attn.{n}", p.rows + r.rows, d, p.grad or r.grad)
                 for n, p, r in (("q", cq, q), ("k", ck, k), ("v", cv, v))]
        o = b.attention(f"{kp}.attn.attention", i, *joint, heads, hd, copied=joint)
        # The image and text parts are views of the output: saved once, through their base.
        o_img, o_txt = Act(o.name, img.rows, d, o.grad), Act(o.name, txt.rows, d, o.grad)
        (y,) = b.proj(f"{kp}.attn.to_out", i, o_img, [Out(f"{wp}.attn.to_out.0", d)])
        img = b.residual(f"{kp}.attn.to_out", img, y, gated=True)
        (y,) = b.proj(f"{kp}.attn.to_add_out", i, o_txt, [Out(f"{wp}.attn.to_add_out", d)])
        txt = b.residual(f"{kp}.attn.to_add_out", txt, y, gated=True)
        (x,) = b.norm(f"{kp}.norm2", i, img, layer_norm=True)
        img = b.residual(f"{kp}.ff.down", img, b.ffn(f"{kp}.ff", f"{wp}.ff", i, x, c.ffn_dim), gated=True)
        (cx,) = b.norm(f"{kp}.norm2_context", i, txt, layer_norm=True)
        txt = b.residual(f"{kp}.ff_context.down", txt, b.ffn(f"{kp}.ff_context", f"{wp}.ff_context", i, cx, c.ffn_dim),
                         gated=True)

    s = Act("single.in", txt.rows + img.rows, d, txt.grad or img.grad)  # [text, image] concatenated
    b.passes(b.kernels[-1].name, ("pointwise", ONE_PASS * b.nbytes(s)))  # before the next fetch
    for j in range(c.num_layers - c.num_double_layers):
        i = c.num_double_layers + j
        kp, wp = f"single_blocks.{j}", f"single_transformer_blocks.{j}"
        b.proj(f"{kp}.norm.linear", i, temb, [Out(f"{wp}.norm.linear", 3 * d)])
        (x,) = b.norm(f"{kp}.norm", i, s, layer_norm=True)
        q, k, v, mlp = b.proj(f"{kp}.qkv_mlp", i, x, [
            Out(f"{wp}.attn.to_q", d, f"{wp}.attn.norm_q.weight"),
            Out(f"{wp}.attn.to_k", d, f"{wp}.attn.norm_k.weight"),
            Out(f"{wp}.attn.to_v", d),
            Out(f"{wp}.proj_mlp", c.ffn_dim, gelu=True)], norm_width=hd)
        o = b.attention(f"{kp}.attention", i, q, k, v, heads, hd)
        # proj_out reads [attention output, GELU(mlp)] concatenated: a new tensor.
        cat = Act(f"{kp}.cat", s.rows, d + c.ffn_dim, o.grad or mlp.grad)
        (y,) = b.proj(f"{kp}.proj_out", i, cat, [Out(f"{wp}.proj_out", d)])
        b.passes(f"{kp}.proj_out", ("pointwise", ONE_PASS * b.nbytes(cat)))
        s = b.residual(f"{kp}.proj_out", s, y, gated=True)

    img = Act(s.name, img.rows, d, s.grad)  # the image part of the last residual: a view
    b.linear("norm_out.linear", -1, temb, 2 * d)
    (x,) = b.norm("norm_out", -1, img, layer_norm=True)
    b.linear("proj_out", -1, x, c.in_channels)


# ----- forward


def _qkv(run: Run, w: KernelWeights, wp: str, x: Tensor, names: Sequence[str]) -> list[Tensor]:
    """q, k, v projections with per-head q/k RMSNorm; `names` = (q, k, v, norm_q, norm_k)."""
    from engine.models.layers import per_head_rms

    q = per_head_rms(run.linear(w, f"{wp}.{names[0]}", x), w[f"{wp}.{names[3]}.weight"], run.eps)
    k = per_head_rms(run.linear(w, f"{wp}.{names[1]}", x), w[f"{wp}.{names[4]}.weight"], run.eps)
    return [q, k, run.linear(w, f"{wp}.{names[2]}", x)]


def _modulation(run: Run, kname: str, module: str, silu_temb: Tensor, n: int) -> tuple[Tensor, ...]:
    """adaLN modulation rows from the conditioning embedding: n tensors (B, 1, d)."""
    return run.linear(run.kernel(kname), module, silu_temb)[:, None].chunk(n, -1)


def forward(run: Run, inp: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The kernels `build` declares, in order: {"image": ...}."""
    import torch
    import torch.nn.functional as F

    from engine.models.layers import ffn, gelu, layer_norm, linear_kernel, modulate, sdpa, timestep_freqs

    c, eps = run.cfg, run.eps
    heads = c["heads"]
    img = linear_kernel(run, "x_embedder", inp["image"])
    dt = img.dtype
    conds = [("timestep_embedder", timestep_freqs(inp["timestep"], c["timestep_dim"], dt))]
    if c["guidance_embeds"]:
        conds.append(("guidance_embedder", timestep_freqs(inp["guidance"], c["timestep_dim"], dt)))
    conds.append(("text_embedder", inp["pooled"]))
    temb = sum(linear_kernel(run, f"time_text_embed.{n}.linear_2",
                             F.silu(linear_kernel(run, f"time_text_embed.{n}.linear_1", x)))
               for n, x in conds)
    st = F.silu(temb)
    txt = linear_kernel(run, "context_embedder", inp["text"])
    s_len = txt.shape[1]
    attn_names = ("to_q", "to_k", "to_v", "norm_q", "norm_k")
    added_names = ("add_q_proj", "add_k_proj", "add_v_proj", "norm_added_q", "norm_added_k")

    for i in range(c["num_double_layers"]):
        kp, wp = f"double_blocks.{i}", f"transformer_blocks.{i}"
        m = _modulation(run, f"{kp}.norm1.linear", f"{wp}.norm1.linear", st, 6)
        cm = _modulation(run, f"{kp}.norm1_context.linear", f"{wp}.norm1_context.linear", st, 6)
        run.kernel(f"{kp}.norm1")
        x = modulate(layer_norm(img, eps), m[0], m[1])
        run.kernel(f"{kp}.norm1_context")
        cx = modulate(layer_norm(txt, eps), cm[0], cm[1])
        q, k, v = _qkv(run, run.kernel(f"{kp}.attn.qkv"), f"{wp}.attn", x, attn_names)
        cq, ck, cv = _qkv(run, run.kernel(f"{kp}.attn.add_qkv"), f"{wp}.attn", cx, added_names)
        run.kernel(f"{kp}.attn.attention")
        o = sdpa(torch.cat([cq, q], 1), torch.cat([ck, k], 1), torch.cat([cv, v], 1), heads)
        img = img + m[2] * run.linear(run.kernel(f"{kp}.attn.to_out"), f"{wp}.attn.to_out.0", o[:, s_len:])
        txt = txt + cm[2] * run.linear(run.kernel(f"{kp}.attn.to_add_out"), f"{wp}.attn.to_add_out", o[:, :s_len])
        run.kernel(f"{kp}.norm2")
        img = img + m[5] * ffn(run, f"{kp}.ff", f"{wp}.ff", modulate(layer_norm(img, eps), m[3], m[4]))
        run.kernel(f"{kp}.norm2_context")
        x = modulate(layer_norm(txt, eps), cm[3], cm[4])
        txt = txt + cm[5] * ffn(run, f"{kp}.ff_context", f"{wp}.ff_context", x)

    s = torch.cat([txt, img], 1)
    for j in range(c["num_layers"] - c["num_double_layers"]):
        kp, wp = f"single_blocks.{j}", f"single_transformer_blocks.{j}"
        shift, scale, gate = _modulation(run, f"{kp}.norm.linear", f"{wp}.norm.linear", st, 3)
        run.kernel(f"{kp}.norm")
        x = modulate(layer_norm(s, eps), shift, scale)
        w = run.kernel(f"{kp}.qkv_mlp")
        q, k, v = _qkv(run, w, f"{wp}.attn", x, attn_names)
        mlp = gelu(run.linear(w, f"{wp}.proj_mlp", x))
        run.kernel(f"{kp}.attention")
        o = sdpa(q, k, v, heads)
        s = s + gate * run.linear(run.kernel(f"{kp}.proj_out"), f"{wp}.proj_out", torch.cat([o, mlp], -1))

    scale, shift = _modulation(run, "norm_out.linear", "norm_out.linear", st, 2)
    run.kernel("norm_out")
    return {"image": linear_kernel(run, "proj_out", modulate(layer_norm(s[:, s_len:], eps), shift, scale))}


def inputs(c: Mapping[str, Any], workload: WorkloadShape, draw: Draw) -> dict[str, Tensor]:
    """Packed image latents, T5 text embeddings, the CLIP pooled vector, timesteps (and guidance)."""
    bs = workload.batch
    inp = {"image": draw.randn(bs, workload.video_tokens, c["in_channels"]),
           "text": draw.randn(bs, workload.text_tokens, c["text_dim"]),
           "pooled": draw.randn(bs, c["pooled_dim"]), "timestep": draw.steps()}
    if c["guidance_embeds"]:
        inp["guidance"] = draw.steps()
    return inp
