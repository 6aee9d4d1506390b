import torch, time, cProfile, pstats, io
import engine
from omegaconf import OmegaConf
from engine.modules.build import example_inputs
from diffusers import LTX2VideoTransformer3DModel
torch.manual_seed(0)
dev = torch.device('cuda')
def build():
    torch.manual_seed(0)
    return LTX2VideoTransformer3DModel(num_layers=6).to(torch.bfloat16).eval()
wl = OmegaConf.create(dict(kind='infer', batch=1, video_tokens=1536, audio_tokens=128, text_tokens=256, context_tokens=0))
cfg = OmegaConf.load('conf/model/ltx2_diffusers.yaml')
m = build()
inputs = example_inputs(cfg, m, wl, dev)
def timed(fn, n=20):
    with torch.no_grad():
        for _ in range(3): fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n): fn()
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3
plain = m.to(dev)
print('plain module  %.2f ms/step' % timed(lambda: plain(**inputs)))
del plain; torch.cuda.empty_cache()
m2 = build()
h = engine.offload(m2, budget_mb=None, example_inputs=inputs, eviction='priority', lookahead=2)
print('offload bound %.2f ms/step' % timed(lambda: m2(**inputs)))
pr = cProfile.Profile()
with torch.no_grad():
    pr.enable()
    for _ in range(5): m2(**inputs)
    torch.cuda.synchronize()
    pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats('tottime').print_stats(18); print(s.getvalue()[:6000])
h.remove()
m3 = build().to(dev)
pr = cProfile.Profile()
with torch.no_grad():
    pr.enable()
    for _ in range(5): m3(**inputs)
    torch.cuda.synchronize()
    pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats('tottime').print_stats(12); print('PLAIN', s.getvalue()[:4000])
