import torch, collections, time
from omegaconf import OmegaConf
from engine.modules.build import build_module, example_inputs
dev = torch.device('cuda')
cfg = OmegaConf.load('conf/model/hunyuan_video_diffusers.yaml')
m = build_module(cfg)
m = m.to_empty(device=dev)
with torch.no_grad():
    for p in m.parameters():
        p.normal_(0, 0.02)
    for n, b in m.named_buffers():
        pass
wl = OmegaConf.create(dict(kind='infer', batch=1, video_tokens=6144, audio_tokens=0, text_tokens=256, context_tokens=0))
inp = example_inputs(cfg, m, wl, dev)
with torch.no_grad():
    for _ in range(3):
        m(**inp)
    torch.cuda.synchronize()
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        m(**inp)
        torch.cuda.synchronize()
cls = collections.defaultdict(float); cnt = collections.Counter()
for e in prof.events():
    if e.device_type.name == 'CUDA':
        n = e.name.lower()
        k = ('attention' if ('fmha' in n or 'flash' in n or 'attention' in n or 'efficient' in n) else
             'gemm' if ('gemm' in n or 'cutlass' in n or 'sm90' in n or 'nvjet' in n or 'xmma' in n) else
             'memcpy' if 'memcpy' in n or 'memset' in n else 'elementwise/other')
        cls[k] += e.device_time if hasattr(e, 'device_time') else e.cuda_time
        cnt[k] += 1
tot = sum(cls.values())
for k, v in sorted(cls.items(), key=lambda kv: -kv[1]):
    print(f'{k:20s} {v/1e3:9.1f} ms  {cnt[k]:6d} kernels')
print('total', tot/1e3, 'ms')
top = collections.defaultdict(float); tc = collections.Counter()
for e in prof.events():
    if e.device_type.name == 'CUDA':
        top[e.name[:90]] += e.device_time if hasattr(e, 'device_time') else e.cuda_time; tc[e.name[:90]] += 1
for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:25]:
    print(f'{v/1e3:8.2f} ms {tc[k]:5d}  {k}')
