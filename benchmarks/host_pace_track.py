"""Does a tiny op mix's host pace track a host-bound step's time? Turns of each, interleaved.

    python benchmarks/host_pace_track.py                       # on a CUDA machine
    python benchmarks/host_pace_track.py --turns 12 --hogs 8

Two host-bound steps of transformers Llama-3.1-8B shapes built with random bf16 weights on
the device: a decode (32 layers, one token over a 4096-token KV cache, no grad) and a LoRA
training step (peft rank 32 on the attention projections, --train-layers layers, 512
tokens, forward and backward). Per turn: `host_pace_ns` (a block of tiny ops, the host's time per op) on the
device (and on the CPU), --steps synced decode steps, the probe again, --train-steps synced
training steps, the probe again. The middle third of the turns runs beside --hogs processes
spinning on the CPU, so the host's pace changes within the run. Prints a row per turn, then
per step: the spread of its turn medians, of their ratio to the probe beside them, and the
correlation of the two.
"""
from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.host_drift import turn  # noqa: E402
from engine.modules.build import llama_inputs  # noqa: E402

PACE_BLOCKS = 32  # blocks a round: long enough for perf_counter, short enough to sit in one phase
PACE_ROUNDS = 9
PACE_WARMUP = 2


def pace_block(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> tuple[Callable[[], torch.Tensor], int]:
    """One block of tiny ops on `device`, and the number of ops it dispatches."""
    g = torch.Generator().manual_seed(0)
    heads, tokens, head_dim = 2, 8, 32
    width = heads * head_dim

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g).to(device=device, dtype=dtype)

    x0, w_qkv, w_out, w_up, scale = randn(1, tokens, width), randn(3 * width, width), randn(width, width), \
        randn(2 * width, width), randn(width)

    def block() -> torch.Tensor:
        h = torch.nn.functional.layer_norm(x0, (width,))                                   # 1
        q, k, v = torch.nn.functional.linear(h, w_qkv).chunk(3, dim=-1)                    # 2 (+ chunk)
        q, k, v = (t.view(1, tokens, heads, head_dim).transpose(1, 2) for t in (q, k, v))  # 6 views
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v)                     # 1
        a = a.transpose(1, 2).reshape(1, tokens, width)                                    # 2
        x = x0 + torch.nn.functional.linear(a, w_out)                                      # 2
        u = torch.nn.functional.linear(torch.nn.functional.layer_norm(x, (width,)), w_up)  # 2
        gate, up = u.chunk(2, dim=-1)                                                      # 1
        return x + (torch.nn.functional.silu(gate) * up) * scale                           # 4

    return block, 21


def host_pace_ns(device: torch.device, blocks: int = PACE_BLOCKS, rounds: int = PACE_ROUNDS) -> float:
    """The host's median time per dispatched op of `pace_block`, in ns: `rounds` rounds of
    `blocks` blocks, each round's host time from its first dispatch to its last (the device
    drained before it, so the launch queue never fills)."""
    block, ops = pace_block(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    per_op = []
    with torch.no_grad():
        for r in range(PACE_WARMUP + rounds):
            sync()
            t0 = time.perf_counter_ns()
            for _ in range(blocks):
                block()
            t1 = time.perf_counter_ns()
            if r >= PACE_WARMUP:
                per_op.append((t1 - t0) / (blocks * ops))
    sync()
    return statistics.median(per_op)


def spin(stop: multiprocessing.synchronize.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(100_000):
            x += i * i


def spread(values: list[float]) -> str:
    m = statistics.mean(values)
    return f"{min(values):.2f}-{max(values):.2f} (cv {statistics.pstdev(values) / m * 100:.1f}%)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--train-steps", type=int, default=3)
    ap.add_argument("--train-layers", type=int, default=8)
    ap.add_argument("--hogs", type=int, default=8)
    args = ap.parse_args()
    import peft
    import transformers

    dev = torch.device("cuda")
    cfg = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
               num_key_value_heads=8)
    with dev:
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=32, **cfg))
        llama = llama.to(torch.bfloat16).eval()
        small = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=args.train_layers, **cfg))
        small = small.to(torch.bfloat16)
    decode_in = llama_inputs(llama, SimpleNamespace(kind="decode", batch=1, context_tokens=4096, text_tokens=0),
                             dev, torch.bfloat16)
    lora = peft.get_peft_model(small, peft.LoraConfig(r=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    tokens = torch.randint(0, 128256, (1, 512), device=dev)

    def decode() -> None:
        with torch.no_grad():
            llama(**decode_in)

    def train() -> None:
        lora(input_ids=tokens, labels=tokens).loss.backward()

    for _ in range(3):
        decode()
        train()
    ctx = multiprocessing.get_context("spawn")
    stop, hogs = ctx.Event(), []
    rows = []
    print("| turn | hogs | probe us/op (device) | probe us/op (cpu) | decode ms | train ms | decode / probe | train / probe |")
    print("|---|---|---|---|---|---|---|---|")
    for t in range(args.turns):
        hogged = args.turns // 3 <= t < 2 * args.turns // 3
        if hogged and not hogs:
            hogs = [ctx.Process(target=spin, args=(stop,), daemon=True) for _ in range(args.hogs)]
            for h in hogs:
                h.start()
            time.sleep(1.0)
        if not hogged and hogs:
            stop.set()
            for h in hogs:
                h.join()
            hogs, stop = [], ctx.Event()
        p0 = host_pace_ns(dev)
        cpu = host_pace_ns(torch.device("cpu"))
        d = turn(decode, args.steps)["median"]
        p1 = host_pace_ns(dev)
        tr = turn(train, args.train_steps)["median"]
        p2 = host_pace_ns(dev)
        pd, pt = (p0 + p1) / 2e3, (p1 + p2) / 2e3
        rows.append(dict(probe=(p0 + p1 + p2) / 3e3, cpu=cpu / 1e3, decode=d, train=tr, pd=pd, pt=pt))
        print(f"| {t} | {len(hogs)} | {p0 / 1e3:.2f} / {p1 / 1e3:.2f} / {p2 / 1e3:.2f} | {cpu / 1e3:.2f} | {d:.2f} | "
              f"{tr:.1f} | {d / pd:.3f} | {tr / pt:.3f} |", flush=True)
    stop.set()
    print("\n| step | turn medians ms | step / probe beside it | correlation with the probe |")
    print("|---|---|---|---|")
    for key, probe in (("decode", "pd"), ("train", "pt")):
        steps, probes = [r[key] for r in rows], [r[probe] for r in rows]
        print(f"| {key} | {spread(steps)} | {spread([s / p for s, p in zip(steps, probes)])} | "
              f"{statistics.correlation(steps, probes):.3f} |")
    print(f"| probe (device) us/op | {spread([r['probe'] for r in rows])} | | |")
    print(f"| probe (cpu) us/op | {spread([r['cpu'] for r in rows])} | | "
          f"{statistics.correlation([r['cpu'] for r in rows], [r['probe'] for r in rows]):.3f} (with the device's) |")


if __name__ == "__main__":
    main()
