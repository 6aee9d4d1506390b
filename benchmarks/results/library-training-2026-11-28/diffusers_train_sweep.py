"""As run on 2026-11-28 (CPU, torch 2.13, diffusers 0.42.1, peft 0.21): python diffusers_train_sweep.py [NAME...]

The 11 diffusers classes of ../library-classes-2026-11-28/diffusers_sweep.py (same tiny configs and
inputs), each given a LoRA (rank 4) the diffusers way (`model.add_adapter(peft.LoraConfig(...))`, or
peft.inject_adapter_in_model where the class lacks the mixin) on its attention and feed-forward linears, trained through engine.offload(training=True, backend="cpu")
at 1.05x the floor its refusal of a budget of 0 names (every step streams), against the same module
built again and trained without the engine: two SGD steps, each step's loss and every LoRA
gradient torch.equal; then handle.remove(), a third step plain, equal to the reference's third,
and the whole state dict equal after.

Variants (one column each):
  prio   eviction="priority", lookahead 2, no activations policy (the weights stream, activations stay)
  auto   eviction="auto" with loss_fn (a training step recorded and simulated at set-up), sync spill K=1
  ckpt   enable_gradient_checkpointing(), eviction="belady", lookahead 2, sync spill K=1 (n/a where
         the class does not support it)
"""
from __future__ import annotations

import sys
import traceback
from contextlib import nullcontext
from typing import Any

import diffusers as d
import peft
import torch

import engine
from engine.errors import BelowFloorError

BF16 = torch.bfloat16
RANK = 4
STEPS = 2  # through the engine; a third runs plain after remove()
SYNC = {"mode": "sync", "num_offload_layers": 1, "min_tensor_bytes": 256}
ATTN_FF = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]
# name -> the LoRA's target linears (suffixes of module names, as peft matches them)
TARGETS = {
    "pixart": ATTN_FF, "hunyuan_dit": ATTN_FF, "cogview4": ATTN_FF, "stable_audio": ATTN_FF, "cosmos": ATTN_FF,
    "skyreels_v2": ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"],
    "allegro": ATTN_FF,
    # both streams' attention, and the routed and shared experts (Linear modules here)
    "hidream": ["to_q", "to_k", "to_v", "to_out", "to_q_t", "to_k_t", "to_v_t", "to_out_t", "w1", "w2", "w3"],
    "dit": ATTN_FF,
    # dual-stream blocks (image and context projections) and single-stream ones
    "bria": [*ATTN_FF, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "ff_context.net.0.proj",
             "ff_context.net.2", "proj_mlp"],
    "omnigen": ["to_q", "to_k", "to_v", "to_out.0", "gate_up_proj", "down_proj"],
}
# Layers run in forward order: HiDream's first five are its caption projections, which save
# nothing autograd needs (frozen, on inputs without grad); its sync spill reaches a block at K=6.
OFFLOAD_LAYERS = {"hidream": 6}
VARIANTS = {
    "prio": dict(eviction="priority", lookahead=2, activations=None, ckpt=False),
    "auto": dict(eviction="auto", lookahead=None, activations=SYNC, ckpt=False, loss_fn=True),
    "ckpt": dict(eviction="belady", lookahead=2, activations=SYNC, ckpt=True),
}


def r(*s: int) -> torch.Tensor:
    return torch.randn(*s).to(BF16)


def build_plain(name: str) -> tuple[torch.nn.Module, dict]:
    """The inference sweep's model and inputs, as built there (on the cpu)."""
    dev = "cpu"
    with torch.device(dev):
        if name == "pixart":
            m = d.PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=4, cross_attention_dim=32, sample_size=16, caption_channels=32)
            i = dict(hidden_states=r(1,4,16,16), encoder_hidden_states=r(1,8,32), timestep=torch.tensor([10]), added_cond_kwargs={"resolution": None, "aspect_ratio": None})
        elif name == "hunyuan_dit":
            m = d.HunyuanDiT2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, patch_size=2, sample_size=16, hidden_size=32, num_layers=4, cross_attention_dim=32, cross_attention_dim_t5=32, pooled_projection_dim=16, text_len=8, text_len_t5=8, use_style_cond_and_image_meta_size=False)
            from diffusers.models.embeddings import get_2d_rotary_pos_embed
            rope = get_2d_rotary_pos_embed(16, ((0, 0), (8, 8)), (8, 8))
            i = dict(hidden_states=r(1,4,16,16), timestep=torch.tensor([10.]).to(BF16), encoder_hidden_states=r(1,8,32), text_embedding_mask=torch.ones(1,8), encoder_hidden_states_t5=r(1,8,32), text_embedding_mask_t5=torch.ones(1,8), image_rotary_emb=tuple(x.to(dev) for x in rope))
        elif name == "cogview4":
            m = d.CogView4Transformer2DModel(patch_size=2, in_channels=4, out_channels=4, num_layers=4, attention_head_dim=16, num_attention_heads=2, text_embed_dim=32, time_embed_dim=16, condition_dim=8, rope_axes_dim=(8, 8))
            i = dict(hidden_states=r(1,4,16,16), encoder_hidden_states=r(1,8,32), timestep=torch.tensor([10]), original_size=torch.tensor([[16.,16.]]), target_size=torch.tensor([[16.,16.]]), crop_coords=torch.tensor([[0.,0.]]))
        elif name == "stable_audio":
            m = d.StableAudioDiTModel(sample_size=32, in_channels=8, num_layers=4, attention_head_dim=16, num_attention_heads=2, num_key_value_attention_heads=1, out_channels=8, cross_attention_dim=32, time_proj_dim=16, global_states_input_dim=32, cross_attention_input_dim=32)
            i = dict(hidden_states=r(1,8,32), timestep=torch.tensor([10]), encoder_hidden_states=r(1,8,32), global_hidden_states=r(1,1,32))
        elif name == "cosmos":
            m = d.CosmosTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=4, text_embed_dim=32, adaln_lora_dim=8, max_size=(4, 32, 32), patch_size=(1, 2, 2), concat_padding_mask=False)
            i = dict(hidden_states=r(1,4,2,16,16), timestep=torch.tensor([10]), encoder_hidden_states=r(1,8,32))
        elif name == "skyreels_v2":
            m = d.SkyReelsV2Transformer3DModel(patch_size=(1,2,2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=32, freq_dim=16, ffn_dim=64, num_layers=4, rope_max_seq_len=64)
            i = dict(hidden_states=r(1,4,2,16,16), timestep=torch.tensor([10]), encoder_hidden_states=r(1,8,32))
        elif name == "allegro":
            m = d.AllegroTransformer3DModel(patch_size=2, patch_size_t=1, num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, num_layers=4, cross_attention_dim=32, sample_height=16, sample_width=16, sample_frames=2, caption_channels=32)
            i = dict(hidden_states=r(1,4,2,16,16), encoder_hidden_states=r(1,8,32), timestep=torch.tensor([10]))
        elif name == "hidream":
            m = d.HiDreamImageTransformer2DModel(patch_size=2, in_channels=4, out_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2, caption_channels=[32, 32], text_emb_dim=32, num_routed_experts=4, num_activated_experts=2, axes_dims_rope=(8, 4, 4), max_resolution=(32, 32), llama_layers=[0, 1, 2, 3])
            i = dict(hidden_states=r(1,4,16,16), timesteps=torch.tensor([10]), encoder_hidden_states_t5=r(1,8,32), encoder_hidden_states_llama3=r(4,1,8,32), pooled_embeds=r(1,32))
        elif name == "dit":
            m = d.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=4, sample_size=16, norm_num_groups=8)
            i = dict(hidden_states=r(1,4,16,16), timestep=torch.tensor([10]), class_labels=torch.tensor([3]))
        elif name == "bria":
            m = d.BriaTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=[4, 6, 6])
            i = dict(hidden_states=r(1,64,16), encoder_hidden_states=r(1,8,32), timestep=torch.tensor([10.]), img_ids=torch.zeros(64,3), txt_ids=torch.zeros(8,3))
        elif name == "omnigen":
            m = d.OmniGenTransformer2DModel(in_channels=4, patch_size=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128, num_layers=4, vocab_size=512, pad_token_id=0, max_position_embeddings=512, original_max_position_embeddings=512, pos_embed_max_size=32, time_step_dim=16, rope_scaling={'short_factor': [1.0]*8, 'long_factor': [1.0]*8})
            i = dict(hidden_states=r(1,4,16,16), timestep=torch.tensor([10.]), input_ids=torch.randint(1,512,(1,8)), input_img_latents=[], input_image_sizes={}, attention_mask=torch.ones(1, 8+64+1, 8+64+1).to(BF16), position_ids=torch.arange(8+64+1)[None])
    return m.to(BF16), {**i, "return_dict": False}
def build(name: str, ckpt: bool) -> tuple[torch.nn.Module, dict]:
    """The class and its inputs at seed 0 in bf16, training mode, its LoRA adapters (random B:
    every gradient nonzero)."""
    torch.manual_seed(0)
    model, inputs = build_plain(name)
    if ckpt:
        model.enable_gradient_checkpointing()
    model.train()
    config = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS[name], init_lora_weights=False)
    if hasattr(model, "add_adapter"):  # diffusers' PeftAdapterMixin, as its LoRA training scripts do
        model.add_adapter(config)
    else:  # a class without the mixin: peft injects the same layers
        peft.inject_adapter_in_model(config, model)
    return model, inputs


def loss_fn(out: Any) -> torch.Tensor:
    return out[0].float().pow(2).mean()


def train(model: torch.nn.Module, inputs: dict, steps: range, handle: Any = None) -> list[tuple[torch.Tensor, dict]]:
    """SGD steps on the adapters, step s seeded by s (dropout alike in both runs); their losses and gradients."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    out = []
    for s in steps:
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(100 + s)
        with handle.step() if handle is not None else nullcontext():
            loss = loss_fn(model(**inputs))
            loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
        opt.step()
    return out


def same(a: list[tuple[torch.Tensor, dict]], b: list[tuple[torch.Tensor, dict]]) -> bool:
    return all(torch.equal(la, lb) and ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga)
               for (la, ga), (lb, gb) in zip(a, b, strict=True))


def floor_mb(model: torch.nn.Module, inputs: dict) -> float:
    try:
        engine.offload(model, budget_mb=0, training=True, example_inputs=inputs, eviction="priority", lookahead=2,
                       backend="cpu")
    except BelowFloorError as e:
        return e.floor_bytes / 1e6
    raise AssertionError("budget 0 accepted")


def variant(name: str, v: dict, ref: list, state: dict) -> str:
    model, inputs = build(name, v["ckpt"])
    budget = 1.05 * floor_mb(model, inputs)
    act = v["activations"]
    if act is not None and name in OFFLOAD_LAYERS:
        act = {**act, "num_offload_layers": OFFLOAD_LAYERS[name]}
    h = engine.offload(model, budget_mb=budget, training=True, example_inputs=inputs, eviction=v["eviction"],
                       lookahead=v["lookahead"], activations=act, backend="cpu",
                       loss_fn=loss_fn if v.get("loss_fn") else None)
    got = train(model, inputs, range(STEPS), h)
    row = h.telemetry()[-1]
    picked = h.eviction
    h.remove()
    got += train(model, inputs, range(STEPS, STEPS + 1))
    assert same(got[:STEPS], ref[:STEPS]), "loss or gradients differ"
    assert same(got[STEPS:], ref[STEPS:]), "the step after remove() differs"
    assert "forward" not in model.__dict__, "forward still wrapped"
    assert all(torch.equal(x, state[k]) for k, x in model.state_dict().items()), "state dict differs after remove()"
    assert row["weight_h2d_bytes"] > 0 and row["weight_evictions"] > 0, "nothing streamed"
    if v["activations"] is not None and not v["ckpt"]:  # checkpointed blocks save little autograd sees
        assert row["activations_spilled"] > 0, "nothing spilled"
    return f"ok {picked}, spilled {row.get('activations_spilled', 0)}"


def checkpointable(name: str) -> bool:
    """Whether the class takes diffusers' gradient checkpointing (else it raises ValueError)."""
    try:
        build_plain(name)[0].enable_gradient_checkpointing()
    except ValueError:
        return False
    return True


def run(name: str, only: list[str]) -> str:
    cells = []
    refs: dict[bool, tuple[list, dict, int]] = {}
    for key, v in VARIANTS.items():
        if only and key not in only:
            continue
        try:
            if v["ckpt"] and not checkpointable(name):
                cells.append(f"{key} n/a")
                continue
            if v["ckpt"] not in refs:
                model, inputs = build(name, v["ckpt"])
                ref = train(model, inputs, range(STEPS + 1))
                state = {k: x.clone() for k, x in model.state_dict().items()}
                refs[v["ckpt"]] = (ref, state, sum(p.numel() for p in model.parameters() if p.requires_grad))
            ref, state, _ = refs[v["ckpt"]]
            cells.append(f"{key} " + variant(name, v, ref, state))
        except Exception as e:
            cells.append(f"{key} FAIL {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
            if len(sys.argv) > 1:
                traceback.print_exc()
    lora = next(iter(refs.values()))[2] if refs else "?"
    return f"lora {lora} params | " + " | ".join(cells)


def main(args: list[str]) -> None:
    """Every class (or those named), every variant (or those named)."""
    names = [a for a in args if a in TARGETS]
    keys = [a for a in args if a in VARIANTS]
    for name in TARGETS:
        if not names or name in names:
            print(name, "|", run(name, keys), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
