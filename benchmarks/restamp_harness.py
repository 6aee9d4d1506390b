"""Take what real_models.py itself held on the device out of its older recordings' torch peak.

    python benchmarks/restamp_harness.py data/traces/h200/modules/*.trace.jsonl.gz

Runs of benchmarks/real_models.py written before it said "harness_device_bytes" kept the copy
stream's buffer and the reference outputs on the device while they recorded, so each inference
recording's measured torch peak (header "activation_peak_bytes") counts them, and so did the
workspace mode=calibrate --modules fits from it. This subtracts them
(real_models.legacy_harness_bytes; the reference outputs counted once, or as many as a
real_models.json beside the trace lists for its model and workload) and writes what it took into
the header as "harness_device_bytes", so it is done once. Each file is rewritten in place.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from real_models import legacy_harness_bytes  # noqa: E402
from real_models_report import model_config  # noqa: E402

from engine.trace import read_trace, write_trace  # noqa: E402


def outcomes(path: Path, model: str, workload: dict) -> int:
    """The reference outputs the run kept: from a real_models.json beside `path`, else 1."""
    runs = path.parent / "real_models.json"
    if runs.is_file():
        for result in json.loads(runs.read_text())["results"]:
            if result["model"] == model and result.get("workload") == workload:
                return int(result.get("resident_outcomes", 1))
    return 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+", type=Path, help="inference recordings real_models.py wrote")
    for path in ap.parse_args().traces:
        trace = read_trace(path)
        h = trace.header
        kind = (h.get("workload") or {}).get("kind")
        if kind == "train_lora" or "activation_peak_bytes" not in h or "harness_device_bytes" in h:
            print(f"{path}: left as it is ({'a training step' if kind == 'train_lora' else 'nothing to take out'})")
            continue
        cfg = model_config(h["model"], h.get("model_set"))
        held = legacy_harness_bytes(cfg, h["workload"], outcomes(path, h["model"], h["workload"]))[0]
        header = {**h, "activation_peak_bytes": max(0, h["activation_peak_bytes"] - held), "harness_device_bytes": held}
        write_trace(path, dataclasses.replace(trace, header=header))
        print(f"{path}: activation peak {h['activation_peak_bytes'] / 1e6:.0f} -> {header['activation_peak_bytes'] / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
