"""As run on 2026-11-28 (CPU, torch 2.13, diffusers 0.42.1): python diffusers_sweep.py [NAME...]
Each class: engine.offload bitwise at 1.05x its floor (priority, belady), restored; engine.synthesize on meta."""
import sys, traceback, torch, diffusers as d
import engine
from engine.errors import BelowFloorError
BF16 = torch.bfloat16
def r(*s): return torch.randn(*s).to(BF16)
def build(name, dev):
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
    return m.to(BF16).eval(), {**i, "return_dict": False}
def floor_mb(model, inputs):
    try:
        engine.offload(model, budget_mb=0, example_inputs=inputs, eviction="priority", lookahead=2, backend="cpu")
    except BelowFloorError as e:
        return e.floor_bytes / 1e6
    raise AssertionError("budget 0 accepted")
def run(name):
    torch.manual_seed(0)
    model, inputs = build(name, "cpu")
    with torch.no_grad(): ref = model(**inputs)[0].clone()
    b = 1.05 * floor_mb(model, inputs)
    for ev in ("priority", "belady"):
        h = engine.offload(model, budget_mb=b, example_inputs=inputs, eviction=ev, lookahead=2, backend="cpu")
        with torch.no_grad():
            ok = all(torch.equal(model(**inputs)[0], ref) for _ in range(2))
        h2d = h.telemetry()[-1]["h2d_bytes"]; h.remove()
        assert ok, f"{ev} not bitwise"
        assert h2d > 0, "nothing streamed"
    with torch.no_grad(): assert torch.equal(model(**inputs)[0], ref), "not restored"
    mm, mi = build(name, "meta")
    try:
        tr = engine.synthesize(mm, mi)
        s = f"synth {len(tr.records)} records"
    except Exception as e:
        s = f"synth FAIL {type(e).__name__}: {str(e).splitlines()[0][:250]}"
    return f"ok floor {b/1.05:.3f} MB; {s}"
names = sys.argv[1:] or ["pixart","hunyuan_dit","cogview4","stable_audio","cosmos","skyreels_v2","allegro","hidream","dit","bria","omnigen"]
for name in names:
    try:
        print(name, run(name), flush=True)
    except Exception as e:
        print(name, "FAIL", type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "", flush=True)
        if len(sys.argv) > 1: traceback.print_exc()
