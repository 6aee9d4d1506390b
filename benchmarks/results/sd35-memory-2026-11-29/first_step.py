"""SD3.5 at 12000 on the device: the executor's per-step pool peak against the policy's own, on its order and on a recording's."""
import sys, warnings, torch
warnings.filterwarnings("ignore")
from types import SimpleNamespace
from omegaconf import OmegaConf
import engine
from engine.modules.build import build_module, example_inputs
from engine.policy.weights import WeightResidency
from engine.trace import read_trace
cfg = OmegaConf.load("conf/model/sd35_large_diffusers.yaml")
m = build_module(cfg)
wl = SimpleNamespace(kind="infer", batch=1, video_tokens=4096, audio_tokens=0, text_tokens=333, context_tokens=0)
inputs = example_inputs(cfg, m, wl, torch.device("cuda"))
h = engine.offload(m, budget_mb=12000, example_inputs=inputs, checkpoint=sys.argv[1], eviction="priority", lookahead=2)
order = h.executor.order
tr = read_trace(sys.argv[2]).access_order()
print("orders equal:", order.kernels == tr.kernels, order.reads == tr.reads, order.sizes == tr.sizes,
      sum(order.sizes.values()), sum(tr.sizes.values()), "resident params", len(h.streamed.resident_params),
      h.streamed.resident_bytes, "placement resident", h.executor.placement.resident_bytes)
for o, name in ((order, "executor order"), (tr, "trace order")):
    pol = WeightResidency(o, 12_000_000_000, "priority", 2)
    per = []
    for s in range(3):
        mm = 0
        for i in range(len(o)):
            pol.issue(i); mm = max(mm, pol.resident_bytes)
        per.append(mm)
    print(name, "policy", per)
with torch.no_grad():
    for _ in range(3):
        m(**inputs)
print("executor", [r["peak_device_bytes"] for r in h.telemetry()], [r["held_device_bytes"] for r in h.telemetry()])
h.remove()
