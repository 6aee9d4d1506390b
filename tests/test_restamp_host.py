"""benchmarks/restamp_host.py apply: what it writes into a recording, on the tiny model."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from restamp_host import restamped  # noqa: E402

from engine.trace import Trace  # noqa: E402

MS = 10**6


def _recording(tiny) -> Trace:
    t = tiny.trace
    header = {**t.header, "model": tiny.spec.name, "num_layers": tiny.spec.num_layers, "workload": tiny.workload,
              "step_ns": 100 * MS, "probes": {"host": {"kernel_ns": [1] * len(t.records)},
                                              "compute_under_copy": {"alone_ns": 100 * MS, "with_copy_ns": 110 * MS}}}
    return Trace(header, t.weight_sizes, t.records)


def _measured(tiny, pipelined_ns: int) -> dict:
    n = len(tiny.spec.kernels)
    return {"kernels": [k.name for k in tiny.spec.kernels], "device": "gpu", "date": "d",
            "runs": [{"pipelined_step_ns": pipelined_ns, "kernel_ns": [1000] * n, "under_copy": [104 * MS, 106 * MS]}]}


def test_a_gpu_bound_step_gets_its_pace_and_keeps_its_kernels(tiny) -> None:
    old = _recording(tiny)
    new = restamped(old, _measured(tiny, 103 * MS), "m.json")
    h = new.header
    assert h["compute_sustained_slowdown"] == pytest.approx(0.03)  # the pipelined step over the held one
    assert h["compute_slowdown_under_copy"] == pytest.approx(106 / 104 - 1, abs=1e-4)
    assert h["probes"]["compute_under_copy"] == {"alone_ns": 104 * MS, "with_copy_ns": 106 * MS}
    assert [r.compute_ns for r in new.records] == [r.compute_ns for r in old.records]
    assert {r.host_ns for r in new.records} == {1000} and h["host_scale"] == 1.0


def test_a_host_bound_step_keeps_the_held_probe(tiny) -> None:
    old = _recording(tiny)
    h = restamped(old, _measured(tiny, 150 * MS), "m.json").header
    assert "compute_sustained_slowdown" not in h and "compute_slowdown_under_copy" not in h
    assert h["probes"]["compute_under_copy"] == old.header["probes"]["compute_under_copy"]
    assert h["host_scale"] > 1  # its host times scaled to the pipelined step


def test_apply_copies_takes_the_held_probes_small_sizes_only(tiny, tmp_path) -> None:
    import json

    from restamp_host import apply_copies

    from engine.trace import read_trace, write_trace

    old = _recording(tiny)
    old.header["probes"]["copies"] = [{"dir": "h2d", "nbytes": 4096, "ns": 13_000},
                                      {"dir": "h2d", "nbytes": 1 << 28, "ns": 5_000_000}]
    path = tmp_path / "t.jsonl"
    write_trace(path, old)
    probe = tmp_path / "m.json"
    probe.write_text(json.dumps({"copy_probe": {"device": "gpu", "date": "d", "duplex": [],
                                                "copies": [{"dir": "h2d", "nbytes": 4096, "ns": 2_500},
                                                           {"dir": "h2d", "nbytes": 1 << 28, "ns": 4_900_000}]}}))
    apply_copies(probe, [path])
    new = read_trace(path)
    # The held small copy replaces the host-issued one; the large one stays the recording's.
    assert sorted((c["nbytes"], c["ns"]) for c in new.header["probes"]["copies"]) == [(4096, 2_500),
                                                                                       (1 << 28, 5_000_000)]
    assert new.header["copies_restamped"].startswith("m.json: gpu")
    assert [r.compute_ns for r in new.records] == [r.compute_ns for r in old.records]


def test_rescale_fits_a_gpu_bound_steps_host_times_into_its_pipelined_step(tiny, tmp_path) -> None:
    from dataclasses import replace

    from restamp_host import rescale

    from engine.trace import read_trace, write_trace

    old = _recording(tiny)
    n = len(old.records)
    # 2 ms of host a record, n of them, in a pipelined step of n ms that the GPU bounds
    records = tuple(replace(r, host_ns=2 * MS) for r in old.records)
    header = {**old.header, "step_ns": n * MS, "pipelined_step_ns": n * MS, "host_scale": 1.0}
    path = tmp_path / "t.jsonl"
    write_trace(path, Trace(header, old.weight_sizes, records))
    rescale([path])
    new = read_trace(path)
    assert new.header["host_scale"] == 0.5 and "host_rescaled" in new.header
    assert {r.host_ns for r in new.records} == {MS}
    assert [r.compute_ns for r in new.records] == [r.compute_ns for r in old.records]
    rescale([path])  # a rescaled recording stays as it is
    assert {r.host_ns for r in read_trace(path).records} == {MS}
