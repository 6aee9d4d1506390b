"""Write each real-module recording's op census into its records (cores, passes, ops, dispatches),
and its meta forward's traced peak into its header (traced_peak_bytes).

    python benchmarks/restamp_census.py data/traces/modules/ltx2.trace.jsonl.gz=ltx2_diffusers ... --out OUT

Recordings made before the recorder counted ops (engine/modules/census.py) and traced its order
forward's live bytes carry neither, and mode=calibrate --modules fits from them what a
module's blocks cost beside their cores and the workspace torch holds beside its tensors. Each
TRACE=MODEL pair names the model config (conf/model/MODEL.yaml) the trace recorded: the module
is built on the meta device and run once on the trace's workload (engine/modules/synthesize.py
meta_forward); its kernels must be the trace's, in its order. Nothing else in the trace changes.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.modules.synthesize import meta_forward, on_meta  # noqa: E402
from engine.trace import read_trace, write_trace  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pairs", nargs="+", help="TRACE=MODEL: a recording and its model config's name")
    ap.add_argument("--out", required=True, type=Path, help="directory for the restamped traces")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for pair in args.pairs:
        path, _, model = pair.partition("=")
        trace = read_trace(path)
        cfg = OmegaConf.merge(OmegaConf.load(ROOT / "conf" / "model" / f"{model}.yaml"),
                              OmegaConf.from_dotlist(trace.header.get("model_set", [])))  # real_models.py --model-set
        module, inputs = on_meta(cfg, SimpleNamespace(**trace.header["workload"]))
        blocks = cfg.get("blocks")
        seen = meta_forward(module, inputs, trace.header.get("grouping", "block"), blocks and list(blocks))
        names = [r.name for r in trace.records if r.phase == "fwd"]
        if list(seen.order.kernels) != names:
            raise SystemExit(f"{path}: the meta forward of {model} runs other kernels than the recording; "
                             "is it the model config it recorded?")
        records = [dataclasses.replace(r, cores=tuple(c.cores), passes=c.pass_list(), ops=c.ops,
                                       dispatches=c.dispatches)
                   for r, c in zip(trace.records, seen.recording.census)] + list(trace.records[len(names):])
        out = args.out / Path(path).name
        header = {**trace.header, "traced_peak_bytes": seen.traced_peak_bytes}
        write_trace(out, dataclasses.replace(trace, header=header, records=tuple(records)))
        print(f"{out}: {len(names)} records, {sum(c.ops for c in seen.recording.census)} ops")


if __name__ == "__main__":
    main()
