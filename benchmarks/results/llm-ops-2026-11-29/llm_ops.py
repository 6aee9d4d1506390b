"""Mistral-7B on one GPU, prefill (4096 tokens) and decode (a 4096-token KV cache): where torch's
peak goes in an offloaded all-resident prefill step against the peak its recording measured, and
each aten op's device time in a plain step (torch.profiler, shapes recorded), to set beside the
census's prices on the CPU (ops_report.py).

    python benchmarks/results/llm-ops-2026-11-29/llm_ops.py OUT_DIR

Writes OUT_DIR/memory.json (bytes at each point), OUT_DIR/prefill-snapshot.pickle (torch's
memory history over one offloaded step), OUT_DIR/ops-{prefill,decode}.json (per aten op and
input shapes: calls and self device time over PROFILED steps, after warm-up)."""
import gc
import json
import pickle
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
from omegaconf import OmegaConf
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
import engine  # noqa: E402
from engine.modules.build import build_module, example_inputs  # noqa: E402
from engine.modules.checkpoint import load_resident, module_weights  # noqa: E402
from engine.weightfile import materialize  # noqa: E402

PROFILED = 3
out_dir = Path(sys.argv[1])
cfg = OmegaConf.load(ROOT / "conf" / "model" / "mistral7b_hf.yaml")
shapes = {"prefill": dict(kind="infer", batch=1, video_tokens=0, audio_tokens=0, text_tokens=4096, context_tokens=0),
          "decode": dict(kind="decode", batch=1, video_tokens=0, audio_tokens=0, text_tokens=0, context_tokens=4096)}
dev = torch.device("cuda")
path = Path("/dev/shm/llm_ops.safetensors")
module = build_module(cfg)
table = module_weights(module, cfg.name)
materialize(table, path, seed=0, device="cuda", order=list(table.weights))
memory: dict = {}


def mb(n: int) -> float:
    return round(n / 1e6, 1)


def sizes(out) -> dict:
    """MB of the output's logits and of its KV cache."""
    logits = out.logits
    cache = getattr(out, "past_key_values", None)
    kv = 0
    if cache is not None:
        for layer in getattr(cache, "layers", []):
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                kv += t.numel() * t.element_size() if t is not None else 0
    return {"logits_mb": mb(logits.numel() * logits.element_size()), "logits_dtype": str(logits.dtype),
            "kv_cache_mb": mb(kv)}


# 1. The prefill's recording, then the same step offloaded all resident (bound), with its memory history.
inputs = example_inputs(cfg, module, SimpleNamespace(**shapes["prefill"]), dev)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    trace = engine.record(module, inputs, checkpoint=path, name=cfg.name, workload=shapes["prefill"])
memory["recording"] = {k: trace.header.get(k) for k in ("activation_peak_bytes", "traced_peak_bytes", "context_bytes")}
gc.collect()
torch.cuda.empty_cache()
memory["allocated_before_offload"] = torch.cuda.memory_allocated()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    h = engine.offload(module, budget_mb=None, example_inputs=inputs, eviction="priority", lookahead=2, checkpoint=path)
with torch.no_grad():
    for _ in range(2):
        o = module(**inputs)
    del o
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=400000)
    o = module(**inputs)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated()
    memory["offloaded_bound"] = {"bound": h.bound, "allocated_before_step": base, "peak": peak,
                                 "after_step_output_alive": torch.cuda.memory_allocated(), **sizes(o)}
    del o
    torch.cuda.synchronize()
    memory["offloaded_bound"]["after_output_freed"] = torch.cuda.memory_allocated()
(out_dir / "prefill-snapshot.pickle").write_bytes(pickle.dumps(snap))
h.remove()
gc.collect()
torch.cuda.empty_cache()

# 2. The plain module: its prefill peak, then each op's device time in prefill and decode.
plain = load_resident(build_module(cfg), path, dev)
path.unlink()
ops: dict = {}
with torch.no_grad():
    for kind in ("prefill", "decode"):
        inputs = example_inputs(cfg, plain, SimpleNamespace(**shapes[kind]), dev)
        for _ in range(3):
            o = plain(**inputs)
        del o
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        steps = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            o = plain(**inputs)
            b.record()
            b.synchronize()
            steps.append(a.elapsed_time(b))
            del o
        memory[f"plain_{kind}"] = {"allocated_before_step": base, "peak": torch.cuda.max_memory_allocated(),
                                   "steps_ms": [round(s, 3) for s in steps]}
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            for _ in range(PROFILED):
                o = plain(**inputs)
                del o
            torch.cuda.synchronize()
        rows = [{"op": e.key, "shapes": [list(map(int, s)) if isinstance(s, (list, tuple)) else s
                                          for s in e.input_shapes] if e.input_shapes else [],
                 "calls": e.count, "self_device_us": e.self_device_time_total}
                for e in prof.key_averages(group_by_input_shape=True) if e.self_device_time_total > 0]
        kernels = [{"kernel": e.key, "calls": e.count, "device_us": e.device_time_total}
                   for e in prof.key_averages() if e.device_time_total > 0 and not e.key.startswith("aten::")]
        ops[kind] = {"profiled_steps": PROFILED, "steps_ms": steps, "ops": rows, "kernels": kernels}
        (out_dir / f"ops-{kind}.json").write_text(json.dumps(ops[kind], default=str) + "\n")
        print(f"{kind}: plain steps {[round(s, 2) for s in steps]} ms; peak {mb(memory[f'plain_{kind}']['peak'])} MB "
              f"from {mb(base)}", flush=True)
(out_dir / "memory.json").write_text(json.dumps(memory, indent=1) + "\n")
print(json.dumps(memory, indent=1))
