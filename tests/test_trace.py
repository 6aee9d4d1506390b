"""engine/trace.py: the time predictor, synthesize, and the file format's checks."""
from __future__ import annotations

import gzip
import json
from dataclasses import replace
from pathlib import Path

import pytest

from engine.config import HardwareConfig, WorkloadConfig
from engine.errors import TraceError
from engine.models.spec import Kernel, ModelSpec, SavedTensor, WeightSpec
from engine.kernel_time import ExecutionTimePredictor
from engine.models.synthesize import synthesize

from engine.trace import KernelRecord, Trace, read_trace, write_trace

HW = HardwareConfig(
    name="test", source="test", device_memory_mb=80000, h2d_gbps=50.0, d2h_gbps=50.0, duplex_gbps=80.0,
    pageable_gbps=7.0, mmap_gbps=7.0, mmap_registered_gbps=50.0, matmul_tflops=500.0, hbm_gbps=2000.0)


def _spec() -> ModelSpec:
    weights = {n: WeightSpec(n, (64, 64)) for n in ("a.w", "b.w", "c.w")}
    kernels = (
        Kernel("a", 0, "linear", ("a.w",), flops=10**9, io_bytes=10**6,
               saved=(SavedTensor("input", 2000, 0),)),
        Kernel("n", 0, "norm", (), flops=0, io_bytes=4 * 10**6, saved=(SavedTensor("input", 1000, 0),)),
        Kernel("b", 1, "attention", ("b.w", "c.w"), flops=10**6, io_bytes=10**8),
    )
    return ModelSpec("toy", "dit", 2, weights, kernels)


def _train() -> WorkloadConfig:
    return WorkloadConfig(name="t", kind="train_lora")


def test_predictor_matmul_memory_and_bound() -> None:
    p = ExecutionTimePredictor(HW)
    assert p.kernel_ns("linear", 10**9, 10**6) == 2000  # 1e9 FLOP at 500 TFLOP/s
    assert p.kernel_ns("norm", 0, 4 * 10**6) == 2000  # 4 MB at 2000 GB/s
    assert p.kernel_ns("attention", 10**6, 10**8) == 50_000  # HBM-bound, not 2 ns of FLOPs
    with pytest.raises(TraceError, match="no time predictor"):
        p.kernel_ns("conv", 1, 1)


def test_synthesize_inference_has_no_backward_and_no_saves() -> None:
    t = synthesize(_spec(), WorkloadConfig(name="i", kind="infer"), HW)
    assert [r.name for r in t.records] == ["a", "n", "b"]
    assert all(r.phase == "fwd" and not r.saved for r in t.records)
    assert t.header["source"] == "synthesized" and t.header["records"] == 3
    assert t.weight_sizes == {"a.w": 8192, "b.w": 8192, "c.w": 8192}


def test_synthesize_training_mirrors_forward() -> None:
    t = synthesize(_spec(), _train(), HW)
    names = [r.name for r in t.records]
    assert names == ["a", "n", "b", "b.bwd", "n.bwd", "a.bwd"]
    fwd_a, bwd_a = t.records[0], t.records[5]
    # Both kernels save "input": the second is made unique by its kernel's prefix.
    assert [s.name for s in fwd_a.saved] == ["input"]
    assert [s.name for s in t.records[1].saved] == ["n:input"]
    assert bwd_a.needs == ("input",) and bwd_a.weights == fwd_a.weights
    assert bwd_a.flops == 2 * fwd_a.flops and bwd_a.compute_ns == 2 * fwd_a.compute_ns
    order = t.access_order()
    assert order.kernels == tuple(names) and order.reads[5] == ("a.w",) and len(order) == 6
    assert t.num_layers == 2


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_round_trip(tmp_path: Path, suffix: str) -> None:
    t = synthesize(_spec(), _train(), HW)
    recorded = Trace({**t.header, "source": "recorded"}, t.weight_sizes,
                     (KernelRecord(**{**t.records[0].__dict__, "copies": ({"dir": "h2d", "bytes": 8192},)}),)
                     + t.records[1:])
    path = tmp_path / ("t" + suffix)
    write_trace(path, recorded)
    back = read_trace(path)
    assert back == recorded


def test_a_spec_kernels_passes_round_trip(tmp_path: Path) -> None:
    from engine.models import load_spec

    wl = WorkloadConfig(name="infer", kind="infer", video_tokens=64, audio_tokens=16, text_tokens=16)
    t = synthesize(load_spec("tiny", wl), wl, HW)
    assert any(r.passes for r in t.records)
    write_trace(tmp_path / "t.jsonl", t)
    assert read_trace(tmp_path / "t.jsonl").records == t.records


def _lines(tmp_path: Path) -> tuple[Path, list[dict]]:
    path = tmp_path / "t.jsonl"
    write_trace(path, synthesize(_spec(), _train(), HW))
    return path, [json.loads(line) for line in path.read_text().splitlines()]


def _write(path: Path, objs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


def _error(tmp_path: Path, edit) -> str:
    path, objs = _lines(tmp_path)
    edited = edit(objs)
    if isinstance(edited, list):
        objs = edited
    with pytest.raises(TraceError) as e:
        read_trace(_write(path, objs))
    return str(e.value)


def test_wrong_format_and_version(tmp_path: Path) -> None:
    assert "line 1: not an offload-engine trace" in _error(tmp_path, lambda o: o[0].update(format="x"))
    msg = _error(tmp_path, lambda o: o[0].update(version=2))
    assert "line 1" in msg and "version 2 is not supported" in msg


def test_host_syncs_must_name_record_positions(tmp_path: Path) -> None:
    msg = _error(tmp_path, lambda o: o[0].update(host_syncs=[0, 6]))
    assert msg.startswith('line 1: header "host_syncs" must list record positions (integers from 0 to 5)')


@pytest.mark.parametrize("key", ["compute_slowdown_under_copy", "compute_sustained_slowdown"])
def test_a_slowdown_must_be_a_fraction(tmp_path: Path, key: str) -> None:
    msg = _error(tmp_path, lambda o: o[0].update({key: -0.1}))
    assert msg.startswith(f'line 1: header "{key}" must be a number from 0')


def test_truncated_file(tmp_path: Path) -> None:
    msg = _error(tmp_path, lambda o: o[:-2])
    assert "line 6:" in msg and "header says 6 records, file has 4" in msg


def test_truncated_gzip(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl.gz"
    write_trace(path, synthesize(_spec(), _train(), HW))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match="truncated"):
        read_trace(path)


def test_empty_and_missing_file(tmp_path: Path) -> None:
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(TraceError, match="empty"):
        read_trace(tmp_path / "e.jsonl")
    with pytest.raises(TraceError, match="no such trace file"):
        read_trace(tmp_path / "absent.jsonl")
    (tmp_path / "b.jsonl").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TraceError, match="not UTF-8"):
        read_trace(tmp_path / "b.jsonl")


def test_record_missing_a_field(tmp_path: Path) -> None:
    msg = _error(tmp_path, lambda o: o[2].pop("compute_ns"))
    assert msg.startswith("line 3: record is missing field 'compute_ns'")


@pytest.mark.parametrize("field,value", [
    ("layer", "0"), ("compute_ns", 1.5), ("phase", "forward"), ("weights", "a.w"), ("flops", True),
    ("saved", [{"name": "x", "nbytes": -1, "layer": 0}]), ("passes", [["softmax", 100]]), ("passes", [[100]]),
])
def test_record_with_wrong_type(tmp_path: Path, field: str, value) -> None:
    msg = _error(tmp_path, lambda o: o[1].update({field: value}))
    assert msg.startswith("line 2:")


def test_unknown_weight(tmp_path: Path) -> None:
    msg = _error(tmp_path, lambda o: o[3].update(weights=["b.w", "zzz"]))
    assert msg.startswith("line 4 (b):") and "'zzz' is not in the header's weight_sizes" in msg


def test_forward_after_backward(tmp_path: Path) -> None:
    msg = _error(tmp_path, lambda o: o[5].update(phase="fwd", needs=[]))  # n.bwd, after b.bwd
    assert msg.startswith("line 6 (n.bwd): forward record after a backward one")


def test_backward_not_the_reverse(tmp_path: Path) -> None:
    def swap(o):
        o[5], o[6] = o[6], o[5]  # n.bwd <-> a.bwd

    msg = _error(tmp_path, swap)
    assert msg.startswith("line 6 (a.bwd)") and "expected 'n.bwd'" in msg


def test_backward_incomplete(tmp_path: Path) -> None:
    def drop(o):
        o[0]["records"] = 5
        return o[:-1]

    assert "backward stops after 2 of 3" in _error(tmp_path, drop)


def test_needs_and_duplicate_saves(tmp_path: Path) -> None:
    assert "needs 'n:input', which neither a nor an earlier forward record saves" in _error(
        tmp_path, lambda o: o[6].update(needs=["n:input"]))
    assert "needs 'input' a second time" in _error(tmp_path, lambda o: o[6].update(needs=["input", "input"]))
    msg = _error(tmp_path, lambda o: o[2].update(saved=[{"name": "input", "nbytes": 1, "layer": 0}]))
    assert msg.startswith("line 3 (n): saved tensor 'input' is saved twice")


def test_not_json(tmp_path: Path) -> None:
    path, objs = _lines(tmp_path)
    text = path.read_text().splitlines()
    text[3] = text[3][:20]
    path.write_text("\n".join(text) + "\n")
    with pytest.raises(TraceError, match="line 4: not JSON"):
        read_trace(path)
    with gzip.open(tmp_path / "x.gz", "wt") as f:
        f.write("{]\n")
    with pytest.raises(TraceError, match="line 1: header is not JSON"):
        read_trace(tmp_path / "x.gz")


def test_a_tensor_saved_again_is_needed_at_its_last_savers_mirror(tmp_path: Path) -> None:
    """A storage a later kernel saves again (the text context of every block) is unpacked first
    where backward meets that later kernel: an earlier record's tensor may be needed there."""
    path, objs = _lines(tmp_path)
    first = next(o for o in objs[1:] if o["saved"])
    name = first["saved"][0]["name"]
    for o in objs[1:]:
        if o["phase"] == "bwd":
            o["needs"] = [n for n in o["needs"] if n != name]
    objs[4]["needs"] = objs[4]["needs"] + [name]  # the first backward record: the last forward's mirror
    trace = read_trace(_write(path, objs))
    assert name in trace.records[3].needs


def test_launches_and_packs_round_trip_and_must_be_counts(tmp_path: Path) -> None:
    t = synthesize(_spec(), _train(), HW)
    counted = replace(t, records=tuple(replace(r, launches=3 + i, packs=2 if r.phase == "fwd" else 0)
                                       for i, r in enumerate(t.records)))
    write_trace(tmp_path / "t.jsonl", counted)
    assert read_trace(tmp_path / "t.jsonl") == counted
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    lines[1] = lines[1].replace('"launches": 3', '"launches": -1')
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match="line 2: field 'launches' must be an integer >= 0"):
        read_trace(tmp_path / "bad.jsonl")
