"""The bad-input corpus: configs, shape files and traces that must be refused.

Every case goes through the real CLI and must end with exit code 2, one line
on stderr that names the problem, no traceback, and no report.json left
looking like a result.
"""
import gzip
import json
from pathlib import Path

import pytest

from engine.models import build_spec, load_model_config
from engine.models.synthesize import synthesize
from engine.trace import write_trace
from engine.config import HardwareConfig, WorkloadConfig
from omegaconf import OmegaConf

TRAIN_WM = ("+model=tiny", "workload=train_lora", "activations=watermark")
TRAIN_WM_FIXED = TRAIN_WM + ("activations/pool=stagehand",)

CONFIG_CASES = {
    "low watermark above high": (TRAIN_WM + ("activations.high_watermark_mb=10",
                                             "activations.low_watermark_mb=20"), "low"),
    "negative watermark": (TRAIN_WM + ("activations.high_watermark_mb=-1",), "negative"),
    "empty size classes": (TRAIN_WM_FIXED + ("activations.pool.class_sizes_mb=[]",
                                       "activations.pool.slabs_per_class=[]"), "class"),
    "duplicate size classes": (TRAIN_WM_FIXED + ("activations.pool.class_sizes_mb=[1,4,4,64,256]",), "increasing"),
    "unordered size classes": (TRAIN_WM_FIXED + ("activations.pool.class_sizes_mb=[4,1,16,64,256]",), "increasing"),
    "slab counts do not match classes": (TRAIN_WM_FIXED + ("activations.pool.slabs_per_class=[1,2]",), "slabs_per_class"),
    "zero slabs": (TRAIN_WM_FIXED + ("activations.pool.slabs_per_class=[0,2,2,2,2]",), "slab"),
    "class sizes not numbers": (TRAIN_WM_FIXED + ("activations.pool.class_sizes_mb=abc",), "class_sizes_mb"),
    "exact pool given classes too": (TRAIN_WM + ("activations.pool.class_sizes_mb=[1]",
                                                 "activations.pool.slabs_per_class=[1]"), "exact"),
    "exact pool with nothing to spill": (TRAIN_WM + ("activations.min_tensor_bytes=100000000000",), "min_tensor_bytes"),
    "activations on an inference workload": (("+model=tiny", "activations=watermark"), "train_lora"),
    "sync offloads every layer": (("+model=tiny", "workload=train_lora", "activations=sync",
                                   "activations.num_offload_layers=4"), "num_offload_layers"),
    "wrong type in workload": (("+model=tiny", "workload.video_tokens=many"), "workload.video_tokens"),
    "unknown key in hardware": (("+model=tiny", "hardware.pcie=5"), "hardware.pcie"),
    "unknown weight source": (("+model=tiny", "weights.source=floppy"), "weights.source"),
    "zero steps": (("+model=tiny", "workload.steps=0"), "workload.steps"),
    "a search over a swept budget": (("-m", "model=tiny", "+search=min_budget", "budget=1,2"), "sweeps values"),
    "unknown activations mode": (("+model=tiny", "activations.mode=compress"), "activations.mode"),
}

# Files a user would add under their own config dir (hydra.searchpath).
SYNC_DICTS = {
    "sync dict reloads before it offloads": ("{0: [2, -1, 0, -1]}", "reload"),
    "sync dict names a missing layer": ("{9: [10, -1, 10, -1]}", "9"),
    "sync dict offload finishes before its own forward": ("{1: [1, -1, 3, -1]}", "offload_fwd"),
    "sync dict reload count differs": ("{0: [2, 3, 2, 1]}", "reload_num"),
    "sync dict with three values": ("{0: [2, -1, 2]}", "4"),
}

SHAPE_FILES = {
    "heads x head_dim is not dim": ({"heads": 3}, "heads"),
    "negative layer count": ({"num_layers": -2}, "num_layers"),
    "unknown family": ({"family": "mamba"}, "family"),
    "misspelled key": ({"hiden_dim": 128}, "hiden_dim"),
    "dim not a number": ({"dim": "wide"}, "dim"),
}


def _assert_refused(r, run_dir: Path, fragment: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout[-1500:], r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr
    assert fragment.lower() in lines[0].lower(), lines[0]
    assert not (run_dir / "report.json").exists()


@pytest.mark.parametrize("name", sorted(CONFIG_CASES))
def test_config_case(run_cli, tmp_path, name):
    args, fragment = CONFIG_CASES[name]
    _assert_refused(run_cli(*args), tmp_path / "run", fragment)


@pytest.mark.parametrize("name", sorted(SYNC_DICTS))
def test_sync_dict_case(run_cli, tmp_path, name):
    body, fragment = SYNC_DICTS[name]
    conf = tmp_path / "userconf" / "activations"
    conf.mkdir(parents=True)
    (conf / "mine.yaml").write_text(f"defaults:\n  - sync\n  - _self_\nsync_dict: {body}\n")
    r = run_cli("+model=tiny", "workload=train_lora", "activations=mine",
                f"hydra.searchpath=[file://{tmp_path / 'userconf'}]")
    _assert_refused(r, tmp_path / "run", fragment)


@pytest.mark.parametrize("name", sorted(SHAPE_FILES))
def test_shape_file_case(run_cli, tmp_path, name):
    changes, fragment = SHAPE_FILES[name]
    tiny = OmegaConf.load(Path(__file__).parents[1] / "conf" / "model" / "tiny.yaml")
    for k, v in changes.items():
        tiny[k] = v
    conf = tmp_path / "userconf" / "model"
    conf.mkdir(parents=True)
    OmegaConf.save(tiny, conf / "mine.yaml")
    r = run_cli("+model=mine", f"hydra.searchpath=[file://{tmp_path / 'userconf'}]")
    _assert_refused(r, tmp_path / "run", fragment)


def _tiny_trace_lines(tmp_path: Path, kind: str = "infer") -> list[dict]:
    workload = OmegaConf.structured(WorkloadConfig(name=kind, kind=kind, video_tokens=64,
                                                   audio_tokens=8, text_tokens=8, lora_rank=4))
    hw = OmegaConf.load(Path(__file__).parents[1] / "conf" / "hardware" / "h100_pcie5.yaml")
    hw.pop("defaults")
    hardware = OmegaConf.merge(OmegaConf.structured(HardwareConfig), hw)
    spec = build_spec(load_model_config("tiny"), workload)
    path = tmp_path / "good.jsonl"
    write_trace(path, synthesize(spec, workload, hardware))
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def _write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def _trace_case(tmp_path: Path, name: str) -> Path:
    lines = _tiny_trace_lines(tmp_path, "train_lora" if "order" in name else "infer")
    head, recs = lines[0], lines[1:]
    bad = tmp_path / "bad.jsonl"
    if name == "wrong version":
        head["version"] = 99
    elif name == "wrong format":
        head["format"] = "chrome-trace"
    elif name == "truncated":
        recs = recs[:-3]
    elif name == "out of order":
        recs = recs[-1:] + recs[:-1]
    elif name == "record missing a field":
        del recs[5]["compute_ns"]
    elif name == "unknown weight":
        recs[0]["weights"] = ["no.such.weight"]
    elif name == "not json":
        return _write_lines(bad, [json.dumps(head), "{not json"])
    elif name == "empty":
        bad.write_text("")
        return bad
    elif name == "binary":
        bad.write_bytes(gzip.compress(b"x" * 100))
        return bad
    elif name == "negative compute time":
        recs[2]["compute_ns"] = -5
    return _write_lines(bad, [head, *recs])


TRACE_CASES = {
    "wrong version": "version", "wrong format": "format", "truncated": "truncated",
    "out of order": "line", "record missing a field": "compute_ns", "unknown weight": "no.such.weight",
    "not json": "line 2", "empty": "empty", "binary": "trace", "negative compute time": "compute_ns",
}


@pytest.mark.parametrize("name", sorted(TRACE_CASES))
def test_trace_case(run_cli, tmp_path, name):
    path = _trace_case(tmp_path, name)
    _assert_refused(run_cli("+model=tiny", f"trace={path}"), tmp_path / "run", TRACE_CASES[name])


def test_corpus_is_at_least_thirty_cases():
    assert len(CONFIG_CASES) + len(SYNC_DICTS) + len(SHAPE_FILES) + len(TRACE_CASES) >= 30
