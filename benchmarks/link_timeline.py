"""Where a link-bound row's time goes on a real module: each weight copy's measured span, the
link's idle gaps, and the host bytes' page offsets, row by row on one engine.offload set-up (as
mode=validate runs a real module's rows).

    python benchmarks/link_timeline.py --rows 8331:lru:4,14282:lru:4,14282:priority:1 --out DIR \
        model=flux_diffusers weights.file=/dev/shm/flux_diffusers.safetensors \
        workload.video_tokens=4096 workload.text_tokens=512          # on a CUDA machine

Per row: reconfigure, WARM steps, then TIMED steps with their kernels and copies marked
(`executor.step_timeline`). Pinned copy rates (the recorder's probe) before the first row and
after the last. Prints per row: the step, the copies' bytes, the sum of their spans (the link
busy), the union of their spans, the rate over each, the link's idle time inside the step, and
the copies' rates by host page offset (0 against not page-aligned). Writes DIR/timelines.json
(per row and step: step ms and the timeline; each weight's bytes and host page offset).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sim.prediction import union  # noqa: E402

WARM = 3
TIMED = 3


def union_ms(spans: list[tuple[float, float]]) -> float:
    """Total length covered by the spans."""
    return sum(b - a for a, b in union(spans))


def parse_rows(text: str) -> list[tuple[float, str, int]]:
    """--rows: BUDGET_MB:EVICTION:LOOKAHEAD,... (ValueError names the bad one)."""
    out = []
    for row in text.split(","):
        parts = row.split(":")
        try:
            budget, eviction, lookahead = parts
            out.append((float(budget), eviction, int(lookahead)))
        except ValueError:
            raise ValueError(f"--rows: {row!r} is not BUDGET_MB:EVICTION:LOOKAHEAD (e.g. 8331:lru:1)") from None
    return out


def step_figures(step: dict, sizes: dict, offsets: dict) -> tuple[float, ...]:
    """One timed step's row of the table: step ms, copies GB, their spans' sum and union (ms),
    the rate over each, the step's time outside the copies, and the rate of the copies from
    page-aligned host bytes and from the others."""
    copies = [(n, a, b) for track, n, a, b in step["timeline"] if track == "h2d"]
    nbytes = sum(sizes[n] for n, _, _ in copies)
    busy = sum(b - a for _, a, b in copies)
    union = union_ms([(a, b) for _, a, b in copies])
    by_page = []
    for aligned in (True, False):
        part = [(sizes[n], b - a) for n, a, b in copies if (offsets[n] == 0) == aligned]
        ms = sum(t for _, t in part)
        by_page.append(sum(n for n, _ in part) / ms / 1e6 if ms else 0.0)
    return (step["step_ms"], nbytes / 1e9, busy, union, nbytes / busy / 1e6 if busy else 0.0,
            nbytes / union / 1e6 if union else 0.0, step["step_ms"] - union, *by_page)


def pinned_h2d_gbps(device) -> float:
    """The recorder's probe's H2D rate at its largest copy (0 off a GPU)."""
    from engine.measure.probes import probe_copies

    if device.type != "cuda":
        return 0.0

    copies, _ = probe_copies(device)
    big = max(c["nbytes"] for c in copies if c["dir"] == "h2d")
    return next(c["nbytes"] / c["ns"] for c in copies if c["dir"] == "h2d" and c["nbytes"] == big)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", required=True, help="BUDGET_MB:EVICTION:LOOKAHEAD,...")
    ap.add_argument("--out", required=True)
    ap.add_argument("overrides", nargs="+", help="the engine's config overrides (model=..., weights.file=...)")
    args = ap.parse_args()
    try:
        rows = parse_rows(args.rows)
    except ValueError as err:
        ap.error(str(err))

    import torch
    from hydra import compose, initialize_config_dir

    from engine.config import register
    from engine.job import prepare
    from engine.modes.module_setup import checkpoint_path, kernel_options, setup_module
    from engine.modules.build import first_output
    from engine.modules.offload import offload

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*args.overrides, "mode=execute"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    job = prepare(cfg, out)
    module, inputs, device = setup_module(job)
    probes = {"before": pinned_h2d_gbps(device)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h = offload(module, budget_mb=rows[0][0], example_inputs=inputs, eviction=rows[0][1],
                    lookahead=rows[0][2], checkpoint=checkpoint_path(job), backend=cfg.weights.backend,
                    source=cfg.weights.source, **kernel_options(cfg))
    sizes = dict(h.executor.order.sizes)
    offsets = {w: t.data_ptr() % 4096 for w, t in h.executor.host.items()}
    result = {"overrides": args.overrides, "sizes": sizes, "page_offsets": offsets, "rows": []}
    print("| row | step ms | copies GB | busy ms | union ms | GB/s busy | GB/s union | idle in step ms "
          "| GB/s page-aligned | GB/s not | releases | relocations | reserved peak GB | held GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    try:
        for budget, eviction, lookahead in rows:
            h.reconfigure(budget_mb=budget, eviction=eviction, lookahead=lookahead)
            steps = []
            ran = len(h.telemetry())
            with torch.no_grad():
                for i in range(WARM + TIMED):
                    h.executor.time_steps = i >= WARM
                    first_output(module(**inputs))
                for s in range(-TIMED, 0):
                    steps.append({"step_ms": h.telemetry()[s]["step_ms"],
                                  "timeline": h.executor.step_timeline(s)})
            result["rows"].append({"budget_mb": budget, "eviction": eviction, "lookahead": lookahead,
                                   "steps": steps})
            med = [statistics.median(c) for c in zip(*(step_figures(s, sizes, offsets) for s in steps))]
            rows_run = h.telemetry()[ran:]
            pool = {"reserve_releases": sum(r["reserve_releases"] for r in rows_run[WARM:]),
                    "relocations": sum(r["relocations"] for r in rows_run[WARM:]),
                    "reserved_peak_bytes": h.executor.backend.reserved_peak_bytes(),
                    "held_device_bytes": max(r["held_device_bytes"] for r in rows_run)}
            result["rows"][-1].update(pool)
            print(f"| {eviction} {budget:g} la {lookahead} | " + " | ".join(f"{x:.2f}" for x in med)
                  + f" | {pool['reserve_releases']} | {pool['relocations']} | {pool['reserved_peak_bytes'] / 1e9:.2f} "
                  f"| {pool['held_device_bytes'] / 1e9:.2f} |", flush=True)
    finally:
        h.remove()
    probes["after"] = pinned_h2d_gbps(device)
    result["pinned_h2d_gbps"] = probes
    print(f"pinned H2D (probe_copies, largest size): before {probes['before']:.2f} GB/s, "
          f"after {probes['after']:.2f} GB/s")
    (out / "timelines.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
