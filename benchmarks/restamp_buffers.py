"""Take set-up's device copy of the buffers out of older recordings, and count the buffers
in their traced peak.

    python benchmarks/restamp_buffers.py data/traces/h200/modules/*.trace.jsonl.gz

Until set-up kept its copies of a module's buffers on the host (engine/modules/untouched.py),
a recording held every buffer twice on the device, so its measured torch peak (header
"activation_peak_bytes") read one copy too many, and the traced peak (header
"traced_peak_bytes") counted none. For SD3.5 Large (a 179 MB positional table) that read 358 MB
of torch's workspace in `mode=calibrate --modules`' fit. This takes one copy out of the measured
peak, adds one to the traced peak and writes the buffers' bytes into the header as
"buffer_bytes" (as recordings now carry it), so it is done once. The buffers are sized from the
model config's module on the meta device. Each file is rewritten in place.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from real_models_report import model_config  # noqa: E402

from engine.modules.kernels import buffer_bytes  # noqa: E402
from engine.modules.synthesize import on_meta  # noqa: E402
from engine.trace import read_trace, write_trace  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+", type=Path, help="inference recordings of real modules")
    for path in ap.parse_args().traces:
        trace = read_trace(path)
        h = trace.header
        if "buffer_bytes" in h or "traced_peak_bytes" not in h or "activation_peak_bytes" not in h:
            print(f"{path}: left as it is ({'done already' if 'buffer_bytes' in h else 'no inference peaks'})")
            continue
        cfg = model_config(h["model"], h.get("model_set"))
        held = buffer_bytes(on_meta(cfg, SimpleNamespace(**h["workload"]))[0])
        header = {**h, "activation_peak_bytes": max(0, h["activation_peak_bytes"] - held),
                  "traced_peak_bytes": h["traced_peak_bytes"] + held, "buffer_bytes": held}
        write_trace(path, dataclasses.replace(trace, header=header))
        print(f"{path}: buffers {held / 1e6:.1f} MB; over the traced peak "
              f"{(h['activation_peak_bytes'] - h['traced_peak_bytes']) / 1e6:.1f} -> "
              f"{(header['activation_peak_bytes'] - header['traced_peak_bytes']) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
