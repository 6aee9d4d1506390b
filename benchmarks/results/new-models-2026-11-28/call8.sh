# SDPA at SD3.5's joint sequence (4096 image + 333 text tokens) against aligned lengths, in the
# layout the probe times (1, bh, l, d) and the one diffusers hands it ((1, l, h, d) viewed).
python3 - <<'PY'
import torch, torch.nn.functional as F
def t(fn, n=20):
    for _ in range(5): fn()
    torch.cuda.synchronize(); a=torch.cuda.Event(enable_timing=True); b=torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n): fn()
    b.record(); b.synchronize(); return a.elapsed_time(b)/n*1e3
for bh, l, d in [(38, 4429, 64), (32, 4096, 64), (38, 4096, 64), (32, 4429, 64), (24, 4608, 128), (32, 4096, 128), (8, 4096, 64)]:
    q = torch.randn(1, bh, l, d, device="cuda", dtype=torch.bfloat16)
    lay = [torch.randn(1, l, bh, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3)]
    c = t(lambda: F.scaled_dot_product_attention(q, q, q))
    v = t(lambda: F.scaled_dot_product_attention(*lay))
    fl = 4.0 * bh * l * l * d
    print(f"bh {bh} l {l} d {d}: contiguous {c:8.1f} us ({fl/c/1e6:6.1f} TFLOP/s)  (1,l,h,d) viewed {v:8.1f} us ({fl/v/1e6:6.1f})")
PY
