"""As run on 2026-11-28 (CPU, torch 2.13, transformers 5.24.0): python transformers_sweep.py [CLASS...]
Each class: engine.offload bitwise at 1.05x its floor (priority, belady), restored; engine.synthesize on meta."""
import sys, traceback, torch, transformers as t
import engine
from engine.errors import BelowFloorError
BF16 = torch.bfloat16
C = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
         num_key_value_heads=2, max_position_embeddings=128)
def cfg(name, **kw):
    return getattr(t, name)(**{**C, **kw})
TF = {
 "Phi3ForCausalLM": lambda: cfg("Phi3Config", pad_token_id=0),
 "Gemma3ForCausalLM": lambda: cfg("Gemma3TextConfig", head_dim=16, sliding_window=8),
 "Olmo2ForCausalLM": lambda: cfg("Olmo2Config"),
 "GPTNeoXForCausalLM": lambda: cfg("GPTNeoXConfig"),
 "FalconForCausalLM": lambda: t.FalconConfig(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4),
 "StableLmForCausalLM": lambda: cfg("StableLmConfig"),
 "Qwen2MoeForCausalLM": lambda: cfg("Qwen2MoeConfig", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64),
 "DeepseekV3ForCausalLM": lambda: cfg("DeepseekV3Config", n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_group=1, topk_group=1),
 "GraniteMoeForCausalLM": lambda: cfg("GraniteMoeConfig", num_local_experts=4, num_experts_per_tok=2),
 "CohereForCausalLM": lambda: cfg("CohereConfig"),
 "Starcoder2ForCausalLM": lambda: cfg("Starcoder2Config"),
 "GPTBigCodeForCausalLM": lambda: t.GPTBigCodeConfig(vocab_size=512, n_embd=64, n_layer=4, n_head=4, n_positions=128),
 "BloomForCausalLM": lambda: t.BloomConfig(vocab_size=512, hidden_size=64, n_layer=4, n_head=4),
 "OPTForCausalLM": lambda: t.OPTConfig(vocab_size=512, hidden_size=64, ffn_dim=128, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=64),
 "GptOssForCausalLM": lambda: cfg("GptOssConfig", num_local_experts=4, num_experts_per_tok=2, head_dim=16, layer_types=["sliding_attention","full_attention"]*2),
 "Glm4ForCausalLM": lambda: cfg("Glm4Config", head_dim=16, pad_token_id=0),
 "DeepseekV2ForCausalLM": lambda: cfg("DeepseekV2Config", n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_group=1, topk_group=1),
 "Ernie4_5_MoeForCausalLM": lambda: cfg("Ernie4_5_MoeConfig", moe_num_experts=4, moe_k=2, moe_intermediate_size=32),
 "SmolLM3ForCausalLM": lambda: cfg("SmolLM3Config", pad_token_id=0),
 "MambaForCausalLM": lambda: t.MambaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=4, state_size=8),
 "JambaForCausalLM": lambda: cfg("JambaConfig", num_experts=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, use_mamba_kernels=False),
 "BertModel": lambda: t.BertConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4),
}
def first(o):
    if hasattr(o, "logits"): return o.logits
    if hasattr(o, "last_hidden_state"): return o.last_hidden_state
    return o[0]
def floor_mb(model, inputs):
    try:
        engine.offload(model, budget_mb=0, example_inputs=inputs, eviction="priority", lookahead=2, backend="cpu")
    except BelowFloorError as e:
        return e.floor_bytes / 1e6
    raise AssertionError("budget 0 accepted")
def run(name, mk):
    torch.manual_seed(0)
    conf = mk()
    cls = getattr(t, name)
    model = cls(conf).to(BF16).eval()
    inputs = {"input_ids": torch.randint(1, 512, (1, 16))}
    with torch.no_grad(): ref = first(model(**inputs)).clone()
    b = 1.05 * floor_mb(model, inputs)
    for ev in ("priority", "belady"):
        h = engine.offload(model, budget_mb=b, example_inputs=inputs, eviction=ev, lookahead=2, backend="cpu")
        with torch.no_grad():
            ok = all(torch.equal(first(model(**inputs)), ref) for _ in range(2))
        h2d = h.telemetry()[-1]["h2d_bytes"]; h.remove()
        assert ok, f"{ev} not bitwise"
        assert h2d > 0, "nothing streamed"
    with torch.no_grad(): assert torch.equal(first(model(**inputs)), ref), "not restored"
    with torch.device("meta"):
        mm = cls(conf).to(BF16)
    tr = engine.synthesize(mm, {"input_ids": torch.randint(1, 512, (1, 16), device="meta")})
    return f"ok floor {b/1.05:.3f} MB, synth {len(tr.records)} records"
only = sys.argv[1:]
for name, mk in TF.items():
    if only and name not in only: continue
    try:
        print(name, run(name, mk), flush=True)
    except Exception as e:
        print(name, "FAIL", type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "", flush=True)
        if only: traceback.print_exc()
