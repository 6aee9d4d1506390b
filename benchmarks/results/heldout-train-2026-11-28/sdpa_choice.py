"""Which SDPA backend a real diffusers block runs, in inference and in a LoRA training step."""
import collections, sys
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from hydra import compose, initialize_config_module
from engine.config import register
from engine.modules.build import build_module, example_inputs
from engine.modules.adapters import add_lora, enable_checkpointing, TrainingLoss
register()
import os
dev = torch.device(os.environ.get("DEV", "cuda"))
seen = collections.Counter()
orig = F.scaled_dot_product_attention


def logged(query=None, key=None, value=None, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **kw):
    q, k, v = query, key, value
    try:
        choice = SDPBackend(torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)).name
    except Exception as e:
        choice = "?" + str(e)[:40]
    m = None if attn_mask is None else (str(attn_mask.dtype).replace("torch.", ""), tuple(attn_mask.shape), attn_mask.stride())
    seen[(mode, choice, tuple(q.shape), q.stride(), q.is_contiguous(), q.requires_grad, m, torch.is_grad_enabled())] += 1
    return orig(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, **kw)


F.scaled_dot_product_attention = logged
for name, layers in (("hunyuan_video_diffusers", "+model.module.num_layers=1 +model.module.num_single_layers=1"),
                     ("qwen_image_diffusers", "+model.module.num_layers=1"),
                     ("flux_diffusers", "+model.module.num_layers=1 +model.module.num_single_layers=1")):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose("config", overrides=[f"model={name}", "workload=train_lora", "workload.video_tokens=" + os.environ.get("TOK", "4096"),
                                           "workload.lora_rank=32", "workload.checkpointing=true", *layers.split()])
    module = build_module(cfg.model).to_empty(device=dev)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    inputs = example_inputs(cfg.model, module, cfg.workload, dev)
    mode = name + " infer"
    with torch.no_grad():
        module(**inputs)
    add_lora(module, 32, list(cfg.model.lora_targets), device=dev)
    enable_checkpointing(module)
    mode = name + " train"
    loss = TrainingLoss()
    out = module(**inputs)
    loss(out).backward()
    torch.cuda.synchronize() if dev.type == "cuda" else None
    # kernels by name in one training step
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA if dev.type == "cuda" else ProfilerActivity.CPU]) as prof:
        out = module(**inputs); loss(out).backward(); torch.cuda.synchronize() if dev.type == "cuda" else None
    names = collections.Counter()
    for e in prof.events():
        n = e.name.lower()
        if any(s in n for s in ("fmha", "flash", "cudnn", "attention", "sdpa", "efficient", "cutlass")):
            names[e.name[:90]] += 1
    print(name, "attention kernels in a training step:")
    for n, c in names.most_common(8):
        print("   ", c, n)
    del module, inputs, out
    torch.cuda.empty_cache()
for k, c in seen.items():
    print(c, k)

# The layout diffusers hands SDPA ([B, L, H, D] permuted), masked or not: each backend's time.
import statistics
from torch.nn.attention import sdpa_kernel
F.scaled_dot_product_attention = orig


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


if dev.type == "cuda":
    L = 4352
    for permuted in (True, False):
        for masked in (True, False):
            shape = (1, L, 24, 128) if permuted else (1, 24, L, 128)
            q, k, v = (torch.randn(*shape, device=dev, dtype=torch.bfloat16) for _ in range(3))
            if permuted:
                q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))
            mask = None
            if masked:
                mask = torch.ones(1, 1, 1, L, device=dev, dtype=torch.bool); mask[..., -64:] = False
            qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
            for backend in (None, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION):
                try:
                    with (sdpa_kernel([backend]) if backend else torch.enable_grad()):
                        with torch.no_grad():
                            inf = timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
                        tf = timed(lambda: F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask))
                        g = torch.randn(1, 24, L, 128, device=dev, dtype=torch.bfloat16)
                        fb = timed(lambda: F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask).backward(g))
                    ch_i = SDPBackend(torch._fused_sdp_choice(q, k, v, mask, 0.0, False)).name
                    ch_t = SDPBackend(torch._fused_sdp_choice(qg, kg, vg, mask, 0.0, False)).name
                    print("LAYOUT", "permuted" if permuted else "contig", "masked" if masked else "unmasked",
                          backend.name if backend else "default(%s/%s)" % (ch_i, ch_t),
                          "infer %.3f train_fwd %.3f bwd %.3f ms" % (inf, tf, fb - tf))
                except Exception as e:
                    print("LAYOUT", permuted, masked, backend, "error", str(e).splitlines()[0][:60])
