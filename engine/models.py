"""Real torch math for spec-built models, one kernel of `spec.kernels` at a time.

The executor streams weights; this module only computes. `forward` walks the
kernels in spec order: before the math of kernel i it calls `source.fetch(i)`
exactly once (weightless kernels too), and it may use only the tensors that
fetch returned, only until the next fetch (the executor may evict them then).
Both rules are enforced: a kernel out of order, a weight used outside its
kernel, a weight the kernel does not read, or a declared weight left unused
raises `ScheduleError`; a weight the source did not hand over raises
`MissingWeightError`.

The math is each family's architecture with its real weight shapes, without
RoPE and with a plain sinusoidal timestep embedding (per sample, not per
token). LoRA adapters (`init_lora`) add `B(A(x))` (scale 1, i.e. alpha =
rank) to the linears they target.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch
import torch.nn.functional as F

from engine.spec import LORA_TARGETS, ModelSpec, WorkloadShape, is_adapted

TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}

Tensor = torch.Tensor


class WeightSource(Protocol):
    def fetch(self, kernel_index: int) -> Mapping[str, Tensor]:
        """The tensors (by weight name) that kernel `kernel_index` of `spec.kernels` reads."""


class MissingWeightError(LookupError):
    """A kernel needs a weight that its source did not hand over."""


class ScheduleError(RuntimeError):
    """The forward and the spec disagree on kernels or on which weights a kernel reads."""


class DictSource:
    """Everything resident: a WeightSource over a plain `{name: tensor}` dict."""

    def __init__(self, spec: ModelSpec, weights: Mapping[str, Tensor]):
        self.spec = spec
        self.weights = weights

    def fetch(self, kernel_index: int) -> Mapping[str, Tensor]:
        kernel = self.spec.kernels[kernel_index]
        missing = [n for n in kernel.weights if n not in self.weights]
        if missing:
            raise MissingWeightError(f"kernel {kernel.name} reads {missing[0]}, which the weight dict lacks; "
                                     "load the full checkpoint or use random_weights(spec)")
        return {n: self.weights[n] for n in kernel.weights}


class _Weights:
    """One kernel's fetched tensors, usable until the next kernel is fetched."""

    def __init__(self, spec: ModelSpec, index: int, fetched: Mapping[str, Tensor]):
        self.spec = spec
        self.kernel = spec.kernels[index]
        self.fetched = fetched
        self.used: set[str] = set()
        self.open = True

    def __getitem__(self, name: str) -> Tensor:
        k = self.kernel
        if not self.open:
            raise ScheduleError(f"weight {name} of kernel {k.name} used after the next kernel was fetched")
        if name not in k.weights:
            raise ScheduleError(f"kernel {k.name} does not read {name}; fix the spec builder or engine.models")
        if name not in self.fetched:
            raise MissingWeightError(f"kernel {k.name} needs {name} but its source returned none; "
                                     "the source must hand over every weight of the kernel")
        t = self.fetched[name]
        want = self.spec.weights[name].shape
        if tuple(t.shape) != want:
            raise ValueError(f"weight {name} has shape {tuple(t.shape)}, the spec says {want}; "
                             "use a checkpoint of this model")
        self.used.add(name)
        return t

    def close(self) -> None:
        unused = [n for n in self.kernel.weights if n not in self.used]
        if unused:
            raise ScheduleError(f"kernel {self.kernel.name} declares {unused[0]} but the forward never used it")
        self.open = False


class _Run:
    """One forward pass: the kernel cursor, the LoRA adapters and the model config."""

    def __init__(self, spec: ModelSpec, source: WeightSource, lora: Mapping[str, Tensor] | None):
        self.spec = spec
        self.source = source
        self.lora = lora or {}
        self.lora_used: set[str] = set()
        self.cfg: dict[str, Any] = spec.meta["config"]
        self.eps: float = self.cfg["eps"]
        self.next = 0
        self.current: _Weights | None = None

    def kernel(self, name: str) -> _Weights:
        kernels = self.spec.kernels
        i = self.next
        if i >= len(kernels) or kernels[i].name != name:
            there = kernels[i].name if i < len(kernels) else "the end"
            raise ScheduleError(f"forward reached kernel {name} but spec.kernels[{i}] is {there}; "
                                "the spec builder and engine.models disagree")
        if self.current is not None:
            self.current.close()
        self.current = _Weights(self.spec, i, self.source.fetch(i))
        self.next += 1
        return self.current

    def linear(self, w: _Weights, module: str, x: Tensor, bias: bool = True) -> Tensor:
        y = F.linear(x, w[f"{module}.weight"], w[f"{module}.bias"] if bias else None)
        if f"{module}.lora_A" in self.lora:
            self.lora_used.add(module)
            y = y + F.linear(F.linear(x, self.lora[f"{module}.lora_A"]), self.lora[f"{module}.lora_B"])
        return y

    def finish(self) -> None:
        if self.current is not None:
            self.current.close()
        if self.next != len(self.spec.kernels):
            raise ScheduleError(f"forward ran {self.next} of {len(self.spec.kernels)} kernels; "
                                f"next is {self.spec.kernels[self.next].name}")
        unused = sorted({k.rsplit(".", 1)[0] for k in self.lora} - self.lora_used)
        if unused:
            raise ScheduleError(f"LoRA adapter {unused[0]} matches no linear of {self.spec.name}; "
                                "build it with init_lora(spec, ...)")


# ----- shared pieces


def _rms(x: Tensor, eps: float, w: Tensor | None = None) -> Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _ln(x: Tensor, eps: float, w: Tensor | None = None, b: Tensor | None = None) -> Tensor:
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def _mod(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale) + shift


def _gelu(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


def _sdpa(q: Tensor, k: Tensor, v: Tensor, heads: int, kv_heads: int | None = None,
          causal: bool = False) -> Tensor:
    """(B, L, heads*hd) in and out; grouped-query when kv_heads < heads."""
    kvh = kv_heads or heads
    qh = q.unflatten(-1, (heads, -1)).transpose(1, 2)
    kh = k.unflatten(-1, (kvh, -1)).transpose(1, 2)
    vh = v.unflatten(-1, (kvh, -1)).transpose(1, 2)
    o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, enable_gqa=kvh != heads)
    return o.transpose(1, 2).flatten(2)


def _freqs(t: Tensor, dim: int, dtype: torch.dtype) -> Tensor:
    """Sinusoidal timestep features, (B,) -> (B, dim), cos half first."""
    half = dim // 2
    f = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    arg = t.float()[:, None] * f[None]
    return torch.cat([torch.cos(arg), torch.sin(arg)], dim=-1).to(dtype)


def _per_head_rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """RMSNorm over each head (FLUX): the weight is one head wide."""
    return F.rms_norm(x.unflatten(-1, (-1, w.shape[0])), (w.shape[0],), w, eps).flatten(-2)


def _attn(run: _Run, kp: str, wp: str, x: Tensor, ctx: Tensor | None, heads: int) -> Tensor:
    """Mirrors spec._attn: q/k/v (+ q/k RMSNorm), the core, to_out.0."""
    eps = run.eps
    if ctx is None:
        w = run.kernel(f"{kp}.qkv")
        q = _rms(run.linear(w, f"{wp}.to_q", x), eps, w[f"{wp}.norm_q.weight"])
        k = _rms(run.linear(w, f"{wp}.to_k", x), eps, w[f"{wp}.norm_k.weight"])
        v = run.linear(w, f"{wp}.to_v", x)
    else:
        w = run.kernel(f"{kp}.q")
        q = _rms(run.linear(w, f"{wp}.to_q", x), eps, w[f"{wp}.norm_q.weight"])
        w = run.kernel(f"{kp}.kv")
        k = _rms(run.linear(w, f"{wp}.to_k", ctx), eps, w[f"{wp}.norm_k.weight"])
        v = run.linear(w, f"{wp}.to_v", ctx)
    run.kernel(f"{kp}.attention")
    o = _sdpa(q, k, v, heads)
    return run.linear(run.kernel(f"{kp}.to_out"), f"{wp}.to_out.0", o)


def _ffn(run: _Run, kp: str, wp: str, x: Tensor) -> Tensor:
    h = _gelu(run.linear(run.kernel(f"{kp}.up"), f"{wp}.net.0.proj", x))
    return run.linear(run.kernel(f"{kp}.down"), f"{wp}.net.2", h)


def _single(run: _Run, module: str, x: Tensor) -> Tensor:
    """A kernel of one linear named after its module."""
    return run.linear(run.kernel(module), module, x)


# ----- DiT: LTX-Video, LTX-2, Wan2.1


def _adaln_single(run: _Run, module: str, freqs: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Returns the embedded timestep (B, d) and k modulation rows (B, k, d)."""
    emb = f"{module}.emb.timestep_embedder"
    h = F.silu(_single(run, f"{emb}.linear_1", freqs))
    e = _single(run, f"{emb}.linear_2", h)
    return e, _single(run, f"{module}.linear", F.silu(e)).unflatten(-1, (k, -1))


def _caption(run: _Run, module: str, text: Tensor) -> Tensor:
    return _single(run, f"{module}.linear_2", _gelu(_single(run, f"{module}.linear_1", text)))


def _rows(table: Tensor, values: Tensor) -> list[Tensor]:
    """Table (k, d) + per-sample values (B, k, d) -> k tensors (B, 1, d) that broadcast over tokens."""
    return list((table.reshape(values.shape[1:]) + values).unsqueeze(2).unbind(1))


def _ltx(run: _Run, inp: Mapping[str, Tensor]) -> dict[str, Tensor]:
    c, eps = run.cfg, run.eps
    audio = c["audio_dim"] > 0
    v = _single(run, "proj_in", inp["video"])
    a = _single(run, "audio_proj_in", inp["audio"]) if audio else None
    freqs = _freqs(inp["timestep"], c["timestep_dim"], v.dtype)
    adaln = [("time_embed", 6)]
    if audio:
        adaln += [("audio_time_embed", 6), ("av_cross_attn_video_scale_shift", 4),
                  ("av_cross_attn_audio_scale_shift", 4), ("av_cross_attn_video_a2v_gate", 1),
                  ("av_cross_attn_audio_v2a_gate", 1)]
    emb = {m: _adaln_single(run, m, freqs, k) for m, k in adaln}
    text = _caption(run, "caption_projection", inp["text"])
    atext = _caption(run, "audio_caption_projection", inp["text"]) if audio else None

    for i in range(c["num_layers"]):
        kp, wp = f"blocks.{i}", f"transformer_blocks.{i}"
        w = run.kernel(f"{kp}.ada")
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = _rows(
            w[f"{wp}.scale_shift_table"], emb["time_embed"][1])
        if audio:
            a_shift_msa, a_scale_msa, a_gate_msa, a_shift_mlp, a_scale_mlp, a_gate_mlp = _rows(
                w[f"{wp}.audio_scale_shift_table"], emb["audio_time_embed"][1])
            vt = w[f"{wp}.video_a2v_cross_attn_scale_shift_table"]
            at = w[f"{wp}.audio_a2v_cross_attn_scale_shift_table"]
            v_a2v_scale, v_a2v_shift, v_v2a_scale, v_v2a_shift = _rows(
                vt[:4], emb["av_cross_attn_video_scale_shift"][1])
            (a2v_gate,) = _rows(vt[4:], emb["av_cross_attn_video_a2v_gate"][1])
            a_a2v_scale, a_a2v_shift, a_v2a_scale, a_v2a_shift = _rows(
                at[:4], emb["av_cross_attn_audio_scale_shift"][1])
            (v2a_gate,) = _rows(at[4:], emb["av_cross_attn_audio_v2a_gate"][1])
        # 1. self attention
        run.kernel(f"{kp}.norm1")
        x = _mod(_rms(v, eps), shift_msa, scale_msa)
        v = v + _attn(run, f"{kp}.attn1", f"{wp}.attn1", x, None, c["heads"]) * gate_msa
        if audio:
            run.kernel(f"{kp}.audio_norm1")
            x = _mod(_rms(a, eps), a_shift_msa, a_scale_msa)
            a = a + _attn(run, f"{kp}.audio_attn1", f"{wp}.audio_attn1", x, None, c["audio_heads"]) * a_gate_msa
        # 2. cross attention to the text
        run.kernel(f"{kp}.norm2")
        v = v + _attn(run, f"{kp}.attn2", f"{wp}.attn2", _rms(v, eps), text, c["heads"])
        if audio:
            run.kernel(f"{kp}.audio_norm2")
            a = a + _attn(run, f"{kp}.audio_attn2", f"{wp}.audio_attn2", _rms(a, eps), atext, c["audio_heads"])
            # 3. audio-to-video (Q video, K/V audio), then video-to-audio, both from these norms
            run.kernel(f"{kp}.audio_to_video_norm")
            nv = _rms(v, eps)
            v_a2v, v_v2a = _mod(nv, v_a2v_shift, v_a2v_scale), _mod(nv, v_v2a_shift, v_v2a_scale)
            run.kernel(f"{kp}.video_to_audio_norm")
            na = _rms(a, eps)
            a_a2v, a_v2a = _mod(na, a_a2v_shift, a_a2v_scale), _mod(na, a_v2a_shift, a_v2a_scale)
            v = v + a2v_gate * _attn(run, f"{kp}.audio_to_video_attn", f"{wp}.audio_to_video_attn",
                                     v_a2v, a_a2v, c["audio_heads"])
            a = a + v2a_gate * _attn(run, f"{kp}.video_to_audio_attn", f"{wp}.video_to_audio_attn",
                                     a_v2a, v_v2a, c["audio_heads"])
        # 4. feed-forward
        run.kernel(f"{kp}.norm3")
        v = v + _ffn(run, f"{kp}.ff", f"{wp}.ff", _mod(_rms(v, eps), shift_mlp, scale_mlp)) * gate_mlp
        if audio:
            run.kernel(f"{kp}.audio_norm3")
            x = _mod(_rms(a, eps), a_shift_mlp, a_scale_mlp)
            a = a + _ffn(run, f"{kp}.audio_ff", f"{wp}.audio_ff", x) * a_gate_mlp

    out = {"video": _ltx_out(run, "norm_out", "scale_shift_table", "proj_out", v, emb["time_embed"][0])}
    if audio:
        out["audio"] = _ltx_out(run, "audio_norm_out", "audio_scale_shift_table", "audio_proj_out", a,
                                emb["audio_time_embed"][0])
    return out


def _ltx_out(run: _Run, norm: str, table: str, proj: str, x: Tensor, emb: Tensor) -> Tensor:
    """Final LayerNorm modulated by (table + embedded timestep), then the output projection."""
    w = run.kernel(norm)
    shift, scale = (w[table].reshape(2, -1) + emb[:, None]).unsqueeze(2).unbind(1)
    return _single(run, proj, _mod(_ln(x, run.eps), shift, scale))


def _wan(run: _Run, inp: Mapping[str, Tensor]) -> dict[str, Tensor]:
    c, eps = run.cfg, run.eps
    w = run.kernel("patch_embedding")
    wp = w["patch_embedding.weight"]
    v = F.conv3d(inp["video"], wp, w["patch_embedding.bias"], stride=wp.shape[2:]).flatten(2).transpose(1, 2)
    freqs = _freqs(inp["timestep"], c["timestep_dim"], v.dtype)
    temb = _single(run, "condition_embedder.time_embedder.linear_2",
                   F.silu(_single(run, "condition_embedder.time_embedder.linear_1", freqs)))
    tproj = _single(run, "condition_embedder.time_proj", F.silu(temb)).unflatten(-1, (6, -1))
    text = _caption(run, "condition_embedder.text_embedder", inp["text"])

    for i in range(c["num_layers"]):
        kp = wp = f"blocks.{i}"
        w = run.kernel(f"{kp}.ada")
        shift_msa, scale_msa, gate_msa, c_shift, c_scale, c_gate = _rows(w[f"{wp}.scale_shift_table"], tproj)
        run.kernel(f"{kp}.norm1")
        x = _mod(_ln(v, eps), shift_msa, scale_msa)
        v = v + _attn(run, f"{kp}.attn1", f"{wp}.attn1", x, None, c["heads"]) * gate_msa
        w = run.kernel(f"{kp}.norm2")
        x = _ln(v, eps, w[f"{wp}.norm2.weight"], w[f"{wp}.norm2.bias"])
        v = v + _attn(run, f"{kp}.attn2", f"{wp}.attn2", x, text, c["heads"])
        run.kernel(f"{kp}.norm3")
        v = v + _ffn(run, f"{kp}.ffn", f"{wp}.ffn", _mod(_ln(v, eps), c_shift, c_scale)) * c_gate
    return {"video": _ltx_out(run, "norm_out", "scale_shift_table", "proj_out", v, temb)}


def _dit(run: _Run, inp: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {"ltx": _ltx, "wan": _wan}[run.cfg["variant"]](run, inp)


# ----- FLUX.1


def _flux_qkv(run: _Run, w: _Weights, wp: str, x: Tensor, names: Sequence[str]) -> list[Tensor]:
    """q, k, v projections with per-head q/k RMSNorm; `names` = (q, k, v, norm_q, norm_k)."""
    q = _per_head_rms(run.linear(w, f"{wp}.{names[0]}", x), w[f"{wp}.{names[3]}.weight"], run.eps)
    k = _per_head_rms(run.linear(w, f"{wp}.{names[1]}", x), w[f"{wp}.{names[4]}.weight"], run.eps)
    return [q, k, run.linear(w, f"{wp}.{names[2]}", x)]


def _flux_mod(run: _Run, kname: str, module: str, silu_temb: Tensor, n: int) -> tuple[Tensor, ...]:
    """adaLN modulation rows from the conditioning embedding: n tensors (B, 1, d)."""
    return run.linear(run.kernel(kname), module, silu_temb)[:, None].chunk(n, -1)


def _flux(run: _Run, inp: Mapping[str, Tensor]) -> dict[str, Tensor]:
    c, eps = run.cfg, run.eps
    heads = c["heads"]
    img = _single(run, "x_embedder", inp["image"])
    dt = img.dtype
    conds = [("timestep_embedder", _freqs(inp["timestep"], c["timestep_dim"], dt))]
    if c["guidance_embeds"]:
        conds.append(("guidance_embedder", _freqs(inp["guidance"], c["timestep_dim"], dt)))
    conds.append(("text_embedder", inp["pooled"]))
    temb = sum(_single(run, f"time_text_embed.{n}.linear_2", F.silu(_single(run, f"time_text_embed.{n}.linear_1", x)))
               for n, x in conds)
    st = F.silu(temb)
    txt = _single(run, "context_embedder", inp["text"])
    s_len = txt.shape[1]
    attn_names = ("to_q", "to_k", "to_v", "norm_q", "norm_k")
    added_names = ("add_q_proj", "add_k_proj", "add_v_proj", "norm_added_q", "norm_added_k")

    for i in range(c["num_double_layers"]):
        kp, wp = f"double_blocks.{i}", f"transformer_blocks.{i}"
        m = _flux_mod(run, f"{kp}.norm1.linear", f"{wp}.norm1.linear", st, 6)
        cm = _flux_mod(run, f"{kp}.norm1_context.linear", f"{wp}.norm1_context.linear", st, 6)
        run.kernel(f"{kp}.norm1")
        x = _mod(_ln(img, eps), m[0], m[1])
        run.kernel(f"{kp}.norm1_context")
        cx = _mod(_ln(txt, eps), cm[0], cm[1])
        q, k, v = _flux_qkv(run, run.kernel(f"{kp}.attn.qkv"), f"{wp}.attn", x, attn_names)
        cq, ck, cv = _flux_qkv(run, run.kernel(f"{kp}.attn.add_qkv"), f"{wp}.attn", cx, added_names)
        run.kernel(f"{kp}.attn.attention")
        o = _sdpa(torch.cat([cq, q], 1), torch.cat([ck, k], 1), torch.cat([cv, v], 1), heads)
        img = img + m[2] * run.linear(run.kernel(f"{kp}.attn.to_out"), f"{wp}.attn.to_out.0", o[:, s_len:])
        txt = txt + cm[2] * run.linear(run.kernel(f"{kp}.attn.to_add_out"), f"{wp}.attn.to_add_out", o[:, :s_len])
        run.kernel(f"{kp}.norm2")
        img = img + m[5] * _ffn(run, f"{kp}.ff", f"{wp}.ff", _mod(_ln(img, eps), m[3], m[4]))
        run.kernel(f"{kp}.norm2_context")
        txt = txt + cm[5] * _ffn(run, f"{kp}.ff_context", f"{wp}.ff_context", _mod(_ln(txt, eps), cm[3], cm[4]))

    s = torch.cat([txt, img], 1)
    for j in range(c["num_layers"] - c["num_double_layers"]):
        kp, wp = f"single_blocks.{j}", f"single_transformer_blocks.{j}"
        shift, scale, gate = _flux_mod(run, f"{kp}.norm.linear", f"{wp}.norm.linear", st, 3)
        run.kernel(f"{kp}.norm")
        x = _mod(_ln(s, eps), shift, scale)
        w = run.kernel(f"{kp}.qkv_mlp")
        q, k, v = _flux_qkv(run, w, f"{wp}.attn", x, attn_names)
        mlp = _gelu(run.linear(w, f"{wp}.proj_mlp", x))
        run.kernel(f"{kp}.attention")
        o = _sdpa(q, k, v, heads)
        s = s + gate * run.linear(run.kernel(f"{kp}.proj_out"), f"{wp}.proj_out", torch.cat([o, mlp], -1))

    scale, shift = _flux_mod(run, "norm_out.linear", "norm_out.linear", st, 2)
    run.kernel("norm_out")
    return {"image": _single(run, "proj_out", _mod(_ln(s[:, s_len:], eps), shift, scale))}


# ----- Llama-3


def _llama(run: _Run, inp: Mapping[str, Tensor]) -> dict[str, Tensor]:
    c, eps = run.cfg, run.eps
    decode = run.spec.meta["workload"]["kind"] == "decode"
    heads, kvh = c["heads"], c["kv_heads"]
    x = F.embedding(inp["tokens"], run.kernel("model.embed_tokens")["model.embed_tokens.weight"])
    for i in range(c["num_layers"]):
        kp, wp = f"layers.{i}", f"model.layers.{i}"
        w = run.kernel(f"{kp}.input_layernorm")
        h = _rms(x, eps, w[f"{wp}.input_layernorm.weight"])
        w = run.kernel(f"{kp}.self_attn.qkv")
        q, k, v = (run.linear(w, f"{wp}.self_attn.{p}_proj", h, bias=False) for p in "qkv")
        run.kernel(f"{kp}.self_attn.attention")
        if decode:  # the cache (B, kv_heads, context, hd), flattened to (B, context, kv_heads*hd)
            k = torch.cat([inp[f"k_cache.{i}"].transpose(1, 2).flatten(2), k], 1)
            v = torch.cat([inp[f"v_cache.{i}"].transpose(1, 2).flatten(2), v], 1)
        o = _sdpa(q, k, v, heads, kvh, causal=not decode)
        x = x + run.linear(run.kernel(f"{kp}.self_attn.o_proj"), f"{wp}.self_attn.o_proj", o, bias=False)
        w = run.kernel(f"{kp}.post_attention_layernorm")
        h = _rms(x, eps, w[f"{wp}.post_attention_layernorm.weight"])
        w = run.kernel(f"{kp}.mlp.gate_up")
        gate = run.linear(w, f"{wp}.mlp.gate_proj", h, bias=False)
        h = F.silu(gate) * run.linear(w, f"{wp}.mlp.up_proj", h, bias=False)
        x = x + run.linear(run.kernel(f"{kp}.mlp.down_proj"), f"{wp}.mlp.down_proj", h, bias=False)
    h = _rms(x, eps, run.kernel("model.norm")["model.norm.weight"])
    return {"logits": run.linear(run.kernel("lm_head"), "lm_head", h, bias=False)}


_FORWARDS: dict[str, Callable[[_Run, Mapping[str, Tensor]], dict[str, Tensor]]] = {
    "dit": _dit, "flux": _flux, "llama": _llama,
}


def forward(spec: ModelSpec, source: WeightSource, inputs: Mapping[str, Tensor],
            lora: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
    """Run the model: `source.fetch(i)` once per kernel, in spec order, then kernel i's math."""
    run = _Run(spec, source, lora)
    out = _FORWARDS[spec.family](run, inputs)
    run.finish()
    return out


# ----- inputs, adapters and weights for tests and references


def _generator(seed: int) -> torch.Generator:
    # Drawn on the CPU, then moved: the same seed gives the same tensors on any device.
    return torch.Generator().manual_seed(seed)


def make_inputs(spec: ModelSpec, workload: WorkloadShape, device: torch.device | str = "cpu",
                dtype: torch.dtype | None = None, seed: int = 0) -> dict[str, Tensor]:
    """Random, seeded inputs of the shapes `forward` expects for this workload."""
    c = spec.meta["config"]
    dt = dtype or TORCH_DTYPES[c["dtype"]]
    g = _generator(seed)
    bs = workload.batch

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g).to(device, dt)

    def steps() -> Tensor:
        return (torch.rand(bs, generator=g) * 1000).to(device)

    if spec.family == "llama":
        decode = workload.kind == "decode"
        tokens = torch.randint(0, c["vocab"], (bs, 1 if decode else workload.text_tokens), generator=g)
        inp = {"tokens": tokens.to(device)}
        if decode:
            for i in range(c["num_layers"]):
                for kv in ("k_cache", "v_cache"):
                    inp[f"{kv}.{i}"] = randn(bs, c["kv_heads"], workload.context_tokens, c["head_dim"])
        return inp
    if spec.family == "flux":
        inp = {"image": randn(bs, workload.video_tokens, c["in_channels"]),
               "text": randn(bs, workload.text_tokens, c["text_dim"]),
               "pooled": randn(bs, c["pooled_dim"]), "timestep": steps()}
        if c["guidance_embeds"]:
            inp["guidance"] = steps()
        return inp
    if c["variant"] == "wan":  # a latent whose patches are the video tokens
        pt, ph, pw = c["patch_size"]
        video = randn(bs, c["in_channels"], pt * workload.video_tokens, ph, pw)
    else:
        video = randn(bs, workload.video_tokens, c["in_channels"])
    inp = {"video": video, "text": randn(bs, workload.text_tokens, c["text_dim"]), "timestep": steps()}
    if c["audio_dim"]:
        inp["audio"] = randn(bs, workload.audio_tokens, c["audio_in_channels"])
    return inp


def init_lora(spec: ModelSpec, rank: int, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
              seed: int = 0, targets: Sequence[str] | None = None) -> dict[str, Tensor]:
    """Trainable `{module}.lora_A` (rank, in) and `{module}.lora_B` (out, rank) for every targeted linear.

    `targets` default to the family's (spec.LORA_TARGETS). B starts small but
    not zero, so both A and B get non-trivial gradients to compare."""
    if rank <= 0:
        raise ValueError(f"LoRA rank={rank} must be positive")
    targets = tuple(targets or LORA_TARGETS[spec.family])
    dt = dtype or TORCH_DTYPES[spec.meta["config"]["dtype"]]
    g = _generator(seed)
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


def random_weights(spec: ModelSpec, seed: int = 0, device: torch.device | str = "cpu",
                   dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """Seeded weights at sane scales (small models only): linears ~ 1/sqrt(fan_in),
    biases small, norm weights near 1, scale_shift tables ~ 1/sqrt(width)."""
    g = _generator(seed)
    out: dict[str, Tensor] = {}
    for name, ws in spec.weights.items():
        dt = dtype or TORCH_DTYPES[ws.dtype]
        shape = ws.shape
        r = torch.randn(*shape, generator=g)
        if name.endswith(".bias"):
            t = r * 0.02
        elif len(shape) == 1:
            t = 1 + 0.1 * r
        elif "scale_shift_table" in name:
            t = r / math.sqrt(shape[-1])
        else:
            t = r / math.sqrt(math.prod(shape[1:]))
        out[name] = t.to(device, dt)
    return out
