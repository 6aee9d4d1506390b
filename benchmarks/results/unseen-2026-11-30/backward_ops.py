"""FLUX.1-dev (one double and one single block, the profile's shapes): the measured backward and
its recompute by aten op (the step's kernels less the forward's, flux-lora-ops-2026-11-30's
profile) beside the synthesized backward's census op by op, priced; attention's backward and the
recompute's attention (noted, not dispatched) are left out of the synthesized column.

    python benchmarks/results/unseen-2026-11-30/backward_ops.py \
        benchmarks/results/train-stall-2026-11-30/call2/flux_blocks.json
"""
import collections, json, sys
from hydra import compose, initialize_config_module
import torch
from engine.config import register
from engine.kernel_time import ExecutionTimePredictor
from engine.modules.adapters import add_lora, enable_checkpointing
from engine.modules import census as C
from engine.modules.synthesize import meta_forward, on_meta

OV = ["model=flux_diffusers", "workload=train_lora", "workload.video_tokens=4096", "workload.text_tokens=256",
      "workload.checkpointing=true", "+model.module.num_layers=2", "+model.module.num_single_layers=2", "hardware=h200"]
LEFT_OUT = ("transformer_blocks.0", "single_transformer_blocks.0")
d = json.load(open(sys.argv[1]))
def by_op(rows):
    out = collections.Counter()
    for r in rows:
        if "::" in r["op"] and not r["op"].startswith("void"):
            out[r["op"].replace("aten::", "")] += r["self_us"]
    return out
f, s = by_op(d["forward"]["ops"]), by_op(d["step"]["ops"])
meas = {k: s[k] - f[k] for k in s}  # the backward and its recompute
register()
with initialize_config_module(config_module="conf", version_base="1.3"):
    cfg = compose(config_name="config", overrides=OV)
p = ExecutionTimePredictor(cfg.hardware)
module, inputs = on_meta(cfg.model, cfg.workload)
add_lora(module, cfg.workload.lora_rank, list(cfg.model.lora_targets), device=torch.device("meta"))
enable_checkpointing(module)
# Log each backward op with its kernel position.
log = []
orig = C.OpCensus.__torch_dispatch__
def spy(self, func, types, args=(), kwargs=None):
    before = (self.current.ops, dict(self.current.passes), len(self.current.cores))
    out = orig(self, func, types, args, kwargs)
    if self in C._BACKWARDS and self.current.ops > before[0]:
        k = self.current
        if len(k.cores) > before[2]:
            ns = p.core_ns(*k.cores[-1]); kind = "mm"
        else:
            diff = {kk: v - before[1].get(kk, 0) for kk, v in k.passes.items() if v != before[1].get(kk, 0)}
            ns = p.passes_ns(tuple(diff.items())); kind = str(diff)
        log.append((self._current, str(func._overloadpacket).replace("aten.", ""), ns, kind))
    return out
C.OpCensus.__torch_dispatch__ = spy
seen = meta_forward(module, inputs, "block", None, training=True)
names = seen.order.kernels
syn = collections.Counter()
for pos, op, ns, kind in log:
    if names[pos].startswith(LEFT_OUT) or pos < 0: continue
    syn[op] += ns / 1e3
gaps = sum(b.ops for i, b in enumerate(seen.backward) if not names[i].startswith(LEFT_OUT)) * p.module_cost.ns_per_op / 1e3
print(f"synth gaps {gaps:.1f} us (ns_per_op {p.module_cost.ns_per_op})")
keys = sorted(set(meas) | set(syn), key=lambda k: -max(abs(meas.get(k, 0)), syn.get(k, 0)))
print(f"{'op':40s} {'meas us':>9s} {'syn us':>9s}")
for k in keys[:40]:
    print(f"{k:40s} {meas.get(k,0):9.1f} {syn.get(k,0):9.1f}")
print("total", sum(meas.values()), sum(syn.values()) + gaps)
