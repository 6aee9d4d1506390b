import sys
from hydra import compose, initialize_config_module
from engine.config import register
register()
from engine.modules.synthesize import synthesize_module
from engine.trace import read_trace
T = "workload=train_lora workload.lora_rank=32 workload.checkpointing=true"
cases = [
 ("data/traces/modules/ltx2-diffusers-train-full.jsonl.gz", "model=ltx2_diffusers workload.video_tokens=6144"),
 ("data/traces/modules/flux-diffusers-train.jsonl.gz", "model=flux_diffusers workload.video_tokens=4096"),
 ("data/traces/modules/wan14b-diffusers-train.jsonl.gz", "model=wan14b_diffusers workload.video_tokens=6144 workload.text_tokens=512"),
 ("data/traces/modules/llama8b-hf-train.jsonl.gz", "model=llama8b_hf workload.text_tokens=2048"),
 ("benchmarks/results/heldout-train-2026-11-28/hv-train.jsonl.gz", "model=hunyuan_video_diffusers workload.video_tokens=4096"),
 ("benchmarks/results/heldout-train-2026-11-28/qwen-train.jsonl.gz", "model=qwen_image_diffusers workload.video_tokens=4096"),
]
for f, ov in cases:
    rec = read_trace(f)
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose("config", overrides=(T + " " + ov).split())
    syn = synthesize_module(cfg.model, cfg.workload, cfg.hardware)
    rr = {r.name: r for r in rec.records}
    out = [f.split("/")[-1][:22]]
    for ph in ("fwd", "bwd"):
        rs = [r for r in syn.records if r.phase == ph]
        hs = sum(r.host_ns for r in rs) / 1e6; hr = sum(rr[r.name].host_ns for r in rs) / 1e6
        cs = sum(r.compute_ns for r in rs) / 1e6; cr = sum(rr[r.name].compute_ns for r in rs) / 1e6
        la = sum(r.launches for r in rs)
        out.append(f"{ph}: host {hs:7.1f}/{hr:7.1f} x{hr/hs:.2f} compute {cs:7.1f}/{cr:7.1f} x{cr/cs:.2f} launches {la}")
    print(" | ".join(out), "| pipelined", (rec.header.get("pipelined_step_ns") or 0) / 1e6)
