"""What a mask that varies along the queries costs SDPA on this GPU, beside a key mask: cuDNN's
attention (inference) over (1, heads, L, 128) with a boolean key mask (1, 1, 1, L), as the
compute probe times it, and with a full one (1, 1, L, L), as transformers hands a causal or
sliding-window prefill; each timed on the GPU alone (the host queues the repeats behind a spin
kernel), median of 5 rounds. Prints one row per shape: both times and the full mask's extra
per byte of the mask as every head reads it (heads x L x L x 2)."""
import statistics

import torch
import torch.nn.functional as F

dev = torch.device("cuda")


def gpu_us(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(5):
        torch.cuda._sleep(20_000_000)  # ~10 ms: every repeat queued before the first runs
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(repeats):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / repeats)
    return statistics.median(out)


print("| heads | L | key mask us | full mask us | no mask us | extra ns per GB of mask read |")
print("|---|---|---|---|---|---|")
for heads in (8, 32):
    for n in (1024, 2048, 4096, 8192):
        q = torch.randn(1, heads, n, 128, device=dev, dtype=torch.bfloat16)
        key = torch.ones(1, 1, 1, n, device=dev, dtype=torch.bool)
        full = torch.ones(n, n, device=dev, dtype=torch.bool).tril()[None, None]
        t_key = gpu_us(lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=key))
        t_full = gpu_us(lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=full))
        t_none = gpu_us(lambda: F.scaled_dot_product_attention(q, q, q))
        read = heads * n * n * 2
        print(f"| {heads} | {n} | {t_key:.1f} | {t_full:.1f} | {t_none:.1f} | {(t_full - t_key) * 1e3 / (read / 1e9):.0f} |",
              flush=True)
        del q, key, full
# A decode's masked attention, as the probe times it and on the GPU alone.
for heads, lq in ((32, 1), (8, 4)):
    q = torch.randn(1, heads, lq, 128, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(1, heads, 4096, 128, device=dev, dtype=torch.bfloat16)
    m = torch.ones(1, 1, 1, 4096, device=dev, dtype=torch.bool)
    print(f"decode ({heads}, {lq}, 4096, 128) key-masked: {gpu_us(lambda: F.scaled_dot_product_attention(q, kv, kv, attn_mask=m)):.1f} us on the GPU alone")
