"""Masked vs unmasked SDPA (and one HunyuanVideo single block) in inference, a training
forward and its backward, on the device: which backend runs, and at what rate."""
import statistics, sys, json, os
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

dev = "cuda"
torch.manual_seed(0)


def timed(fn, warm=3, reps=10):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def sdpa_case(bh, L, d, masked, backend=None):
    q, k, v = (torch.randn(1, bh, L, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
    mask = None
    if masked:
        mask = torch.ones(1, 1, 1, L, device=dev, dtype=torch.bool)
        mask[..., -max(1, L // 32):] = False
    ctx = sdpa_kernel([backend]) if backend is not None else torch.enable_grad()
    out = {}
    try:
        with ctx:
            with torch.no_grad():
                out["infer"] = timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
            qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
            out["train_fwd"] = timed(lambda: F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask))
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask)
            g = torch.randn_like(o)
            def fb():
                y = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask)
                y.backward(g)
            out["fwd_bwd"] = timed(fb)
            out["bwd"] = out["fwd_bwd"] - out["train_fwd"]
    except Exception as e:
        out["error"] = str(e).splitlines()[0][:80]
    return out


rows = []
for L in (1024, 2048, 4352, 8448):
    for masked in (False, True):
        r = sdpa_case(24, L, 128, masked)
        flops = 4 * 24 * L * L * 128
        r.update(L=L, masked=masked, tflops_infer=flops / r["infer"] / 1e9, tflops_train_fwd=flops / r["train_fwd"] / 1e9,
                 tflops_bwd=2 * flops / r["bwd"] / 1e9)
        rows.append(r)
        print(json.dumps(r))
print("backends at L=4352 masked / unmasked:")
for masked in (True, False):
    for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
        print(masked, b.name, json.dumps(sdpa_case(24, 4352, 128, masked, b)))

# One HunyuanVideo single block, default widths, 4096 + 256 tokens.
try:
    from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoSingleTransformerBlock
    blk = HunyuanVideoSingleTransformerBlock(24, 128).to(dev, torch.bfloat16).requires_grad_(False)
    x = torch.randn(1, 4096, 3072, device=dev, dtype=torch.bfloat16)
    e = torch.randn(1, 256, 3072, device=dev, dtype=torch.bfloat16)
    temb = torch.randn(1, 3072, device=dev, dtype=torch.bfloat16)
    mask = torch.ones(1, 1, 1, 4352, device=dev, dtype=torch.bool); mask[..., -64:] = False
    for m in (None, mask):
        with torch.no_grad():
            inf = timed(lambda: blk(x, e, temb, m))
        xg = x.clone().requires_grad_(True)
        tf = timed(lambda: blk(xg, e, temb, m))
        def fb():
            h, c = blk(xg, e, temb, m)
            (h.float().sum() + c.float().sum()).backward()
        fwbw = timed(fb)
        print("hv single block", "masked" if m is not None else "unmasked", "infer %.3f train_fwd %.3f fwd+bwd %.3f ms" % (inf, tf, fwbw))
except Exception as err:
    print("block failed", err)
print("TABLE")
for r in rows:
    print("L=%5d %-8s infer %.3f ms (%.0f TF) train_fwd %.3f ms (%.0f TF) bwd %.3f ms (%.0f TF)" % (
        r["L"], "masked" if r["masked"] else "unmasked", r["infer"], r["tflops_infer"], r["train_fwd"], r["tflops_train_fwd"], r["bwd"], r["tflops_bwd"]))
