"""Golden event logs of the `tiny` model, and the timeline writers.

The golden files pin every decision, every event and its time, and the
prediction, exactly. After an intended change, regenerate them with
UPDATE_GOLDEN=1 pytest tests/test_sim_golden.py and review the diff.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from engine.config import ActivationsConfig, HardwareConfig, PoolConfig, WeightsConfig, WorkloadConfig
from engine.models import load_spec
from engine.models.synthesize import synthesize
from sim import SimResult, simulate
from sim.timeline import TRACKS, plot_timeline, write_chrome_trace

GOLDEN = Path(__file__).parent / "golden"
# Pinned here, not read from conf/, so a profile edit does not move the goldens.
H100 = HardwareConfig(
    name="h100", source="DESIGN.md", device_memory_mb=81559, h2d_gbps=54.4, d2h_gbps=54.2,
    duplex_gbps=87.6, pageable_gbps=7.1, mmap_gbps=7.3, mmap_registered_gbps=55.0,
    small_copy_mib=[1, 4, 256], small_copy_gbps=[46.0, 52.6, 54.4], matmul_tflops=771.0, hbm_gbps=3000.0)
TINY_TOKENS = dict(batch=1, video_tokens=64, audio_tokens=16, text_tokens=16)

SCENARIOS = {
    # Weights streamed through a 2 MB budget (the tiny model is 3.8 MB), two steps.
    "tiny_infer_belady": dict(
        workload=WorkloadConfig(name="infer", kind="infer", **TINY_TOKENS),
        weights=WeightsConfig(eviction="belady", lookahead=2, source="mmap_registered"),
        activations=None, budget=2_000_000, steps=2),
    # LoRA step: weights streamed and activations spilled past a 0.3 MB watermark.
    "tiny_train_watermark": dict(
        workload=WorkloadConfig(name="train", kind="train_lora", lora_rank=4, **TINY_TOKENS),
        weights=WeightsConfig(eviction="lru", lookahead=1, source="pinned"),
        activations=ActivationsConfig(mode="watermark", high_watermark_mb=0.3, low_watermark_mb=0.2,
                                      min_tensor_bytes=16384, max_inflight_d2h=2, max_inflight_h2d=2,
                                      pool=PoolConfig([0.02, 0.1], [4, 2])),
        budget=2_500_000, steps=1),
    # The vmm backend: 16 KiB granules (the small weights resident, the rest in whole granules),
    # each map, unmap, create and release of the chunk books charged to the host.
    "tiny_infer_vmm": dict(
        workload=WorkloadConfig(name="infer", kind="infer", **TINY_TOKENS),
        weights=WeightsConfig(eviction="lru", lookahead=2, source="mmap_registered", backend="vmm"),
        activations=None, budget=2_500_000, steps=2,
        hardware=dataclasses.replace(H100, vmm_granule_bytes=16384, vmm_map_us=50.0, vmm_unmap_us=29.0,
                                     vmm_create_us=15.0, vmm_release_us=26.0)),
}


def _run(name: str) -> SimResult:
    s = SCENARIOS[name]
    hardware = s.get("hardware", H100)
    trace = synthesize(load_spec("tiny", s["workload"]), s["workload"], hardware)
    return simulate(trace, s["weights"], s["activations"], hardware, s["budget"], s["steps"], False)


def _as_json(result: SimResult) -> dict:
    return {
        "prediction": result.prediction,
        "counts": {"decisions": len(result.decisions), "events": len(result.events)},
        "decisions": [[d.step, d.position, d.action, d.target, d.detail] for d in result.decisions],
        "events": [list(e) for e in result.events],
    }


def _dump(golden: dict) -> str:
    # One decision / event a line, so a regeneration diffs line by line.
    head = {k: golden[k] for k in ("prediction", "counts")}
    lines = [json.dumps(head, indent=1, sort_keys=True)[:-2] + ","]
    for key in ("decisions", "events"):
        rows = golden[key]
        lines.append(f' "{key}": [')
        lines += [" " + json.dumps(r) + ("," if i < len(rows) - 1 else "") for i, r in enumerate(rows)]
        lines.append(" ]" + ("," if key == "decisions" else ""))
    lines.append("}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_golden_event_log(name: str) -> None:
    path = GOLDEN / f"{name}.json"
    got = _as_json(_run(name))
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(_dump(got))
    assert path.exists(), f"{path} is missing; create it with UPDATE_GOLDEN=1"
    want = json.loads(path.read_text())
    assert got["counts"] == want["counts"]
    assert got["prediction"] == want["prediction"]
    assert got["decisions"] == want["decisions"]
    for i, (g, w) in enumerate(zip(got["events"], want["events"])):
        assert g == w, f"event {i} differs"
    assert got == want


def test_timeline_files(tmp_path: Path) -> None:
    result = _run("tiny_train_watermark")
    write_chrome_trace(result, tmp_path / "timeline.json")
    events = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == set(TRACKS)
    spans = [e for e in events if e["ph"] == "X"]
    by_track = {tid: [e for e in spans if e["tid"] == tid] for tid in range(1, len(TRACKS) + 1)}
    assert all(by_track.values())  # host, compute, h2d and d2h all did something
    for items in by_track.values():  # one span at a time per track
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-9 for a, b in zip(items, items[1:]))
    counter = [e["args"]["bytes"] for e in events if e["ph"] == "C"]
    # The series is the device bytes at each instant; the peak adds the weights' and the saved
    # activations' peaks, each reached at its own instant.
    assert max(counter) == max(b for _, b in result.device_bytes) <= result.prediction["peak_device_bytes"]
    plot_timeline(result, tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
