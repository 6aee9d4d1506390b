"""LTX-Video and LTX-2 (`family: dit`, `variant: ltx`): spec builder, forward, inputs.

The video stream, and with `audio_dim > 0` LTX-2's audio stream with its
audio-to-video and video-to-audio cross attentions. The forward has no RoPE and
a plain sinusoidal timestep embedding (per sample, not per token)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from engine.models.builder import Act, SpecBuilder
from engine.models.dit import DitModelConfig, caption, modulation_rows, output_layer
from engine.models.spec import WorkloadShape, require_tokens

if TYPE_CHECKING:
    from torch import Tensor

    from engine.models.run import Run
    from engine.models.seeded import Draw


def _adaln_single_spec(b: SpecBuilder, module: str, t: Act, width: int, k: int) -> None:
    """PixArt adaLN-single: timestep embedder (linear_1, SiLU, linear_2), then SiLU and a k*width linear."""
    emb = f"{module}.emb.timestep_embedder"
    h = b.linear(f"{emb}.linear_1", -1, t, width)
    h = b.linear(f"{emb}.linear_2", -1, h, width)
    b.linear(f"{module}.linear", -1, h, k * width)


def _caption_spec(b: SpecBuilder, module: str, text: Act, width: int) -> Act:
    """PixArt caption projection: linear_1, GELU-tanh, linear_2."""
    h = b.linear(f"{module}.linear_1", -1, text, width, gelu=True)
    return b.linear(f"{module}.linear_2", -1, h, width)


def _norm_attention(b: SpecBuilder, kp: str, wp: str, layer: int, x: Act, norm: str, attn: str, ctx: Act | None,
                    shape: dict[str, int], modulated: bool) -> Act:
    """RMSNorm `{kp}.{norm}` of the stream `x` (modulated and the attention gated, or
    neither), then attention `attn` added into it."""
    (h,) = b.norm(f"{kp}.{norm}", layer, x, modulated=modulated)
    y = b.attention_layer(f"{kp}.{attn}", f"{wp}.{attn}", layer, h, ctx, **shape)
    return b.residual(f"{kp}.{attn}.to_out", x, y, gated=modulated)


def build(b: SpecBuilder, c: DitModelConfig) -> None:
    """LTX-Video (one stream) or LTX-2 (video + audio streams), in launch order."""
    tok = b.tok
    require_tokens(tok.video, "video_tokens", c.name)
    require_tokens(tok.text, "text_tokens", c.name)
    if c.audio_dim:
        require_tokens(tok.audio, "audio_tokens", c.name)
    bs, d, da = tok.batch, c.dim, c.audio_dim
    audio = da > 0
    t = Act("timestep.freqs", bs, c.timestep_dim)
    text_in = Act("text", bs * tok.text, c.text_dim)
    v = b.linear("proj_in", -1, Act("video", bs * tok.video, c.in_channels), d)
    a = b.linear("audio_proj_in", -1, Act("audio", bs * tok.audio, c.audio_in_channels), da) if audio else None
    adaln = [("time_embed", d, 6)]
    if audio:
        adaln += [("audio_time_embed", da, 6), ("av_cross_attn_video_scale_shift", d, 4),
                  ("av_cross_attn_audio_scale_shift", da, 4), ("av_cross_attn_video_a2v_gate", d, 1),
                  ("av_cross_attn_audio_v2a_gate", da, 1)]
    for module, width, k in adaln:
        _adaln_single_spec(b, module, t, width, k)
    text = _caption_spec(b, "caption_projection", text_in, d)
    atext = _caption_spec(b, "audio_caption_projection", text_in, da) if audio else None

    vattn = dict(inner=d, heads=c.heads, head_dim=c.head_dim, out_dim=d)
    aattn = dict(inner=da, heads=c.audio_heads, head_dim=c.audio_head_dim, out_dim=da)
    for i in range(c.num_layers):
        kp, wp = f"blocks.{i}", f"transformer_blocks.{i}"
        tables = [(f"{wp}.scale_shift_table", (6, d))]
        if audio:
            tables += [(f"{wp}.audio_scale_shift_table", (6, da)),
                       (f"{wp}.video_a2v_cross_attn_scale_shift_table", (5, d)),
                       (f"{wp}.audio_a2v_cross_attn_scale_shift_table", (5, da))]
        b.elementwise(f"{kp}.ada", i, tables)
        # 1. self attention, video then audio
        v = _norm_attention(b, kp, wp, i, v, "norm1", "attn1", None, vattn, modulated=True)
        if audio:
            a = _norm_attention(b, kp, wp, i, a, "audio_norm1", "audio_attn1", None, aattn, modulated=True)
        # 2. cross attention to the text
        v = _norm_attention(b, kp, wp, i, v, "norm2", "attn2", text, vattn, modulated=False)
        if audio:
            a = _norm_attention(b, kp, wp, i, a, "audio_norm2", "audio_attn2", atext, aattn, modulated=False)
            # 3. audio-to-video (Q video) and video-to-audio (Q audio), in the audio's width
            v_a2v, v_v2a = b.norm(f"{kp}.audio_to_video_norm", i, v, outputs=2)
            a_a2v, a_v2a = b.norm(f"{kp}.video_to_audio_norm", i, a, outputs=2)
            y = b.attention_layer(f"{kp}.audio_to_video_attn", f"{wp}.audio_to_video_attn", i, v_a2v, a_a2v,
                                  **{**aattn, "out_dim": d})
            v = b.residual(f"{kp}.audio_to_video_attn.to_out", v, y, gated=True)
            y = b.attention_layer(f"{kp}.video_to_audio_attn", f"{wp}.video_to_audio_attn", i, a_v2a, v_v2a, **aattn)
            a = b.residual(f"{kp}.video_to_audio_attn.to_out", a, y, gated=True)
        # 4. feed-forward
        (x,) = b.norm(f"{kp}.norm3", i, v)
        v = b.residual(f"{kp}.ff.down", v, b.ffn(f"{kp}.ff", f"{wp}.ff", i, x, c.ffn_dim), gated=True)
        if audio:
            (x,) = b.norm(f"{kp}.audio_norm3", i, a)
            a = b.residual(f"{kp}.audio_ff.down", a, b.ffn(f"{kp}.audio_ff", f"{wp}.audio_ff", i, x, c.audio_ffn_dim),
                           gated=True)

    (x,) = b.norm("norm_out", -1, v, layer_norm=True, weights=[("scale_shift_table", (2, d))])
    b.linear("proj_out", -1, x, c.in_channels)
    if audio:
        (x,) = b.norm("audio_norm_out", -1, a, layer_norm=True, weights=[("audio_scale_shift_table", (2, da))])
        b.linear("audio_proj_out", -1, x, c.audio_in_channels)


# ----- forward


def _adaln_single(run: Run, module: str, freqs: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Returns the embedded timestep (B, d) and k modulation rows (B, k, d)."""
    import torch.nn.functional as F

    from engine.models.layers import linear_kernel

    emb = f"{module}.emb.timestep_embedder"
    h = F.silu(linear_kernel(run, f"{emb}.linear_1", freqs))
    e = linear_kernel(run, f"{emb}.linear_2", h)
    return e, linear_kernel(run, f"{module}.linear", F.silu(e)).unflatten(-1, (k, -1))


def forward(run: Run, inp: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The kernels `build` declares, in order: {"video": ...} (and "audio" for LTX-2)."""
    from engine.models.layers import attention_layer, ffn, linear_kernel, modulate, rms_norm, timestep_freqs

    c, eps = run.cfg, run.eps
    audio = c["audio_dim"] > 0
    v = linear_kernel(run, "proj_in", inp["video"])
    a = linear_kernel(run, "audio_proj_in", inp["audio"]) if audio else None
    freqs = timestep_freqs(inp["timestep"], c["timestep_dim"], v.dtype)
    adaln = [("time_embed", 6)]
    if audio:
        adaln += [("audio_time_embed", 6), ("av_cross_attn_video_scale_shift", 4),
                  ("av_cross_attn_audio_scale_shift", 4), ("av_cross_attn_video_a2v_gate", 1),
                  ("av_cross_attn_audio_v2a_gate", 1)]
    emb = {m: _adaln_single(run, m, freqs, k) for m, k in adaln}
    text = caption(run, "caption_projection", inp["text"])
    atext = caption(run, "audio_caption_projection", inp["text"]) if audio else None

    for i in range(c["num_layers"]):
        kp, wp = f"blocks.{i}", f"transformer_blocks.{i}"
        w = run.kernel(f"{kp}.ada")
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = modulation_rows(
            w[f"{wp}.scale_shift_table"], emb["time_embed"][1])
        if audio:
            a_shift_msa, a_scale_msa, a_gate_msa, a_shift_mlp, a_scale_mlp, a_gate_mlp = modulation_rows(
                w[f"{wp}.audio_scale_shift_table"], emb["audio_time_embed"][1])
            vt = w[f"{wp}.video_a2v_cross_attn_scale_shift_table"]
            at = w[f"{wp}.audio_a2v_cross_attn_scale_shift_table"]
            v_a2v_scale, v_a2v_shift, v_v2a_scale, v_v2a_shift = modulation_rows(
                vt[:4], emb["av_cross_attn_video_scale_shift"][1])
            (a2v_gate,) = modulation_rows(vt[4:], emb["av_cross_attn_video_a2v_gate"][1])
            a_a2v_scale, a_a2v_shift, a_v2a_scale, a_v2a_shift = modulation_rows(
                at[:4], emb["av_cross_attn_audio_scale_shift"][1])
            (v2a_gate,) = modulation_rows(at[4:], emb["av_cross_attn_audio_v2a_gate"][1])
        # 1. self attention
        run.kernel(f"{kp}.norm1")
        x = modulate(rms_norm(v, eps), shift_msa, scale_msa)
        v = v + attention_layer(run, f"{kp}.attn1", f"{wp}.attn1", x, None, c["heads"]) * gate_msa
        if audio:
            run.kernel(f"{kp}.audio_norm1")
            x = modulate(rms_norm(a, eps), a_shift_msa, a_scale_msa)
            y = attention_layer(run, f"{kp}.audio_attn1", f"{wp}.audio_attn1", x, None, c["audio_heads"])
            a = a + y * a_gate_msa
        # 2. cross attention to the text
        run.kernel(f"{kp}.norm2")
        v = v + attention_layer(run, f"{kp}.attn2", f"{wp}.attn2", rms_norm(v, eps), text, c["heads"])
        if audio:
            run.kernel(f"{kp}.audio_norm2")
            x = rms_norm(a, eps)
            a = a + attention_layer(run, f"{kp}.audio_attn2", f"{wp}.audio_attn2", x, atext, c["audio_heads"])
            # 3. audio-to-video (Q video, K/V audio), then video-to-audio, both from these norms
            run.kernel(f"{kp}.audio_to_video_norm")
            nv = rms_norm(v, eps)
            v_a2v, v_v2a = modulate(nv, v_a2v_shift, v_a2v_scale), modulate(nv, v_v2a_shift, v_v2a_scale)
            run.kernel(f"{kp}.video_to_audio_norm")
            na = rms_norm(a, eps)
            a_a2v, a_v2a = modulate(na, a_a2v_shift, a_a2v_scale), modulate(na, a_v2a_shift, a_v2a_scale)
            v = v + a2v_gate * attention_layer(run, f"{kp}.audio_to_video_attn", f"{wp}.audio_to_video_attn",
                                               v_a2v, a_a2v, c["audio_heads"])
            a = a + v2a_gate * attention_layer(run, f"{kp}.video_to_audio_attn", f"{wp}.video_to_audio_attn",
                                               a_v2a, v_v2a, c["audio_heads"])
        # 4. feed-forward
        run.kernel(f"{kp}.norm3")
        v = v + ffn(run, f"{kp}.ff", f"{wp}.ff", modulate(rms_norm(v, eps), shift_mlp, scale_mlp)) * gate_mlp
        if audio:
            run.kernel(f"{kp}.audio_norm3")
            x = modulate(rms_norm(a, eps), a_shift_mlp, a_scale_mlp)
            a = a + ffn(run, f"{kp}.audio_ff", f"{wp}.audio_ff", x) * a_gate_mlp

    out = {"video": output_layer(run, "norm_out", "scale_shift_table", "proj_out", v, emb["time_embed"][0])}
    if audio:
        out["audio"] = output_layer(run, "audio_norm_out", "audio_scale_shift_table", "audio_proj_out", a,
                                    emb["audio_time_embed"][0])
    return out


def inputs(c: Mapping[str, Any], workload: WorkloadShape, draw: Draw) -> dict[str, Tensor]:
    """Latent video tokens (already patchified), text embeddings, timesteps, and the audio latents."""
    bs = workload.batch
    inp = {"video": draw.randn(bs, workload.video_tokens, c["in_channels"]),
           "text": draw.randn(bs, workload.text_tokens, c["text_dim"]), "timestep": draw.steps()}
    if c["audio_dim"]:
        inp["audio"] = draw.randn(bs, workload.audio_tokens, c["audio_in_channels"])
    return inp
