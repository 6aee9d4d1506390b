"""Gemma 3 12B's LoRA step op by op on the GPU: six layers (five sliding-window, one global) at
the published sizes, 2048 tokens, rank 32 on every projection, per-layer checkpointing, cuDNN's
attention off as the CLI trains; the kernels' CUDA time by aten op and input shapes over three
profiled steps after two warm-up steps, the top rows printed.

    python benchmarks/results/unseen-2026-11-30b/profile_gemma3.py
"""
import torch
import transformers as t
from peft import LoraConfig, inject_adapter_in_model
from torch.profiler import ProfilerActivity, profile

torch.backends.cuda.enable_cudnn_sdp(False)
cfg = t.Gemma3TextConfig(vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=6,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
                         sliding_window=1024, rope_theta=1e6, rope_local_base_freq=1e4,
                         rope_scaling={"rope_type": "linear", "factor": 8.0}, tie_word_embeddings=True)
with torch.device("cuda"):
    model = t.Gemma3ForCausalLM(cfg).to(torch.bfloat16)
model.requires_grad_(False)
model = inject_adapter_in_model(LoraConfig(r=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                  "up_proj", "down_proj"]), model)
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
model.train()
ids = torch.randint(0, 262208, (1, 2048), device="cuda")


def step():
    out = model(input_ids=ids).logits
    out.float().pow(2).mean().backward()


for _ in range(2):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA], record_shapes=True) as prof:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cuda_time_total", row_limit=25,
                                                         max_name_column_width=40, max_shapes_column_width=70))
