"""Llama-3.1-8B LoRA step (rank 32, 2048 tokens, per-layer checkpointing), plain, in turns with
Python's cyclic GC on and paused, beside a ballast of live objects (a CLI process's state).
Run from the repository root on a CUDA machine."""
import gc
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from benchmarks.host_pace_track import host_pace_ns  # noqa: E402
from engine.gc_pause import paused_gc  # noqa: E402

import peft  # noqa: E402
import transformers  # noqa: E402

dev = torch.device("cuda")
with dev:
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8)).to(torch.bfloat16)
m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
m = peft.get_peft_model(m, peft.LoraConfig(r=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                  "gate_proj", "up_proj", "down_proj"]))
m.enable_input_require_grads()
ids = torch.randint(0, 128256, (1, 2048), device=dev)


def step():
    out = m(input_ids=ids).logits
    out.float().pow(2).mean().backward()


def turn(n=4):
    t = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        t.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(t)


for _ in range(3):
    step()
rows = {}
for ballast_n in (0, 2_000_000):
    ballast = [{"k": i, "v": (i, str(i))} for i in range(ballast_n)]
    for t in range(5):
        for mode in ("gc on", "gc paused"):
            probe = host_pace_ns(dev) / 1e3
            if mode == "gc on":
                ms = turn()
            else:
                with paused_gc():
                    ms = turn()
            rows.setdefault((ballast_n, mode), []).append(ms)
            print(f"ballast {ballast_n:>8} turn {t} {mode:9s}: {ms:7.1f} ms  probe {probe:.2f} us/op", flush=True)
    del ballast
    gc.collect()
print("\n| live objects beside | gc | turn medians ms | median |")
print("|---|---|---|---|")
for (b, mode), v in rows.items():
    print(f"| {b} | {mode} | {' '.join(f'{x:.1f}' for x in v)} | {statistics.median(v):.1f} |")
