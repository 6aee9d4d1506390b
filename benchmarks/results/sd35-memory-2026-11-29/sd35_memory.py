"""SD3.5 Large's device memory in one plain forward against what the meta trace holds:
the live allocations at the forward's peak (torch's memory history, Python frames), for
each SDPA backend choice, at 1024 and 4096 image tokens."""
import sys
from collections import defaultdict

import torch
from omegaconf import OmegaConf
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.modules.build import build_module, example_inputs
from engine.modules.synthesize import meta_forward, on_meta

CFG = OmegaConf.load("conf/model/sd35_large_diffusers.yaml")
DEV = torch.device("cuda")


def workload(tokens: int):
    return OmegaConf.create(dict(kind="infer", batch=1, video_tokens=tokens, audio_tokens=0, text_tokens=333,
                                 context_tokens=0))


def on_device():
    m = build_module(CFG)
    for mod in m.modules():
        for n, p in mod._parameters.items():
            if p is not None:
                mod._parameters[n] = torch.nn.Parameter(torch.randn(p.shape, dtype=p.dtype, device=DEV) * 0.02,
                                                        requires_grad=False)
        for n, b in mod._buffers.items():
            if b is not None:
                mod._buffers[n] = b.to(DEV)
    return m


def where(frames):
    keep = [f for f in frames if "diffusers" in f["filename"] or "functional" in f["filename"]]
    f = (keep or frames or [{"filename": "?", "line": 0, "name": "?"}])[0]
    return f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}"


def live_at_peak(snap):
    live, total, peak, at_peak = {}, 0, 0, {}
    for e in snap["device_traces"][0]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], where(e.get("frames", [])))
            total += e["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif e["action"] in ("free_completed",) and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
    by = defaultdict(lambda: [0, 0])
    for size, w in at_peak.values():
        by[w][0] += size
        by[w][1] += 1
    return peak, sorted(by.items(), key=lambda kv: -kv[1][0])


def main():
    m = on_device()
    weights = torch.cuda.memory_allocated()
    bufs = sum(b.numel() * b.element_size() for b in m.buffers())
    print(f"weights+buffers {weights / 1e6:.1f} MB (buffers {bufs / 1e6:.1f} MB)")
    for tokens in (1024, 4096):
        wl = workload(tokens)
        meta_m, meta_in = on_meta(CFG, wl)
        seen = meta_forward(meta_m, meta_in)
        inputs = example_inputs(CFG, m, wl, DEV)
        for label, backends in (("default", None), ("flash", [SDPBackend.FLASH_ATTENTION]),
                                ("efficient", [SDPBackend.EFFICIENT_ATTENTION]),
                                ("cudnn", [SDPBackend.CUDNN_ATTENTION])):
            for conv_cudnn in (True, False):
                torch.backends.cudnn.enabled = conv_cudnn
                ctx = sdpa_kernel(backends) if backends else torch.autocast("cuda", enabled=False)
                try:
                    with torch.no_grad(), ctx:
                        m(**inputs)
                        torch.cuda.synchronize()
                        base = torch.cuda.memory_allocated()
                        torch.cuda.reset_peak_memory_stats()
                        torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
                        out = m(**inputs)
                        torch.cuda.synchronize()
                        snap = torch.cuda.memory._snapshot()
                        torch.cuda.memory._record_memory_history(enabled=None)
                        peak = torch.cuda.max_memory_allocated() - base
                        del out
                except RuntimeError as e:
                    print(f"{tokens} {label} conv_cudnn={conv_cudnn}: {str(e).splitlines()[0][:100]}")
                    continue
                hist_peak, top = live_at_peak(snap)
                print(f"\n{tokens} tokens, sdpa {label}, cudnn {'on' if conv_cudnn else 'off'}: forward peak over "
                      f"weights+inputs {peak / 1e6:.1f} MB (history {hist_peak / 1e6:.1f}); meta live peak "
                      f"{seen.recording.live_peak / 1e6:.1f} MB, inputs {seen.input_bytes / 1e6:.1f} MB, "
                      f"resident {seen.resident_bytes / 1e6:.1f}")
                for w, (size, n) in top[:8]:
                    print(f"   {size / 1e6:9.1f} MB  x{n:<3d} {w}")
        torch.backends.cudnn.enabled = True
        del inputs


if __name__ == "__main__":
    sys.exit(main())
