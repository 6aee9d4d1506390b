"""Flash attention's tiles on this GPU: the probe `engine.measure.compute --only attention_tiles`
writes (lengths off the 128-row tile, the head counts models run, text-length keys; inference and
training), and the name, grid and block of each kernel a few shapes launch (profiler), which
show the tiles.

    python benchmarks/attention_lengths.py --out FILE.json

FILE.json is a probe file (`python -m engine.calibrate --probes FILE`) with "kernels" beside.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from engine.measure.compute import TRAIN_BACKENDS, probe_tiles

PROFILED = ((32, 4096, 4096, 128), (32, 4429, 4429, 128), (38, 4096, 4096, 64), (38, 4429, 4429, 64),
            (8, 4096, 4096, 128), (24, 4096, 333, 128))


def kernels(device: torch.device) -> list[dict]:
    """Name, grid and block of each kernel the PROFILED shapes launch, inference and training."""
    from torch.profiler import ProfilerActivity, profile

    out = []
    for (bh, lq, lk, d), training in itertools.product(PROFILED, (False, True)):
        leaves = [torch.randn(1, n, bh, d, device=device, dtype=torch.bfloat16, requires_grad=training)
                  for n in (lq, lk, lk)]
        q, k, v = (t.transpose(1, 2) for t in leaves)
        ctx = sdpa_kernel(TRAIN_BACKENDS) if training else contextlib.nullcontext()
        with ctx:
            o = F.scaled_dot_product_attention(q, k, v)
            torch.cuda.synchronize(device)
            path = Path(f"/tmp/attn_trace_{bh}_{lq}_{lk}_{d}_{int(training)}.json")
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                o = F.scaled_dot_product_attention(q, k, v)
                if training:
                    torch.autograd.grad(o, leaves, torch.randn_like(o))
                torch.cuda.synchronize(device)
            prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
        for e in events:
            if e.get("cat") == "kernel":
                args = e.get("args", {})
                out.append({"shape": [bh, lq, lk, d], "training": training, "name": e["name"][:200],
                            "grid": args.get("grid"), "block": args.get("block"), "us": e.get("dur"),
                            "regs": args.get("registers per thread"), "smem": args.get("shared memory")})
        path.unlink()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args()
    device = torch.device("cuda")
    began = time.perf_counter()
    data = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "kernels": kernels(device), "probes": {"compute": probe_tiles(device)}}
    args.out.write_text(json.dumps(data) + "\n")
    print(f"wrote {args.out} ({time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
