# The predictions in ../synth-train-h100-2026-11-28.md, from the repository root, on a CPU.
run() { # name overrides...
  out=/tmp/pred_$1; shift
  python -m engine "$@" activations=off sim.timeline=false workload.steps=4 hydra.run.dir=$out > /dev/null 2>&1 || echo "FAILED $out"
  python -c "
import json; r=json.load(open('$out/report.json')); p=r['prediction']
print('$out', round(p['step_ms'],1), p['h2d_bytes'], round(p['peak_pool_torch_bytes']/1e9,3))"
}
L="model=ltx2_diffusers workload=train_lora workload.video_tokens=6144 workload.lora_rank=32 workload.checkpointing=true"
F="model=flux_diffusers workload=train_lora workload.video_tokens=4096 workload.lora_rank=32 workload.checkpointing=true"
W="model=wan14b_diffusers workload=train_lora workload.video_tokens=6144 workload.text_tokens=512 workload.lora_rank=32 workload.checkpointing=true"
run ltx16 $L budget=16000 weights.eviction=priority weights.lookahead=2
run ltx24 $L budget=24000 weights.eviction=belady weights.lookahead=2
run flux12 $F budget=12000 weights.eviction=priority weights.lookahead=2
run flux16 $F budget=16000 weights.eviction=priority weights.lookahead=2
run wan16 $W budget=16000 weights.eviction=priority weights.lookahead=2
run ltx16r $L budget=16000 weights.eviction=priority weights.lookahead=2 trace=data/traces/modules/ltx2-diffusers-train-full.jsonl.gz
run flux12r $F budget=12000 weights.eviction=priority weights.lookahead=2 trace=data/traces/modules/flux-diffusers-train.jsonl.gz
run flux16r $F budget=16000 weights.eviction=priority weights.lookahead=2 trace=data/traces/modules/flux-diffusers-train.jsonl.gz
run wan16r $W budget=16000 weights.eviction=priority weights.lookahead=2 trace=data/traces/modules/wan14b-diffusers-train.jsonl.gz
run fluxres $F weights.eviction=priority weights.lookahead=2
run wanres $W weights.eviction=priority weights.lookahead=2
