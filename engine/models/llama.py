"""Llama-3 (`family: llama`): schema, checks, spec builder, forward, inputs.

A decoder with SwiGLU MLPs, RMSNorm, grouped-query attention and untied
embeddings; no RoPE in the forward. Workload kind `decode` runs one new token
per sequence against a KV cache of `context_tokens`; other kinds run
`text_tokens` causally."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from omegaconf import MISSING

from engine.models.builder import Act, Out, SpecBuilder
from engine.models.spec import ModelConfig, SpecError, WorkloadShape, check_positive, check_product, require_tokens

if TYPE_CHECKING:
    from torch import Tensor

    from engine.models.run import Run
    from engine.models.seeded import Draw

# Adapted linears when the workload names none (module-name suffixes).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass
class LlamaModelConfig(ModelConfig):
    """Llama-3 decoder: SwiGLU MLP, RMSNorm, grouped-query attention, untied embeddings."""

    family: str = "llama"
    hidden: int = MISSING  # the residual stream's width
    intermediate: int = MISSING  # the MLP's hidden width
    heads: int = MISSING
    kv_heads: int = MISSING  # grouped-query attention: heads share kv_heads keys and values
    head_dim: int = 128
    vocab: int = 128256
    eps: float = 1e-5  # of every RMSNorm


def check(cfg: LlamaModelConfig) -> None:
    """What the schema's types cannot say."""
    check_positive(cfg, "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab")
    check_product(cfg, "heads", "head_dim", "hidden")
    if cfg.heads % cfg.kv_heads:
        raise SpecError(f"model.heads={cfg.heads} is not a multiple of model.kv_heads={cfg.kv_heads}; "
                        "fix kv_heads")


def build(b: SpecBuilder, c: LlamaModelConfig) -> None:
    """Llama's weights and kernels in launch order."""
    tok = b.tok
    bs, hid, hd = tok.batch, c.hidden, c.head_dim
    if tok.kind == "decode":
        lq, lk = 1, tok.context + 1  # one new token per sequence, attending to the cache and itself
    else:
        require_tokens(tok.text, "text_tokens", c.name)
        lq = lk = tok.text
    rows = bs * lq
    emb = b.param("model.embed_tokens.weight", (c.vocab, hid))
    x = Act("model.embed_tokens.out", rows, hid)
    b.kernel("model.embed_tokens", -1, "embed", (emb,), 0, rows * 8 + b.nbytes(x))
    kv = c.kv_heads * hd
    for i in range(c.num_layers):
        kp, wp = f"layers.{i}", f"model.layers.{i}"
        (h,) = b.norm(f"{kp}.input_layernorm", i, x, modulated=False,
                      weights=[(f"{wp}.input_layernorm.weight", (hid,))])
        q, k, v = b.proj(f"{kp}.self_attn.qkv", i, h, [
            Out(f"{wp}.self_attn.q_proj", hid), Out(f"{wp}.self_attn.k_proj", kv),
            Out(f"{wp}.self_attn.v_proj", kv)], bias=False)
        copied: list[Act] = []
        if tok.kind == "decode":  # the cache, with this step's k and v appended
            k, v = Act(f"{kp}.k_cache", bs * lk, kv, k.grad), Act(f"{kp}.v_cache", bs * lk, kv, v.grad)
            copied = [k, v, k, v]  # each cache made contiguous in rows, then concatenated
        o = b.attention(f"{kp}.self_attn.attention", i, q, k, v, c.heads, hd, copied=copied)
        (y,) = b.proj(f"{kp}.self_attn.o_proj", i, o, [Out(f"{wp}.self_attn.o_proj", hid)], bias=False)
        x = b.residual(f"{kp}.self_attn.o_proj", x, y)
        (h,) = b.norm(f"{kp}.post_attention_layernorm", i, x, modulated=False,
                      weights=[(f"{wp}.post_attention_layernorm.weight", (hid,))])
        inter = rows * c.intermediate * b.act_bytes
        swiglu = [(f"{kp}.mlp.gate_up.{part}", inter) for part in ("gate", "up", "silu")]
        gate, _up = b.proj(f"{kp}.mlp.gate_up", i, h, [Out(f"{wp}.mlp.gate_proj", c.intermediate),
                                                        Out(f"{wp}.mlp.up_proj", c.intermediate)],
                           bias=False, extra_saves=swiglu)
        # silu(gate) reads and writes; times up reads two and writes one
        b.passes(f"{kp}.mlp.gate_up", ("pointwise", 5 * inter))
        (y,) = b.proj(f"{kp}.mlp.down_proj", i, Act(f"{kp}.mlp.h", rows, c.intermediate, gate.grad),
                      [Out(f"{wp}.mlp.down_proj", hid)], bias=False)
        x = b.residual(f"{kp}.mlp.down_proj", x, y)
    (h,) = b.norm("model.norm", -1, x, modulated=False, weights=[("model.norm.weight", (hid,))])
    b.linear("lm_head", -1, h, c.vocab, bias=False)


# ----- forward


def forward(run: Run, inp: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The kernels `build` declares, in order: {"logits": ...}."""
    import torch
    import torch.nn.functional as F

    from engine.models.layers import rms_norm, sdpa

    c, eps = run.cfg, run.eps
    decode = run.spec.meta["workload"]["kind"] == "decode"
    heads, kvh = c["heads"], c["kv_heads"]
    x = F.embedding(inp["tokens"], run.kernel("model.embed_tokens")["model.embed_tokens.weight"])
    for i in range(c["num_layers"]):
        kp, wp = f"layers.{i}", f"model.layers.{i}"
        w = run.kernel(f"{kp}.input_layernorm")
        h = rms_norm(x, eps, w[f"{wp}.input_layernorm.weight"])
        w = run.kernel(f"{kp}.self_attn.qkv")
        q, k, v = (run.linear(w, f"{wp}.self_attn.{p}_proj", h, bias=False) for p in "qkv")
        run.kernel(f"{kp}.self_attn.attention")
        if decode:  # the cache (B, kv_heads, context, hd), flattened to (B, context, kv_heads*hd)
            k = torch.cat([inp[f"k_cache.{i}"].transpose(1, 2).flatten(2), k], 1)
            v = torch.cat([inp[f"v_cache.{i}"].transpose(1, 2).flatten(2), v], 1)
        o = sdpa(q, k, v, heads, kvh, causal=not decode)
        x = x + run.linear(run.kernel(f"{kp}.self_attn.o_proj"), f"{wp}.self_attn.o_proj", o, bias=False)
        w = run.kernel(f"{kp}.post_attention_layernorm")
        h = rms_norm(x, eps, w[f"{wp}.post_attention_layernorm.weight"])
        w = run.kernel(f"{kp}.mlp.gate_up")
        gate = run.linear(w, f"{wp}.mlp.gate_proj", h, bias=False)
        h = F.silu(gate) * run.linear(w, f"{wp}.mlp.up_proj", h, bias=False)
        x = x + run.linear(run.kernel(f"{kp}.mlp.down_proj"), f"{wp}.mlp.down_proj", h, bias=False)
    h = rms_norm(x, eps, run.kernel("model.norm")["model.norm.weight"])
    return {"logits": run.linear(run.kernel("lm_head"), "lm_head", h, bias=False)}


def inputs(c: Mapping[str, Any], workload: WorkloadShape, draw: Draw) -> dict[str, Tensor]:
    """Token ids; for decode one token per sequence and each layer's K/V cache (B, kv_heads, context, hd)."""
    bs = workload.batch
    decode = workload.kind == "decode"
    inp = {"tokens": draw.tokens(c["vocab"], (bs, 1 if decode else workload.text_tokens))}
    if decode:
        for i in range(c["num_layers"]):
            for kv in ("k_cache", "v_cache"):
                inp[f"{kv}.{i}"] = draw.randn(bs, c["kv_heads"], workload.context_tokens, c["head_dim"])
    return inp
