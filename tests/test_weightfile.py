"""Weight files: materialize streams a valid safetensors file; WeightFile refuses every mismatch."""
from __future__ import annotations

import json
import struct
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import WeightFileError
from engine.models import load_spec
from engine.models.spec import WeightSpec
from engine.weightfile import WeightFile, file_order, materialize

WORKLOAD = SimpleNamespace(kind="infer", batch=1, video_tokens=16, audio_tokens=4, text_tokens=4,
                           context_tokens=0, lora_rank=0)


@pytest.fixture(scope="module")
def spec():
    return load_spec("tiny", WORKLOAD)


@pytest.fixture(scope="module")
def ptd(spec, tmp_path_factory):
    return materialize(spec, tmp_path_factory.mktemp("w") / "tiny.ptd", seed=3, device="cpu")


def test_materialize_is_safetensors_in_first_use_order(spec, ptd):
    loaded = load_file(ptd)
    assert set(loaded) == set(spec.weights)
    for name, w in spec.weights.items():
        assert tuple(loaded[name].shape) == w.shape and loaded[name].dtype == torch.bfloat16
        assert torch.isfinite(loaded[name].float()).all()
    (n,) = struct.unpack("<Q", ptd.read_bytes()[:8])
    header = json.loads(ptd.read_bytes()[8:8 + n])
    starts = [header[name]["data_offsets"][0] for name in file_order(spec)]
    assert starts == sorted(starts)  # the data follows the access order


def test_materialize_is_deterministic_per_seed(spec, ptd, tmp_path):
    again = materialize(spec, tmp_path / "again.ptd", seed=3, device="cpu")
    other = materialize(spec, tmp_path / "other.ptd", seed=4, device="cpu")
    assert again.read_bytes() == ptd.read_bytes()
    assert other.read_bytes() != ptd.read_bytes()
    assert not list(tmp_path.glob("*.partial"))


def test_views_map_the_file_without_a_copy(spec, ptd):
    ref = load_file(ptd)
    with WeightFile(ptd, spec) as wf:
        views = wf.tensors()
        base = wf.base_address()
        assert base % 4096 == 0
        for name, t in views.items():
            assert torch.equal(t, ref[name])
            assert base <= t.data_ptr() < base + wf.file_bytes  # inside the mapping
        del views, t


def test_a_real_checkpoint_opens_the_same_way(spec, tmp_path):
    weights = {n: torch.randn(w.shape).to(torch.bfloat16) for n, w in spec.weights.items()}
    save_file(weights, tmp_path / "ckpt.safetensors")
    with WeightFile(tmp_path / "ckpt.safetensors", spec) as wf:
        name = next(iter(spec.weights))
        assert torch.equal(wf.tensor(name), weights[name])


def test_missing_weight_is_named(spec, tmp_path):
    weights = {n: torch.zeros(w.shape, dtype=torch.bfloat16) for n, w in spec.weights.items()}
    gone = sorted(weights)[5]
    del weights[gone]
    save_file(weights, tmp_path / "m.safetensors")
    with pytest.raises(WeightFileError, match=f"weight {gone} of model tiny is missing"):
        WeightFile(tmp_path / "m.safetensors", spec)


def test_shape_and_dtype_mismatch_name_the_tensor(spec, tmp_path):
    weights = {n: torch.zeros(w.shape, dtype=torch.bfloat16) for n, w in spec.weights.items()}
    name = "proj_in.weight"
    out, inp = spec.weights[name].shape
    weights[name] = torch.zeros(out, inp + 1, dtype=torch.bfloat16)
    save_file(weights, tmp_path / "s.safetensors")
    with pytest.raises(WeightFileError, match=rf"{name} is BF16\[{out}, {inp + 1}\] in the file but the model "
                                              rf"expects BF16\[{out}, {inp}\]"):
        WeightFile(tmp_path / "s.safetensors", spec)
    weights[name] = torch.zeros(out, inp, dtype=torch.float16)
    save_file(weights, tmp_path / "d.safetensors")
    with pytest.raises(WeightFileError, match=rf"{name} is F16\[{out}, {inp}\]"):
        WeightFile(tmp_path / "d.safetensors", spec)


def test_truncated_file_is_refused(spec, ptd, tmp_path):
    data = ptd.read_bytes()
    cut = tmp_path / "cut.ptd"
    cut.write_bytes(data[:-1000])
    with pytest.raises(WeightFileError, match="truncated"):
        WeightFile(cut, spec)
    cut.write_bytes(data[:100])  # inside the header
    with pytest.raises(WeightFileError, match="truncated"):
        WeightFile(cut, spec)


def _rewrite_header(src, dst, edit) -> None:
    data = src.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    dst.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def test_overlapping_offsets_are_refused(spec, ptd, tmp_path):
    names = file_order(spec)

    def overlap(h):  # the second tensor claims to start inside the first
        b, e = h[names[1]]["data_offsets"]
        h[names[1]]["data_offsets"] = [b - 2, e - 2]

    _rewrite_header(ptd, tmp_path / "o.ptd", overlap)
    with pytest.raises(WeightFileError, match="overlap"):
        WeightFile(tmp_path / "o.ptd", spec)


def test_a_lying_size_is_refused(spec, ptd, tmp_path):
    name = file_order(spec)[0]

    def lie(h):
        b, e = h[name]["data_offsets"]
        h[name]["data_offsets"] = [b, e - 2]

    _rewrite_header(ptd, tmp_path / "l.ptd", lie)
    with pytest.raises(WeightFileError, match=f"{name} spans"):
        WeightFile(tmp_path / "l.ptd", spec)


def test_garbage_and_absent_files(spec, tmp_path):
    bad = tmp_path / "bad.ptd"
    bad.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(WeightFileError, match="not valid JSON"):
        WeightFile(bad, spec)
    with pytest.raises(WeightFileError, match="mode=materialize"):
        WeightFile(tmp_path / "nowhere.ptd", spec)


def test_close_refuses_while_views_are_held(spec, ptd):
    wf = WeightFile(ptd, spec)
    held = wf.tensor("proj_in.weight")
    with pytest.raises(WeightFileError, match="still referenced"):
        wf.close()
    del held
    wf.close()
    assert wf.closed


def test_other_dtypes_round_trip(tmp_path):
    base = load_spec("tiny", WORKLOAD)
    weights = {n: replace(w, dtype="fp32") for n, w in base.weights.items()}
    spec = replace(base, weights={**weights, "extra": WeightSpec("extra", (3, 5), "fp8_e4m3")})
    path = materialize(spec, tmp_path / "f.ptd", seed=0, device="cpu")
    with WeightFile(path, spec) as wf:
        assert wf.tensor("proj_in.weight").dtype == torch.float32
        assert wf.tensor("extra").dtype == torch.float8_e4m3fn
