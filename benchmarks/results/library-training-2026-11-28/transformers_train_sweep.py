"""As run on 2026-11-28 (CPU, torch 2.13, transformers 5.24.0, peft 0.21): python transformers_train_sweep.py [CLASS...]

The 22 transformers classes of ../library-classes-2026-11-28/transformers_sweep.py (same tiny configs),
each with a peft LoRA (rank 4) on its attention and MLP linears, trained through
engine.offload(training=True, backend="cpu") at 1.05x the floor its refusal of a budget of 0 names
(every step streams), against the same module built again and trained without the engine:
two SGD steps, each step's loss and every LoRA gradient torch.equal; then handle.remove(), a
third step plain, equal to the reference's third, and the whole state dict equal after.

Variants (one column each):
  prio   eviction="priority", lookahead 2, no activations policy (the weights stream, activations stay)
  auto   eviction="auto" with loss_fn (a training step recorded and simulated at set-up), sync spill K=1
  ckpt   gradient_checkpointing_enable(use_reentrant=False), eviction="belady", lookahead 2, sync spill K=1
"""
from __future__ import annotations

import sys
import traceback
from contextlib import nullcontext
from typing import Any

import peft
import torch
import transformers as t

import engine
from engine.errors import BelowFloorError

BF16 = torch.bfloat16
RANK = 4
STEPS = 2  # through the engine; a third runs plain after remove()
SYNC = {"mode": "sync", "num_offload_layers": 1, "min_tensor_bytes": 256}
C = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
         num_key_value_heads=2, max_position_embeddings=128)
LLAMA_LIKE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NEOX_LIKE = ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]


def cfg(name: str, **kw: Any) -> Any:
    return getattr(t, name)(**{**C, **kw})


EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # 3-D expert weights: peft's target_parameters
# class -> (its config, the LoRA's target linears[, its target parameters]). The configs are the inference sweep's.
TF: dict[str, tuple[Any, ...]] = {
    "Phi3ForCausalLM": (lambda: cfg("Phi3Config", pad_token_id=0), ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "Gemma3ForCausalLM": (lambda: cfg("Gemma3TextConfig", head_dim=16, sliding_window=8), LLAMA_LIKE),
    "Olmo2ForCausalLM": (lambda: cfg("Olmo2Config"), LLAMA_LIKE),
    "GPTNeoXForCausalLM": (lambda: cfg("GPTNeoXConfig"), NEOX_LIKE),
    "FalconForCausalLM": (lambda: t.FalconConfig(vocab_size=512, hidden_size=64, num_hidden_layers=4,
                                                 num_attention_heads=4), NEOX_LIKE),
    "StableLmForCausalLM": (lambda: cfg("StableLmConfig"), LLAMA_LIKE),
    # MoE classes: experts are 3-D parameters in transformers 5 (no Linear); peft wraps them
    # (ParamWrapper, a parametrization) when named in target_parameters.
    "Qwen2MoeForCausalLM": (lambda: cfg("Qwen2MoeConfig", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                        shared_expert_intermediate_size=64), LLAMA_LIKE, EXPERTS),
    "DeepseekV3ForCausalLM": (lambda: cfg("DeepseekV3Config", n_routed_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                                          qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_group=1,
                                          topk_group=1),
                              ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
                               "up_proj", "down_proj"], EXPERTS),
    "GraniteMoeForCausalLM": (lambda: cfg("GraniteMoeConfig", num_local_experts=4, num_experts_per_tok=2),
                              ["q_proj", "k_proj", "v_proj", "o_proj"],
                              ["block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.experts.down_proj"]),
    "CohereForCausalLM": (lambda: cfg("CohereConfig"), LLAMA_LIKE),
    "Starcoder2ForCausalLM": (lambda: cfg("Starcoder2Config"), ["q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"]),
    "GPTBigCodeForCausalLM": (lambda: t.GPTBigCodeConfig(vocab_size=512, n_embd=64, n_layer=4, n_head=4, n_positions=128),
                              ["c_attn", "c_proj", "c_fc"]),
    "BloomForCausalLM": (lambda: t.BloomConfig(vocab_size=512, hidden_size=64, n_layer=4, n_head=4), NEOX_LIKE),
    "OPTForCausalLM": (lambda: t.OPTConfig(vocab_size=512, hidden_size=64, ffn_dim=128, num_hidden_layers=4,
                                           num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=64),
                       ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]),
    "GptOssForCausalLM": (lambda: cfg("GptOssConfig", num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                                      layer_types=["sliding_attention", "full_attention"] * 2),
                          ["q_proj", "k_proj", "v_proj", "o_proj"], EXPERTS),
    "Glm4ForCausalLM": (lambda: cfg("Glm4Config", head_dim=16, pad_token_id=0),
                        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "DeepseekV2ForCausalLM": (lambda: cfg("DeepseekV2Config", n_routed_experts=4, num_experts_per_tok=2,
                                          moe_intermediate_size=32, q_lora_rank=None, kv_lora_rank=16,
                                          qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, first_k_dense_replace=1,
                                          n_group=1, topk_group=1),
                              ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                               "down_proj"], EXPERTS),
    "Ernie4_5_MoeForCausalLM": (lambda: cfg("Ernie4_5_MoeConfig", moe_num_experts=4, moe_k=2, moe_intermediate_size=32),
                                LLAMA_LIKE, EXPERTS),
    "SmolLM3ForCausalLM": (lambda: cfg("SmolLM3Config", pad_token_id=0), LLAMA_LIKE),
    "MambaForCausalLM": (lambda: t.MambaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=4, state_size=8),
                         ["in_proj", "x_proj"]),  # peft refuses out_proj on Mamba; its scan reads dt_proj.weight
    "JambaForCausalLM": (lambda: cfg("JambaConfig", num_experts=2, attn_layer_period=2, attn_layer_offset=1,
                                     expert_layer_period=2, expert_layer_offset=1, use_mamba_kernels=False),
                         ["in_proj", "x_proj", *LLAMA_LIKE],  # its scan reads dt_proj.weight, not the module
                         ["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"]),
    "BertModel": (lambda: t.BertConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                       num_attention_heads=4),
                  ["query", "key", "value", "intermediate.dense", "output.dense"]),  # not the pooler: no loss reads it
}
VARIANTS = {
    "prio": dict(eviction="priority", lookahead=2, activations=None, ckpt=False),
    "auto": dict(eviction="auto", lookahead=None, activations=SYNC, ckpt=False, loss_fn=True),
    "ckpt": dict(eviction="belady", lookahead=2, activations=SYNC, ckpt=True),
}
INPUTS = {"input_ids": torch.randint(1, 512, (1, 16), generator=torch.Generator().manual_seed(1))}


def first(o: Any) -> torch.Tensor:
    if hasattr(o, "logits"):
        return o.logits
    if hasattr(o, "last_hidden_state"):
        return o.last_hidden_state
    return o[0]


def loss_fn(out: Any) -> torch.Tensor:
    return first(out).float().pow(2).mean()


def build(name: str, ckpt: bool) -> torch.nn.Module:
    """The class at seed 0 in bf16, training mode, its LoRA adapters (random B: every gradient nonzero)."""
    make, targets, *params = TF[name]
    torch.manual_seed(0)
    model = getattr(t, name)(make()).to(BF16)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=targets,
                                                      target_parameters=params[0] if params else None,
                                                      init_lora_weights=False))


def train(model: torch.nn.Module, steps: range, handle: Any = None) -> list[tuple[torch.Tensor, dict]]:
    """SGD steps on the adapters, step s seeded by s (dropout alike in both runs); their losses and gradients."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    out = []
    for s in steps:
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(100 + s)
        with handle.step() if handle is not None else nullcontext():
            loss = loss_fn(model(**INPUTS))
            loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
        opt.step()
    return out


def same(a: list[tuple[torch.Tensor, dict]], b: list[tuple[torch.Tensor, dict]]) -> bool:
    return all(torch.equal(la, lb) and ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga)
               for (la, ga), (lb, gb) in zip(a, b, strict=True))


def floor_mb(model: torch.nn.Module) -> float:
    try:
        engine.offload(model, budget_mb=0, training=True, example_inputs=INPUTS, eviction="priority", lookahead=2,
                       backend="cpu")
    except BelowFloorError as e:
        return e.floor_bytes / 1e6
    raise AssertionError("budget 0 accepted")


def variant(name: str, v: dict, ref: list, state: dict) -> str:
    model = build(name, v["ckpt"])
    budget = 1.05 * floor_mb(model)
    h = engine.offload(model, budget_mb=budget, training=True, example_inputs=INPUTS, eviction=v["eviction"],
                       lookahead=v["lookahead"], activations=v["activations"], backend="cpu",
                       loss_fn=loss_fn if v.get("loss_fn") else None)
    got = train(model, range(STEPS), h)
    row = h.telemetry()[-1]
    picked = h.eviction
    h.remove()
    got += train(model, range(STEPS, STEPS + 1))
    assert same(got[:STEPS], ref[:STEPS]), "loss or gradients differ"
    assert same(got[STEPS:], ref[STEPS:]), "the step after remove() differs"
    assert "forward" not in model.__dict__, "forward still wrapped"
    assert all(torch.equal(x, state[k]) for k, x in model.state_dict().items()), "state dict differs after remove()"
    assert row["weight_h2d_bytes"] > 0 and row["weight_evictions"] > 0, "nothing streamed"
    if v["activations"] is not None and not v["ckpt"]:  # checkpointed blocks save little autograd sees
        assert row["activations_spilled"] > 0, "nothing spilled"
    return f"ok {picked}, spilled {row.get('activations_spilled', 0)}"


def run(name: str, only: list[str]) -> str:
    cells = []
    refs = {}
    for key, v in VARIANTS.items():
        if only and key not in only:
            continue
        try:
            if v["ckpt"] not in refs:
                model = build(name, v["ckpt"])
                ref = train(model, range(STEPS + 1))
                state = {k: x.clone() for k, x in model.state_dict().items()}
                refs[v["ckpt"]] = (ref, state, sum(p.numel() for p in model.parameters() if p.requires_grad))
            ref, state, n = refs[v["ckpt"]]
            cells.append(f"{key} " + variant(name, v, ref, state))
        except Exception as e:
            cells.append(f"{key} FAIL {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
            if only or len(sys.argv) > 1:
                traceback.print_exc()
    return f"lora {refs[False][2] if False in refs else '?'} params | " + " | ".join(cells)


def main(args: list[str]) -> None:
    """Every class (or those named), every variant (or those named)."""
    names = [a for a in args if a in TF]
    keys = [a for a in args if a in VARIANTS]
    for name in TF:
        if not names or name in names:
            print(name, "|", run(name, keys), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
