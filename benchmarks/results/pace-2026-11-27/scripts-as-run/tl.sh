set -e
W=/dev/shm/tl.ptd
run() { python -m engine "$@" sim.timeline=true workload.steps=5 > /dev/null 2>$OUT/err.txt || { tail -5 $OUT/err.txt; }; }
trap 'rm -f $W' EXIT
date; python -m engine model=ltx mode=materialize out=$W hydra.run.dir=/tmp/m1 > /dev/null; date
run model=ltx mode=execute weights.file=$W budget=12000 weights.eviction=belady weights.lookahead=4 hydra.run.dir=$OUT/r/ltx-12000-belady
run model=ltx mode=execute weights.file=$W budget=12000 weights.eviction=priority weights.lookahead=1 hydra.run.dir=$OUT/r/ltx-12000-priority
rm -f $W; date
python -m engine model=wan14b mode=materialize out=$W hydra.run.dir=/tmp/m2 > /dev/null; date
run model=wan14b mode=execute weights.file=$W budget=null hydra.run.dir=$OUT/r/wan-null
run model=wan14b mode=execute weights.file=$W budget=24000 weights.eviction=priority weights.lookahead=1 hydra.run.dir=$OUT/r/wan-24000-priority
rm -f $W; date
cd $OUT && tar czf runs.tgz r && rm -rf r
python - <<'PY'
import json, tarfile, os
t = tarfile.open(os.environ['OUT'] + '/runs.tgz')
for m in t.getmembers():
    if m.name.endswith('report.json'):
        r = json.load(t.extractfile(m)); me = r['measurement']
        print(m.name, round(me['step_ms'], 2), round(r['prediction']['step_ms'], 2), me.get('outputs_match_reference'))
PY
