"""engine.offload on library model classes beyond the four benchmarked (decoders, an
encoder-decoder, an encoder, a conv UNet, state-space and hybrid models, mixtures of
experts, DiTs of several kinds): tiny configs on the CPU backend, a budget just over each
model's floor (weights stream every step), outputs bitwise the plain module's, the module
restored after; and each built on the meta device, synthesized from its config alone; and
some trained, a LoRA on them, streamed and spilled, bitwise the plain module's steps.
Needs the models extra."""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch
from omegaconf import OmegaConf

import engine
from engine.errors import BelowFloorError
from engine.modules.adapters import enable_checkpointing
from engine.modules.build import (HUNYUAN_VIDEO15_IMAGE_TOKENS, auraflow_inputs, first_output, flux2_inputs,
                                  hunyuan_image_inputs, hunyuan_video15_inputs, mochi_inputs, qwen_image_inputs,
                                  sd3_inputs, zimage_inputs)

BF16 = torch.bfloat16


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(BF16)


def _transformers(name: str) -> tuple[torch.nn.Module, dict]:
    t = pytest.importorskip("transformers", reason="needs the models extra: pip install 'offload-engine[models]'")
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    ids = {"input_ids": torch.randint(0, 512, (1, 16))}
    if name == "deepseek_v3":  # multi-head latent attention, a dense layer then routed and shared experts
        return t.DeepseekV3ForCausalLM(t.DeepseekV3Config(
            **common, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, q_lora_rank=32,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=1,
            n_group=1, topk_group=1)), ids
    if name == "gpt_oss":  # experts with biases and a clamped activation, attention sinks, sliding layers
        return t.GptOssForCausalLM(t.GptOssConfig(**common, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                                                  layer_types=["sliding_attention", "full_attention"] * 3)), ids
    if name == "mamba":  # no attention: selective state-space scans
        return t.MambaForCausalLM(t.MambaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=4, state_size=8)), ids
    if name == "jamba":  # hybrid: mamba and attention layers, experts every other layer
        return t.JambaForCausalLM(t.JambaConfig(**common, num_experts=2, attn_layer_period=2, attn_layer_offset=1,
                                                expert_layer_period=2, expert_layer_offset=1)), ids
    if name == "bloom":  # ALiBi instead of rotary positions, fused query-key-value
        return t.BloomForCausalLM(t.BloomConfig(vocab_size=512, hidden_size=64, n_layer=6, n_head=4)), ids
    if name == "bert":  # an encoder: bidirectional, no head
        return t.BertModel(t.BertConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                        num_attention_heads=4)), ids
    if name == "t5":  # encoder-decoder: the encoder's blocks, then the decoder's over its output
        model = t.T5ForConditionalGeneration(t.T5Config(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=3,
                                                        num_heads=4))
        return model, {"input_ids": torch.randint(0, 512, (1, 16)), "decoder_input_ids": torch.randint(0, 512, (1, 6))}
    if name == "gpt2":  # Conv1D projections, tied head
        model = t.GPT2LMHeadModel(t.GPT2Config(n_embd=64, n_layer=6, n_head=4, vocab_size=512, n_positions=128))
    elif name == "gemma2":  # tied head, sliding-window layers, soft-capping
        model = t.Gemma2ForCausalLM(t.Gemma2Config(**common, head_dim=16))
    elif name == "gemma3":  # tied head, five sliding-window layers to a global one, query and key norms
        model = t.Gemma3ForCausalLM(t.Gemma3TextConfig(**common, head_dim=16, sliding_window=8))
    elif name == "mixtral":  # mixture of experts: a block reads every expert
        model = t.MixtralForCausalLM(t.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2))
    else:
        model = t.Qwen2ForCausalLM(t.Qwen2Config(**common))
    return model, {"input_ids": torch.randint(0, 512, (1, 16))}


def _here() -> torch.device:
    """The default device: meta inside `with torch.device("meta")`, else the CPU."""
    return torch.empty(0).device


def _diffusers(name: str) -> tuple[torch.nn.Module, dict]:
    d = pytest.importorskip("diffusers", reason="needs the models extra: pip install 'offload-engine[models]'")
    if name == "unet":  # Stable Diffusion's conv UNet: down, mid and up blocks joined by skip connections
        model = d.UNet2DConditionModel(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
                                       block_out_channels=(32, 64, 64), norm_num_groups=8, cross_attention_dim=32,
                                       down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
                                       up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
                                       attention_head_dim=8)
        inputs = dict(sample=_randn(1, 4, 16, 16), timestep=torch.tensor([10]), encoder_hidden_states=_randn(1, 8, 32))
    elif name == "sd3":
        model = d.SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=16,
                                        num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=32,
                                        pooled_projection_dim=16, out_channels=4, pos_embed_max_size=32,
                                        qk_norm="rms_norm")
        # the shipped config's inputs builder (conf/model/sd35_large_diffusers.yaml)
        inputs = sd3_inputs(model, SimpleNamespace(batch=1, video_tokens=64, text_tokens=8), torch.device("cpu"), BF16)
    elif name == "hunyuan_video":  # dual-stream then single-stream blocks, a token refiner
        model = d.HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2,
                                                 attention_head_dim=16, num_layers=2, num_single_layers=2,
                                                 num_refiner_layers=1, patch_size=2, patch_size_t=1, text_embed_dim=32,
                                                 pooled_projection_dim=16, rope_axes_dim=(4, 6, 6))
        inputs = dict(hidden_states=_randn(1, 4, 2, 16, 16), timestep=torch.tensor([10]),
                      encoder_hidden_states=_randn(1, 8, 32), encoder_attention_mask=torch.ones(1, 8),
                      pooled_projections=_randn(1, 16), guidance=torch.tensor([3.5]).to(BF16))
    elif name == "qwen_image":
        model = d.QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=4,
                                              attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                              axes_dims_rope=(4, 6, 6))
        # the shipped config's inputs builder (conf/model/qwen_image_diffusers.yaml)
        inputs = qwen_image_inputs(model, SimpleNamespace(batch=1, video_tokens=64, text_tokens=8),
                                   torch.device("cpu"), BF16)
    elif name == "hunyuan_dit":  # two text encoders' streams, long skip connections across the blocks
        from diffusers.models.embeddings import get_2d_rotary_pos_embed

        model = d.HunyuanDiT2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, patch_size=2,
                                    sample_size=16, hidden_size=32, num_layers=4, cross_attention_dim=32,
                                    cross_attention_dim_t5=32, pooled_projection_dim=16, text_len=8, text_len_t5=8,
                                    use_style_cond_and_image_meta_size=False)
        rope = get_2d_rotary_pos_embed(16, ((0, 0), (8, 8)), (8, 8))
        inputs = dict(hidden_states=_randn(1, 4, 16, 16), timestep=torch.tensor([10.0]).to(BF16),
                      encoder_hidden_states=_randn(1, 8, 32), text_embedding_mask=torch.ones(1, 8),
                      encoder_hidden_states_t5=_randn(1, 8, 32), text_embedding_mask_t5=torch.ones(1, 8),
                      image_rotary_emb=rope)
    elif name == "cosmos":  # video, AdaLN-LoRA modulation, a learnable positional embedding
        model = d.CosmosTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
                                           num_layers=4, text_embed_dim=32, adaln_lora_dim=8, max_size=(4, 32, 32),
                                           patch_size=(1, 2, 2), concat_padding_mask=False)
        inputs = dict(hidden_states=_randn(1, 4, 2, 16, 16), timestep=torch.tensor([10]),
                      encoder_hidden_states=_randn(1, 8, 32))
    elif name == "stable_audio":  # 1-D audio latents, grouped-query attention, a global condition
        model = d.StableAudioDiTModel(sample_size=32, in_channels=8, num_layers=4, attention_head_dim=16,
                                      num_attention_heads=2, num_key_value_attention_heads=1, out_channels=8,
                                      cross_attention_dim=32, time_proj_dim=16, global_states_input_dim=32,
                                      cross_attention_input_dim=32)
        inputs = dict(hidden_states=_randn(1, 8, 32), timestep=torch.tensor([10]), encoder_hidden_states=_randn(1, 8, 32),
                      global_hidden_states=_randn(1, 1, 32))
    elif name == "hidream":  # caption projections run before the blocks; dual- then single-stream; routed experts
        model = d.HiDreamImageTransformer2DModel(patch_size=2, in_channels=4, out_channels=4, num_layers=2,
                                                 num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                                                 caption_channels=[32, 32], text_emb_dim=32, num_routed_experts=4,
                                                 num_activated_experts=2, axes_dims_rope=(8, 4, 4),
                                                 max_resolution=(32, 32), llama_layers=[0, 1, 2, 3])
        inputs = dict(hidden_states=_randn(1, 4, 16, 16), timesteps=torch.tensor([10]),
                      encoder_hidden_states_t5=_randn(1, 8, 32), encoder_hidden_states_llama3=_randn(4, 1, 8, 32),
                      pooled_embeds=_randn(1, 32))
    elif name == "cogview4":  # dual-stream blocks only: the last block's text stream is dropped
        model = d.CogView4Transformer2DModel(patch_size=2, in_channels=4, out_channels=4, num_layers=4,
                                             attention_head_dim=16, num_attention_heads=2, text_embed_dim=32,
                                             time_embed_dim=16, condition_dim=8, rope_axes_dim=(8, 8))
        inputs = dict(hidden_states=_randn(1, 4, 16, 16), encoder_hidden_states=_randn(1, 8, 32),
                      timestep=torch.tensor([10]), original_size=torch.tensor([[16.0, 16.0]]),
                      target_size=torch.tensor([[16.0, 16.0]]), crop_coords=torch.tensor([[0.0, 0.0]]))
    elif name == "mochi":  # asymmetric dual-stream blocks; the attention gathers the prompt by its mask (a nonzero)
        model = d.MochiTransformer3DModel(patch_size=2, num_attention_heads=2, attention_head_dim=16, num_layers=4,
                                          pooled_projection_dim=16, in_channels=4, text_embed_dim=32, time_embed_dim=16,
                                          max_sequence_length=8)
        # the shipped config's inputs builder (conf/model/mochi_diffusers.yaml)
        inputs = mochi_inputs(model, SimpleNamespace(batch=1, video_tokens=64, text_tokens=8), _here(), BF16)
    elif name == "auraflow":  # joint blocks, then single-stream ones; a learned positional embedding
        model = d.AuraFlowTransformer2DModel(sample_size=16, patch_size=2, in_channels=4, num_mmdit_layers=2,
                                             num_single_dit_layers=2, attention_head_dim=16, num_attention_heads=2,
                                             joint_attention_dim=32, caption_projection_dim=32, out_channels=4,
                                             pos_embed_max_size=256)
        inputs = auraflow_inputs(model, SimpleNamespace(batch=1, video_tokens=64, text_tokens=8), _here(), BF16)
    elif name == "flux2":  # FLUX.2: shared modulations outside the blocks, fused qkv-and-MLP single blocks
        model = d.Flux2Transformer2DModel(in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=32,
                                          num_attention_heads=2, joint_attention_dim=32, timestep_guidance_channels=16,
                                          axes_dims_rope=(8, 8, 8, 8))
        inputs = flux2_inputs(model, SimpleNamespace(batch=1, video_tokens=64, text_tokens=8), _here(), BF16)
    elif name == "zimage":  # Z-Image: list inputs, refiners per stream, then one stream of both, padded to 32
        model = d.ZImageTransformer2DModel(in_channels=4, dim=64, n_layers=4, n_refiner_layers=2, n_heads=2,
                                           n_kv_heads=2, cap_feat_dim=32, axes_dims=[8, 12, 12], axes_lens=[64, 32, 32])
        inputs = zimage_inputs(model, SimpleNamespace(batch=1, video_tokens=64, text_tokens=8), _here(), BF16)
    elif name == "hunyuan_image":  # HunyuanImage 2.1: the text's mask joins every block's attention, by keyword
        model = d.HunyuanImageTransformer2DModel(in_channels=4, out_channels=4, num_attention_heads=2,
                                                 attention_head_dim=16, num_layers=2, num_single_layers=2,
                                                 num_refiner_layers=1, text_embed_dim=32, rope_axes_dim=(8, 8))
        inputs = hunyuan_image_inputs(model, SimpleNamespace(batch=1, video_tokens=64, text_tokens=8), _here(), BF16)
    elif name == "hunyuan_video15":  # HunyuanVideo 1.5: gathers each prompt's valid tokens by boolean masks
        # (blocks 512 wide: its ByT5 projection's 2048-wide hidden layer would otherwise hold the floor)
        model = d.HunyuanVideo15Transformer3DModel(in_channels=4, out_channels=4, num_attention_heads=4,
                                                   attention_head_dim=128, num_layers=4, num_refiner_layers=1,
                                                   text_embed_dim=32, text_embed_2_dim=16, image_embed_dim=8,
                                                   rope_axes_dim=(16, 56, 56))
        # the shipped config's inputs builder (conf/model/hunyuan_video15_diffusers.yaml)
        inputs = hunyuan_video15_inputs(model, SimpleNamespace(batch=1, video_tokens=128, text_tokens=8), _here(),
                                        BF16)
    else:  # sana: linear attention, a caption norm
        model = d.SanaTransformer2DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
                                         num_layers=4, num_cross_attention_heads=2, cross_attention_head_dim=16,
                                         cross_attention_dim=32, caption_channels=32, sample_size=16, patch_size=1)
        inputs = dict(hidden_states=_randn(1, 4, 16, 16), encoder_hidden_states=_randn(1, 8, 32),
                      timestep=torch.tensor([10]))
    return model, {**inputs, "return_dict": False}


def _floor_mb(model: torch.nn.Module, inputs: dict) -> float:
    """The floor at lookahead 2, from the refusal of a budget of 0."""
    with pytest.raises(BelowFloorError) as refused:
        engine.offload(model, budget_mb=0, example_inputs=inputs, eviction="priority", lookahead=2, backend="cpu")
    return refused.value.floor_bytes / 1e6


BUILDERS: dict[str, Callable[[str], tuple[torch.nn.Module, dict]]] = {
    **dict.fromkeys(("qwen2", "gemma2", "gemma3", "gpt2", "mixtral", "t5", "deepseek_v3", "gpt_oss", "mamba", "jamba",
                     "bloom", "bert"), _transformers),
    **dict.fromkeys(("unet", "sd3", "hunyuan_video", "qwen_image", "sana", "hunyuan_dit", "cosmos", "stable_audio",
                     "mochi", "auraflow", "flux2", "zimage", "hunyuan_image", "hunyuan_video15"), _diffusers),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_library_model_streams_bitwise(name: str) -> None:
    torch.manual_seed(0)
    model, inputs = BUILDERS[name](name)
    model = model.to(BF16).eval()
    with torch.no_grad():
        ref = first_output(model(**inputs)).clone()
    budget = 1.05 * _floor_mb(model, inputs)
    for eviction in ("priority", "belady"):
        h = engine.offload(model, budget_mb=budget, example_inputs=inputs, eviction=eviction, lookahead=2,
                           backend="cpu")
        with torch.no_grad():
            assert all(torch.equal(first_output(model(**inputs)), ref) for _ in range(2)), eviction
        assert h.telemetry()[-1]["h2d_bytes"] > 0  # under the budget, weights stream every step
        h.remove()
    with torch.no_grad():
        assert torch.equal(first_output(model(**inputs)), ref)  # put back as it was


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_to_meta(v) for v in value)
    return value


@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss", "mamba", "jamba", "bloom", "bert", "hunyuan_dit", "cosmos",
                                  "stable_audio", "mochi", "auraflow", "flux2", "zimage", "hunyuan_image", "gemma3",
                                  "hunyuan_video15"])
def test_a_library_model_is_synthesized_from_its_config(name: str) -> None:
    """Built on the meta device, nothing allocated: one record a block and one a leaf outside
    the blocks, each priced."""
    with torch.device("meta"):
        model, inputs = BUILDERS[name](name)
    model = model.to(BF16)
    trace = engine.synthesize(model, {k: _to_meta(v) for k, v in inputs.items()})
    assert trace.header["source"] == "synthesized"
    assert len(trace.records) >= 4 and all(r.compute_ns > 0 for r in trace.records)


def test_the_shipped_inputs_builders_refuse_shapes_their_model_cannot_take() -> None:
    """A token grid past a learned positional embedding (SD3's, AuraFlow's), more text than
    Mochi's caption pooling takes: one ConfigError naming the limit and the way out."""
    from engine.errors import ConfigError

    cpu = torch.device("cpu")
    for name, workload, match in [("sd3", dict(video_tokens=34 * 34, text_tokens=8), "past SD3's positional embedding"),
                                  ("auraflow", dict(video_tokens=17 * 17, text_tokens=8),
                                   "at most 256, or raise model.module.pos_embed_max_size"),
                                  ("mochi", dict(video_tokens=64, text_tokens=9), "at most 8 text tokens")]:
        model, _ = BUILDERS[name](name)
        build = {"sd3": sd3_inputs, "auraflow": auraflow_inputs, "mochi": mochi_inputs}[name]
        with pytest.raises(ConfigError, match=match):
            build(model, SimpleNamespace(batch=1, **workload), cpu, BF16)


def test_a_nonzero_on_meta_is_a_host_sync_and_autocast_a_no_op() -> None:
    """Mochi's attention gathers the prompt's tokens by a nonzero of its mask (on a GPU the host
    waits there) and its rotary embedding runs under torch.autocast of its tensors' device: on
    the meta device the nonzero finds every token, each block's record names the sync (before
    the next record, as the recorder counts it), and torch.autocast is torch's again after."""
    autocast = torch.autocast
    with torch.device("meta"):
        model, inputs = BUILDERS["mochi"]("mochi")
    trace = engine.synthesize(model.to(BF16), {k: _to_meta(v) for k, v in inputs.items()})
    blocks = [i for i, r in enumerate(trace.records) if r.name.startswith("transformer_blocks.")]
    assert trace.header["host_syncs"] == [(i + 1) % len(trace.records) for i in blocks]
    assert torch.autocast is autocast and torch.amp.autocast is autocast
    # A checkpointed LoRA step: the backward's recomputation gathers the prompt again.
    from engine.modules.adapters import add_lora, enable_checkpointing

    with torch.device("meta"):
        model, inputs = BUILDERS["mochi"]("mochi")
    model = model.to(BF16)
    add_lora(model, 4, ["to_q", "to_v"], device=torch.device("meta"))
    enable_checkpointing(model)
    step = engine.synthesize(model, {k: _to_meta(v) for k, v in inputs.items()}, training=True)
    assert "host_syncs" not in step.header and any(r.phase == "bwd" for r in step.records)
    with torch.device("meta"):
        model, inputs = BUILDERS["auraflow"]("auraflow")
    assert "host_syncs" not in engine.synthesize(model.to(BF16), {k: _to_meta(v) for k, v in inputs.items()}).header


def test_indexing_by_a_boolean_mask_on_meta_finds_every_element_and_is_a_host_sync() -> None:
    """HunyuanVideo 1.5 gathers each prompt's valid tokens by `x[mask]`, then its padding by
    `x[~mask]`, before its blocks (index's own meta kernel runs the nonzero, out of a dispatch
    mode's sight): a mask of ones selects every token, its negation and a mask of zeros none, and
    the host waits there, before the first block's record."""
    with torch.device("meta"):
        model, inputs = BUILDERS["hunyuan_video15"]("hunyuan_video15")
    trace = engine.synthesize(model.to(BF16), {k: _to_meta(v) for k, v in inputs.items()})
    first = next(i for i, r in enumerate(trace.records) if r.name.startswith("transformer_blocks."))
    assert trace.header["host_syncs"] and max(trace.header["host_syncs"]) <= first
    cores = [c for r in trace.records if r.name == "transformer_blocks.0" for c in r.cores]
    # the video's 128 tokens and the conditions' 8 + 8 + 729, each once: the valid ones (every
    # prompt token, its mask of ones) then the padding (the image's, t2v's mask of zeros)
    n = 128 + 8 + 8 + HUNYUAN_VIDEO15_IMAGE_TOKENS
    assert ("attention_full_mask", (4, n, n, 128)) in cores, cores


def test_generate_decodes_through_the_hooks() -> None:
    """transformers' generate: a prefill forward, then one token at a time over a growing
    KV cache; the same kernels in the same order every call, tokens equal the plain module's."""
    torch.manual_seed(0)
    model, inputs = _transformers("qwen2")
    model = model.to(BF16).eval()
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    h = engine.offload(model, budget_mb=1.05 * _floor_mb(model, inputs), example_inputs=inputs,
                       eviction="priority", lookahead=2, backend="cpu")
    with torch.no_grad():
        assert torch.equal(model.generate(**inputs, max_new_tokens=8, do_sample=False), ref)
    assert len(h.telemetry()) >= 8  # a step a forward
    h.remove()


@pytest.mark.parametrize("name", ["gpt_oss", "gemma2", "qwen2"])
def test_decode_over_the_shipped_kv_cache_repeats_its_step(name: str) -> None:
    """llama_inputs' decode (one token over a built KV cache, the step every forward repeats) on
    models whose attention takes an explicit mask sized from the cache before any layer runs
    (GPT-OSS's sinks, Gemma2's soft-capping: eager attention; sliding-window layers that count the
    tokens they saw): every forward returns the same logits, streamed bitwise as resident."""
    from engine.modules.build import llama_inputs

    torch.manual_seed(0)
    model, _ = _transformers(name)
    model = model.to(BF16).eval()
    model.config.sliding_window = 8  # under the context: the sliding layers keep a window
    inputs = llama_inputs(model, SimpleNamespace(kind="decode", batch=1, context_tokens=32, text_tokens=0),
                          torch.device("cpu"), BF16)
    with torch.no_grad():
        ref = first_output(model(**inputs)).clone()
        assert torch.equal(first_output(model(**inputs)), ref)
    h = engine.offload(model, budget_mb=1.05 * _floor_mb(model, inputs), example_inputs=inputs, eviction="priority",
                       lookahead=2, backend="cpu")
    with torch.no_grad():
        assert all(torch.equal(first_output(model(**inputs)), ref) for _ in range(2))
    h.remove()


FLUX2_TARGETS = OmegaConf.load(Path(__file__).parents[1] / "conf/model/flux2_diffusers.yaml").lora_targets
HUNYUAN_IMAGE_TARGETS = list(OmegaConf.load(Path(__file__).parents[1] / "conf/model/hunyuan_image_diffusers.yaml")
                             .lora_targets)
ATTN_FF = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]
# name -> (LoRA target modules, per-block activation checkpointing, sync layers offloaded)
TRAINED: dict[str, tuple[list[str], bool, int]] = {
    # latent attention; peft wraps the 3-D routed experts too (their gate/up/down names)
    "deepseek_v3": (["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj"], False, 1),
    # mamba and attention layers (the scan reads dt_proj.weight itself: no adapter there)
    "jamba": (["in_proj", "x_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
              False, 1),
    "bert": (["query", "key", "value", "intermediate.dense", "output.dense"], True, 1),  # an encoder, dropout on
    "hunyuan_dit": (ATTN_FF, False, 1),  # long skips, shared parameters kept resident
    # layers 0-4 are the caption projections (run first, nothing saved): the spill reaches a block at 6
    "hidream": (["to_q", "to_k", "to_v", "to_out", "to_q_t", "to_k_t", "to_v_t", "to_out_t", "w1", "w2", "w3"],
                True, 6),
    "cogview4": (ATTN_FF, False, 1),
    # the shipped configs' targets (conf/model/flux2_diffusers.yaml, zimage_diffusers.yaml)
    "flux2": (FLUX2_TARGETS, True, 1),
    "zimage": (["to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3"], True, 1),
    "hunyuan_image": (HUNYUAN_IMAGE_TARGETS, True, 1),  # its blocks take their mask by keyword
    # a checkpointed layer's input is saved as its checkpoint starts, before the layer's own hooks:
    # it counts with the layer before, so layer 0 (after the embedding) holds layer 1's
    "gemma3": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True, 2),
}


def _trained(name: str) -> tuple[torch.nn.Module, dict]:
    """The class at seed 0 in bf16, training mode, a rank-4 LoRA (random B: every gradient nonzero)."""
    peft = pytest.importorskip("peft", reason="needs the models extra: pip install 'offload-engine[models]'")
    targets, ckpt, _ = TRAINED[name]
    torch.manual_seed(0)
    model, inputs = (_diffusers if name in ("hunyuan_dit", "hidream", "cogview4", "flux2", "zimage", "hunyuan_image")
                     else _transformers)(name)
    model = model.to(BF16)
    if ckpt:
        enable_checkpointing(model)  # the CLI's: keyword arguments pass through diffusers' blocks
    model.train()
    return peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False),
                                        model), inputs


def _train(model: torch.nn.Module, inputs: dict, steps: range, handle: Any = None) -> list[tuple[torch.Tensor, dict]]:
    """SGD steps on the adapters, step s seeded by s (dropout alike); each loss and gradient."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    out = []
    for s in steps:
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(s)
        with handle.step() if handle is not None else nullcontext():
            loss = first_output(model(**inputs)).float().pow(2).mean()
            loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
        opt.step()
    return out


@pytest.mark.parametrize("name", list(TRAINED))
def test_a_library_model_trains_a_lora_bitwise(name: str) -> None:
    """LoRA steps with the frozen weights streamed at just over the training floor and
    activations spilled (sync): each loss and every adapter gradient equal the plain module's
    over two steps; after remove() a plain step and the whole state dict equal too."""
    model, inputs = _trained(name)
    ref = _train(model, inputs, range(3))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model, inputs = _trained(name)
    with pytest.raises(BelowFloorError) as refused:
        engine.offload(model, budget_mb=0, training=True, example_inputs=inputs, eviction="priority", lookahead=2,
                       backend="cpu")
    h = engine.offload(model, budget_mb=1.05 * refused.value.floor_bytes / 1e6, training=True, example_inputs=inputs,
                       eviction="priority", lookahead=2, backend="cpu",
                       activations={"mode": "sync", "num_offload_layers": TRAINED[name][2], "min_tensor_bytes": 256})
    got = _train(model, inputs, range(2), h)
    row = h.telemetry()[-1]
    assert row["weight_h2d_bytes"] > 0 and row["activations_spilled"] > 0  # both stream every step
    h.remove()
    got += _train(model, inputs, range(2, 3))
    for (loss, grads), (loss_ref, grads_ref) in zip(got, ref, strict=True):
        assert torch.equal(loss, loss_ref) and grads.keys() == grads_ref.keys()
        assert all(torch.equal(grads[k], grads_ref[k]) for k in grads_ref)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())  # put back as it was


def test_a_lora_target_naming_a_module_list_is_refused_in_one_line() -> None:
    """FLUX.2's double blocks hold `attn.to_out` as a ModuleList (a single block's is the linear):
    the suffix is refused naming the list and its linear, not with peft's repr of the list."""
    from engine.errors import ConfigError
    from engine.modules.adapters import add_lora

    model, _ = _diffusers("flux2")
    with pytest.raises(ConfigError, match=r"'attn.to_out' matches transformer_blocks.0.attn.to_out, a ModuleList, "
                                          r"which peft cannot adapt; name its linear \('attn.to_out.0'\)") as refused:
        add_lora(model, 4, ["to_q", "attn.to_out"], device=torch.device("cpu"))
    assert "\n" not in str(refused.value)
    add_lora(model, 4, FLUX2_TARGETS, device=torch.device("cpu"))  # the shipped expression adapts both kinds
    assert {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A" in n} >= {
        "transformer_blocks.0.attn.to_out.0", "single_transformer_blocks.0.attn.to_out"}
