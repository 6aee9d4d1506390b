"""Give recorded spec traces the memory passes their spec declares now.

    python benchmarks/restamp_passes.py data/traces/full/*.jsonl.gz

A spec kernel's passes (`Kernel.passes`: kind and bytes of each norm, modulation,
residual add, copy) are the builder's declaration (engine/models/builder.py), not
a measurement. When that declaration changes, the shipped recordings take the new
one, every measured field untouched, and the kernel table is refitted over them.
Each trace's spec is built from its header: the model by its name among
conf/model/*.yaml, its num_layers, its workload. A trace whose forward kernels are
not its spec's kernels, in order, is refused.
"""
from __future__ import annotations

import sys
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.models import available_models, build_spec, load_model_config  # noqa: E402
from engine.trace import Trace, read_trace, write_trace  # noqa: E402


def restamped(trace: Trace) -> Trace:
    """`trace` with each forward record's passes its spec kernel's."""
    by_name = {load_model_config(stem).name: stem for stem in available_models()}
    h = trace.header
    if h.get("model") not in by_name:
        raise SystemExit(f"model {h.get('model')!r} is not a spec model's name ({', '.join(sorted(by_name))})")
    cfg = asdict(load_model_config(by_name[h["model"]]))
    spec = build_spec({**cfg, "num_layers": h["num_layers"]}, SimpleNamespace(**h["workload"]))
    forward = [r for r in trace.records if r.phase == "fwd"]
    if [r.name for r in forward] != [k.name for k in spec.kernels]:
        raise SystemExit(f"{h['model']}: the trace's forward kernels are not its spec's; record it again")
    passes = {k.name: tuple(k.passes) for k in spec.kernels}
    records = tuple(replace(r, passes=passes[r.name]) if r.phase == "fwd" else r for r in trace.records)
    return Trace(h, trace.weight_sizes, records)


def main() -> None:
    for path in map(Path, sys.argv[1:]):
        trace = read_trace(path)
        new = restamped(trace)
        changed = sum(a.passes != b.passes for a, b in zip(trace.records, new.records))
        write_trace(path, new)
        print(f"{path}: {changed} of {len(new.records)} records' passes changed")


if __name__ == "__main__":
    main()
