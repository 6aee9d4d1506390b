# Synthesized LoRA-step predictions (no recording), each against its measured step.
run() { # tag measured overrides...
  tag=$1; meas=$2; shift 2
  out=/tmp/tp_$tag
  python -m engine "$@" workload=train_lora workload.lora_rank=32 workload.checkpointing=true workload.steps=4 activations=off sim.timeline=false hydra.run.dir=$out > /dev/null 2>&1 || echo "FAILED $tag"
  python -c "
import json; p=json.load(open('$out/report.json'))['prediction']
print('%-8s pred %8.1f meas %8.1f err %+6.1f%%  compute %7.1f host %7.1f bound %s' % ('$tag', p['step_ms'], $meas, 100*(p['step_ms']/$meas-1), p.get('compute_ms', 0), p.get('host_ms', 0), p.get('bound_by')))"
}
run ltx16 2246.0 model=ltx2_diffusers workload.video_tokens=6144 budget=16000 weights.eviction=priority weights.lookahead=2
run ltx24 2331.2 model=ltx2_diffusers workload.video_tokens=6144 budget=24000 weights.eviction=belady weights.lookahead=2
run flux16 836.6 model=flux_diffusers workload.video_tokens=4096 budget=16000 weights.eviction=priority weights.lookahead=2
run wan16 1736.0 model=wan14b_diffusers workload.video_tokens=6144 workload.text_tokens=512 budget=16000 weights.eviction=priority weights.lookahead=2
run llama8 378.4 model=llama8b_hf workload.text_tokens=2048 budget=8000 weights.eviction=priority weights.lookahead=2
run hv16 1324.4 model=hunyuan_video_diffusers workload.video_tokens=4096 budget=16000 weights.eviction=priority weights.lookahead=2
run qwen16 1383.2 model=qwen_image_diffusers workload.video_tokens=4096 budget=16000 weights.eviction=priority weights.lookahead=2
