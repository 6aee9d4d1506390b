"""Leave-one-out over a tiles probe: each probed attention point priced from the others (and the
recordings' probe grids), with plain FLOP rates and with the tiled table (engine/compute.py,
AttentionTiling); time-weighted mean |error| by op and by kind of shape. Runs on any CPU.

    python benchmarks/attention_tiles_fit.py data/traces/h200/probes-h200-2026-11-28-tiles-c.json \
        --traces data/traces/h200
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.calibrate import trace_paths  # noqa: E402
from engine.calibrate_kernels import attention_tiling, read_probe_file  # noqa: E402
from engine.compute import BACKWARD, BACKWARD_FLOPS_FACTOR, TRAINING, core_flops, features, work  # noqa: E402
from engine.kernel_time import KernelTable, Point  # noqa: E402
from engine.trace import read_trace  # noqa: E402

OPS = {"attention": ("attention", 0), "attention_masked": ("attention_masked", 0),
       "attention_train": ("attention" + TRAINING, 0), "attention_train_bwd": ("attention" + TRAINING + BACKWARD, 1)}


def rows(grid: dict, name: str) -> list[tuple[tuple[int, ...], float, int]]:
    """(shape, ns, backward) of one op's probe rows."""
    source, backward = {"attention_train_bwd": ("attention_train", 1)}.get(name, (name, 0))
    return [(tuple(r[:4]), float(r[5] if backward else r[4]), backward) for r in grid.get(source, ())]


def kind(shape: tuple[int, ...]) -> str:
    _bh, lq, lk, _d = shape
    return ("self" if lq == lk else "cross") + (" long" if min(lq, lk) >= 2048 or (lq != lk and lq >= 4096) else " short")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("probe", type=Path, help="a probe file with the tiled shapes and \"sms\"")
    p.add_argument("--traces", type=Path, help="recordings whose header probe grids the others add to the table")
    args = p.parse_args()
    probe = read_probe_file(args.probe)
    others = [read_trace(q).header.get("probes", {}).get("compute", {}) for q in trace_paths([args.traces])] \
        if args.traces else []
    tiled = attention_tiling([probe])
    print("| op | table | all | " + " | ".join(("self long", "self short", "cross long", "cross short")) + " |")
    print("|---|---|---|---|---|---|---|")
    for name, (key, backward) in OPS.items():
        base = "attention_masked" if name == "attention_masked" else "attention"
        mine = rows(probe, name)
        known = {s for s, _ns, _b in mine}
        rest = [r for g in others for r in rows(g, name) if r[0] not in known]
        for label, tiling in (("plain FLOPs", None), ("tiled", tiled)):
            def point(shape, ns, b):
                amount = work(base, (BACKWARD_FLOPS_FACTOR if b else 1) * core_flops(base, shape), 0, shape, tiling)
                return Point(features(base, shape, 0, tiling=tiling), amount / ns), amount
            fixed = [point(*r)[0] for r in rest]
            errors: dict[str, list[tuple[float, float]]] = {}
            for i, (shape, ns, b) in enumerate(mine):
                table = KernelTable({key: fixed + [point(*r)[0] for j, r in enumerate(mine) if j != i]})
                own, amount = point(shape, ns, b)
                predicted = amount / table.rate(key, own.features)
                errors.setdefault(kind(shape), []).append((predicted / ns - 1, ns))
            every = [e for es in errors.values() for e in es]

            def weighted(es):
                return f"{sum(abs(e) * w for e, w in es) / sum(w for _e, w in es) * 100:.1f}%" if es else "-"
            print(f"| {name} | {label} | {weighted(every)} | "
                  + " | ".join(weighted(errors.get(k, [])) for k in ("self long", "self short", "cross long",
                                                                     "cross short")) + " |")


if __name__ == "__main__":
    main()
