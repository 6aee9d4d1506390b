"""A real module's synthesized step beside its recording, block kind by block kind (a CPU).

For each recording (mode=record, engine.record, mode=execute's), the same model and workload
synthesized from its config (engine/modules/synthesize.py) with --hardware: per kind of record
(the blocks' index folded: `transformer_blocks.N`) and phase, the summed compute and host time,
synthesized and recorded, and their ratio; last, over the repeated blocks' backward records of
every recording (the kinds of 2 or more records that hold 1% of its step or more), the mean and
largest |ratio - 1|. The model config is the one in conf/model whose
`name` is the recording header's `model`; the workload is the header's.

    python benchmarks/synth_vs_recorded.py data/traces/h200/modules/*-train*.jsonl.gz --hardware h200
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from engine.config import register  # noqa: E402
from engine.modules.synthesize import synthesize_module  # noqa: E402
from engine.trace import read_trace  # noqa: E402

FIELDS = ("video_tokens", "audio_tokens", "text_tokens", "context_tokens", "batch", "lora_rank", "checkpointing",
          "cudnn_attention")


def configs_by_name() -> dict[str, str]:
    """Each model config's `name` -> its file's stem (conf/model)."""
    return {str(OmegaConf.load(p).get("name")): p.stem for p in sorted((ROOT / "conf" / "model").glob("*.yaml"))}


def kind(name: str) -> str:
    return re.sub(r"\.\d+", ".N", name)


def compare(path: str, hardware: str, names: dict[str, str]) -> list[tuple[str, str, float, float]]:
    """(record kind, phase, synthesized ms, recorded ms) of one recording, printed as a table."""
    rec = read_trace(path)
    model = names.get(str(rec.header.get("model")))
    if model is None:
        raise SystemExit(f"{path}: no conf/model config is named {rec.header.get('model')!r}")
    wl = rec.header.get("workload") or {}
    overrides = [f"model={model}", f"hardware={hardware}", f"workload={wl.get('kind', 'infer')}"]
    overrides += [f"workload.{k}={str(wl[k]).lower() if isinstance(wl[k], bool) else wl[k]}" for k in FIELDS if k in wl]
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    syn = synthesize_module(cfg.model, cfg.workload, cfg.hardware)
    if [r.name for r in syn.records] != [r.name for r in rec.records]:
        raise SystemExit(f"{path}: the synthesized step's records are not the recording's (another grouping?)")
    sums: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0.0, 0])
    for s, r in zip(syn.records, rec.records):
        a = sums[(kind(s.name), s.phase)]
        a[0] += s.compute_ns / 1e6
        a[1] += r.compute_ns / 1e6
        a[2] += s.host_ns / 1e6
        a[3] += r.host_ns / 1e6
        a[4] += 1
    print(f"\n{path} ({model}, {' '.join(overrides[2:])})")
    print("| record | phase | n | synthesized ms | recorded ms | ratio | host synthesized | host recorded |")
    print("|---|---|---|---|---|---|---|---|")
    step = sum(v[1] for v in sums.values())
    shown = []
    for (k, phase), (sc, rc, sh, rh, n) in sorted(sums.items(), key=lambda x: -x[1][1]):
        if rc >= 0.01 * step:  # the kinds that make the step
            print(f"| {k} | {phase} | {n} | {sc:.2f} | {rc:.2f} | {sc / rc:.3f} | {sh:.2f} | {rh:.2f} |")
            if n > 1:
                shown.append((k, phase, sc, rc))
    return shown


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recordings", nargs="+")
    ap.add_argument("--hardware", default="h200")
    args = ap.parse_args()
    register()
    names = configs_by_name()
    backward = [s / r - 1 for path in args.recordings for _, phase, s, r in compare(path, args.hardware, names)
                if phase == "bwd" and r > 0]
    if backward:
        print(f"\nrepeated blocks' backward, {len(backward)} kinds: mean |ratio - 1| "
              f"{100 * sum(map(abs, backward)) / len(backward):.1f}%, max {100 * max(map(abs, backward)):.1f}%")


if __name__ == "__main__":
    main()
