# As run on the lent H100s (OUT: the device tool's output folder), from the repository root.
# Llama-3.1-8B LoRA recorded again (census now tears CUPTI down), executed at 8000 against it.
M="model=llama8b_hf"
W="workload=train_lora workload.text_tokens=2048 workload.lora_rank=32 workload.checkpointing=true workload.steps=4"
P="weights.eviction=priority weights.lookahead=2 activations=off"
CK=/dev/shm/llama-train.safetensors
T0=$(date +%s)
python -m engine $M mode=materialize out=$CK hydra.run.dir=/tmp/mat > /dev/null 2>&1
python -m engine $M $W mode=record weights.file=$CK hydra.run.dir=/tmp/rec 2>&1 | grep -v "Warn\|warn" | tail -1
cp /tmp/rec/trace.jsonl $OUT/llama8b-hf-train.jsonl && gzip $OUT/llama8b-hf-train.jsonl
echo "recorded $(( $(date +%s) - T0 )) s"
for i in 1 2; do
python -m engine $M $W $P mode=execute trace=/tmp/rec/trace.jsonl weights.file=$CK budget=8000 hydra.run.dir=/tmp/x 2>&1 | grep -v "Warn\|warn" | tail -1 > /dev/null
python -c "
import json, gzip; r=json.load(open('/tmp/x/report.json')); p, m = r['prediction'], r['measurement']
h=json.loads(open('/tmp/rec/trace.jsonl').readline())
print('pipelined %.1f host_scale %s pred %.1f meas %.1f resident %.1f loss %s grads %s' % (h['pipelined_step_ns']/1e6, h.get('host_scale'), p['step_ms'], m['step_ms'], m['resident_step_ms'], r.get('loss_match_reference'), r.get('grads_match_reference')))" | tee -a $OUT/llama-rec2.txt
cp /tmp/x/report.json $OUT/llama-8000-rec2-execute-$i.json
echo "executed $(( $(date +%s) - T0 )) s"
done
rm -f $CK /dev/shm/*
