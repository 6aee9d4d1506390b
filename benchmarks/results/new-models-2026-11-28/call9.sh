# Attention at sequence lengths off the 128-token tile, over heads, head dims and lengths: the
# time per FLOP against the aligned length just under it (SDPA's default backend, bf16).
python3 - <<'PY'
import torch, torch.nn.functional as F
def t(fn, n=20):
    for _ in range(5): fn()
    torch.cuda.synchronize(); a=torch.cuda.Event(enable_timing=True); b=torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n): fn()
    b.record(); b.synchronize(); return a.elapsed_time(b)/n*1e3
def rate(bh, lq, lk, d):
    q = torch.randn(1, bh, lq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, bh, lk, d, device="cuda", dtype=torch.bfloat16)
    us = t(lambda: F.scaled_dot_product_attention(q, k, k))
    return 4.0 * bh * lq * lk * d / us / 1e6, us
print("bh lq lk d | aligned lq0 lk0 TFLOP/s | ragged TFLOP/s | time per FLOP, ragged / aligned")
for d in (64, 128):
    for bh in (8, 32):
        for l in (1024, 4096, 8192):
            a, _ = rate(bh, l, l, d)
            for extra in (1, 77, 333):
                r, _ = rate(bh, l + extra, l + extra, d)
                print(f"{bh} {l+extra} {l+extra} {d} | {a:6.1f} | {r:6.1f} | {a / r:5.3f}")
        a, _ = rate(bh, 4096, 256, d)
        r, _ = rate(bh, 4096, 333, d)
        print(f"{bh} 4096 333 {d} | {a:6.1f} (lk 256) | {r:6.1f} | {a / r:5.3f}")
        a, _ = rate(bh, 256, 4096, d)
        r, _ = rate(bh, 333, 4096, d)
        print(f"{bh} 333 4096 {d} | {a:6.1f} (lq 256) | {r:6.1f} | {a / r:5.3f}")
PY
