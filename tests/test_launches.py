"""The run-ahead in CUDA launches: the census's counting, the launcher's queue, the hooks' host cost."""
from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from engine.config import ActivationsConfig, PoolConfig
from engine.measure.launches import FETCH, MARK, TEARDOWN, Census, launches_by_mark
from test_sim import H100, MS, US, cyclic, run, training


def _call(ts: float, corr: int) -> dict:
    return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "args": {"correlation": corr}}


def _op(corr: int, cat: str = "kernel") -> dict:
    return {"cat": cat, "name": "k", "ts": 1e9, "args": {"correlation": corr}}


def _note(name: str, ts: float, dur: float = 0.0) -> dict:
    return {"cat": "user_annotation", "name": name, "ts": ts, "dur": dur}


def test_the_census_counts_device_operations_under_the_mark_their_launch_follows() -> None:
    events = [_note(MARK + "0", 10), _note(MARK + "1", 20), _note(MARK + "(\'.bwd\', 1)", 40),
              _note(FETCH, 21, 3),  # the recorder's weight copies inside record 1's fetch
              _call(5, 1), _call(12, 2), _call(15, 3), _call(22, 4), _call(25, 5), _call(41, 6), _call(42, 7),
              _op(1), _op(2), _op(3, "gpu_memset"), _op(4, "gpu_memcpy"), _op(5), _op(6), _op(7, "gpu_memcpy"),
              {"cat": "cuda_runtime", "name": "cudaEventRecord", "ts": 13, "args": {"correlation": 8}}]
    # Before the first mark: the first record's. An event record queues no device operation.
    assert launches_by_mark(events) == {"0": 3, "1": 1, "('.bwd', 1)": 2}
    assert launches_by_mark([_call(1, 1), _op(1)]) == {}  # no marks: nothing to count under


def _lead(result, n: int) -> int:
    """The most records the simulated host had launched but the GPU not finished, in the last step."""
    host = sorted(t for t, track, what in result.events if track == "host" and what.startswith("start "))
    ends = sorted(t for t, track, what in result.events if track == "compute" and what.startswith("end "))
    return max(i - sum(e <= t for e in ends) for i, t in enumerate(host) if i >= len(host) - n)


class _Profile:
    """torch.profiler.profile's stand-in: records what the environment held at its start."""

    started_with: list = []

    def __init__(self, **kw: object) -> None:
        pass

    def __enter__(self) -> None:
        _Profile.started_with.append(os.environ.get(TEARDOWN))

    def __exit__(self, *exc: object) -> None:
        pass

    def export_chrome_trace(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"traceEvents": []}, f)


@pytest.mark.parametrize("preset", [None, "0"])
def test_the_census_asks_kineto_to_detach_cupti_after_it(monkeypatch, preset) -> None:
    """A profiling session left CUPTI attached: host launches ran 1.4-1.9x slower after it on
    the H100 (benchmarks/results). The census asks for the teardown unless the caller chose."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.synchronize", lambda *a: None)
    monkeypatch.setattr("torch.profiler.profile", _Profile)
    if preset is None:
        monkeypatch.delenv(TEARDOWN, raising=False)
    else:
        monkeypatch.setenv(TEARDOWN, preset)
    _Profile.started_with = []
    with Census(True):
        pass
    assert _Profile.started_with == ["1" if preset is None else preset]


@pytest.mark.parametrize("launches, depth, lead", [(1, 8, 7), (4, 8, 1), (3, 8, 1), (9, 8, 0), (1, 1024, 39)])
def test_the_host_runs_as_many_records_ahead_as_their_launches_fit_the_queue(launches, depth, lead) -> None:
    # 40 records of 1 ms on the GPU and 5 us on the host: the host launches a record once
    # CUDA's queue has room for all its launches (`depth` at most; a record of more than
    # that waits for an empty queue), so as it starts one, `lead` records are unfinished;
    # with room, the whole step (a step's end waits for nothing here).
    t = cyclic(40, 1, 1 * MS)
    t = replace(t, records=tuple(replace(r, launches=launches) for r in t.records))
    r = run(t, None, hardware=replace(H100, launch_queue_depth=depth), steps=2)
    assert _lead(r, 40) == lead


def test_a_record_counts_one_launch_where_none_was_counted() -> None:
    t = cyclic(40, 1, 1 * MS)
    counted = replace(t, records=tuple(replace(r, launches=1) for r in t.records))
    hw = replace(H100, launch_queue_depth=8)
    assert run(t, None, hardware=hw, steps=2).events == run(counted, None, hardware=hw, steps=2).events


def _host_ns(result, name: str) -> int:
    starts = [t for t, track, what in result.events if track == "host" and what == "start " + name]
    ends = [t for t, track, what in result.events if track == "host" and what == "end " + name]
    return ends[-1] - starts[-1]


def test_under_an_activation_policy_the_host_pays_for_the_offloaders_hooks() -> None:
    # Each forward kernel of `training` saves one tensor; with packs=3 autograd handed the hooks
    # three (the weight and a view beside it): the forward pays offload_kernel_us and three packs,
    # its backward mirror three unpacks, on top of the launch (kernel_launch_us, 5 us).
    t = training(4, 1, 1 * MS, 4096)
    t = replace(t, records=tuple(replace(r, packs=3) if r.phase == "fwd" else r for r in t.records))
    hw = replace(H100, offload_kernel_us=7.0, pack_hook_us=11.0, unpack_hook_us=13.0)
    act = ActivationsConfig(mode="watermark", high_watermark_mb=1000, low_watermark_mb=500,
                            pool=PoolConfig([16], [4]))
    r = run(t, None, hardware=hw, act=act, steps=2)
    assert _host_ns(r, "k2") == (5 + 7 + 3 * 11) * US
    assert _host_ns(r, "k2.bwd") == (5 + 3 * 13) * US
    off = run(t, None, hardware=hw, steps=2)  # activations off: no offloader, no hooks
    assert _host_ns(off, "k2") == _host_ns(off, "k2.bwd") == 5 * US
    unpacked = replace(t, records=tuple(replace(r, packs=0) for r in t.records))
    assert _host_ns(run(unpacked, None, hardware=hw, act=act, steps=2), "k2") == (5 + 7 + 1 * 11) * US


def test_a_recording_without_launch_counts_says_what_the_simulator_takes(run_cli, tmp_path) -> None:
    from engine.config import WorkloadConfig
    from engine.models import load_spec
    from engine.models.synthesize import synthesize

    from engine.trace import write_trace

    wl = WorkloadConfig(name="infer", kind="infer", video_tokens=6144, audio_tokens=128, text_tokens=256)
    t = synthesize(load_spec("tiny", wl), wl, H100)
    recorded = replace(t, header={**t.header, "source": "recorded"},
                       records=tuple(replace(r, launches=0) for r in t.records))
    write_trace(tmp_path / "old.jsonl", recorded)
    r = run_cli("+model=tiny", f"trace={tmp_path / 'old.jsonl'}", "sim.timeline=false")
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert "counts no CUDA launches" in out and "one launch a record" in out
    write_trace(tmp_path / "new.jsonl", replace(recorded, records=tuple(replace(rec, launches=2) for rec in t.records)))
    r = run_cli("+model=tiny", f"trace={tmp_path / 'new.jsonl'}", "sim.timeline=false")
    assert r.returncode == 0 and "counts no CUDA launches" not in r.stdout + r.stderr


def test_a_shallow_launch_queue_is_taken_for_a_depth_in_records(run_cli) -> None:
    r = run_cli("+model=tiny", "hardware.launch_queue_depth=64", "sim.timeline=false")
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "launch_queue_depth=64" in out and "counts CUDA launches" in out
    default = run_cli("+model=tiny", "sim.timeline=false")
    assert "counts CUDA launches" not in default.stdout + default.stderr
