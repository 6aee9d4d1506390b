"""The bad-input corpus, round two: one case (or more) per cause of issue 21's CLI side.

Each refusal goes through the real CLI: exit 2, one line on stderr naming the
problem, no traceback, and nothing left behind that looks like a result.
"""
import gzip
import json
import subprocess
import sys
import signal
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from engine.sweep import PROGRESS
from test_bad_input_corpus import _assert_refused, _tiny_trace_lines, _write_lines

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "traces"
LTX8 = ("+model=ltx", "model.num_layers=8")

NUMBER_CASES = {
    "budget nan": (("+model=tiny", "budget=nan"), "budget=nan"),
    "budget inf": (("+model=tiny", "budget=inf"), "finite"),
    "budget overflows": (("+model=tiny", "budget=1e400"), "finite"),
    "bandwidth nan": (("+model=tiny", "hardware.h2d_gbps=nan"), "hardware.h2d_gbps"),
    "zero bandwidth": (("+model=tiny", "hardware.h2d_gbps=0"), "hardware.h2d_gbps"),
    "negative rate": (("+model=tiny", "hardware.matmul_tflops=-1"), "hardware.matmul_tflops"),
    "launch queue of zero": (("+model=tiny", "hardware.launch_queue_depth=0"), "launch_queue_depth"),
    "unsorted small copies": (("+model=tiny", "hardware.small_copy_mib=[4,1,16]"), "small_copy_mib"),
    "slowdown of one": (("+model=tiny", "hardware.compute_slowdown_under_copy=1"), "compute_slowdown"),
    "schema as a profile": (("+model=tiny", "hardware=hardware_schema"), "hardware"),
    "negative context": (("+model=tiny", "workload.context_tokens=-5"), "context_tokens"),
    "negative lora rank": (("+model=tiny", "workload=train_lora", "workload.lora_rank=-3"), "lora_rank"),
    "lora rank of zero": (("+model=tiny", "workload=train_lora", "workload.lora_rank=0"), "lora_rank"),
    "negative slo": (("+model=tiny", "slo.max_step_ms=-1"), "slo.max_step_ms"),
    "decode on a diffusion model": (("+model=tiny", "workload=decode"), "decode"),
    "trace of another model": (("+model=tiny", f"trace={DATA / 'ltx2_infer.jsonl.gz'}"), "recorded with model"),
    "training trace under infer": ((*LTX8, f"trace={DATA / 'ltx2_train_lora.jsonl.gz'}"), "workload"),
    "decode trace under a diffusion model": ((*LTX8, f"trace={DATA / 'llama_decode.jsonl.gz'}"), "recorded with"),
    "execute without a GPU": (("+model=tiny", "mode=execute"), "CUDA"),
}


@pytest.mark.parametrize("name", sorted(NUMBER_CASES))
def test_config_case(run_cli, tmp_path, name):
    args, fragment = NUMBER_CASES[name]
    r = run_cli(*args)
    _assert_refused(r, tmp_path / "run", fragment)
    assert not (tmp_path / "run" / "timeline.json").exists()  # check first, write last


def _user_profile(tmp_path: Path, body: str) -> str:
    conf = tmp_path / "userconf" / "hardware"
    conf.mkdir(parents=True)
    (conf / "mine.yaml").write_text(body)
    return f"hydra.searchpath=[file://{tmp_path / 'userconf'}]"


def test_profile_missing_a_field(run_cli, tmp_path):
    profile = OmegaConf.load(ROOT / "conf" / "hardware" / "h100_pcie5.yaml")
    del profile["hbm_gbps"]
    r = run_cli("+model=tiny", "hardware=mine", _user_profile(tmp_path, OmegaConf.to_yaml(profile)))
    _assert_refused(r, tmp_path / "run", "hbm_gbps")


def test_profile_with_a_yaml_error(run_cli, tmp_path):
    r = run_cli("+model=tiny", "hardware=mine", _user_profile(tmp_path, "name: x\nh2d_gbps: [1,\n"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len([ln for ln in r.stderr.splitlines() if ln.strip()]) == 1, r.stderr


def test_corrupt_gzip_body(run_cli, tmp_path):
    raw = gzip.compress(b"".join(json.dumps(ln).encode() + b"\n" for ln in _tiny_trace_lines(tmp_path)))
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(raw[:20] + bytes(b ^ 0x5A for b in raw[20:60]) + raw[60:])
    _assert_refused(run_cli("+model=tiny", f"trace={bad}"), tmp_path / "run", "corrupt")


def test_trace_with_no_records(run_cli, tmp_path):
    head = dict(_tiny_trace_lines(tmp_path)[0], records=0)
    path = _write_lines(tmp_path / "empty.jsonl", [head])
    _assert_refused(run_cli("+model=tiny", f"trace={path}"), tmp_path / "run", "no kernel records")


def test_trace_of_other_tokens(run_cli, tmp_path):
    path = _write_lines(tmp_path / "t.jsonl", _tiny_trace_lines(tmp_path))  # recorded at 64 video tokens
    r = run_cli("+model=tiny", "workload.video_tokens=32", f"trace={path}")
    _assert_refused(r, tmp_path / "run", "video_tokens")


def test_huge_lookahead_finishes(run_cli, tmp_path):
    t = time.monotonic()
    r = run_cli("+model=tiny", "budget=50", "weights.lookahead=1000000000", "mode=plan")
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t < 60


def test_a_second_writer_of_a_run_directory_is_refused(run_cli, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / ".engine.lock").write_text("")  # another run holds it
    _assert_refused(run_cli("+model=tiny"), run, "another run")


def test_a_run_directory_that_is_a_file(run_cli, tmp_path):
    (tmp_path / "run").write_text("not a directory")
    r = run_cli("+model=tiny")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr


def test_runs_in_the_same_second_get_their_own_directories(tmp_path):
    def start() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "engine", "+model=tiny", "mode=plan"], cwd=tmp_path,
                                env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs = [start(), start()]
    for p in procs:
        assert p.wait(timeout=300) == 0, p.stderr.read()
    reports = list((tmp_path / "outputs" / "runs").glob("*/*/report.json"))
    assert len(reports) == 2


def test_a_second_sweep_into_one_directory_is_refused(run_cli, tmp_path):
    first = run_cli("-m", "+model=tiny", "budget=40,60")
    assert first.returncode == 0, first.stderr
    r = run_cli("-m", "+model=tiny", "budget=40,60")
    assert r.returncode == 2 and "earlier sweep" in r.stderr and "Traceback" not in r.stderr
    assert len(list((tmp_path / "multirun").glob("*/report.json"))) == 2


def test_calibrate_never_overwrites_a_profile(run_cli, tmp_path):
    target = tmp_path / "mine.yaml"
    target.write_text("keep me\n")
    r = run_cli(*LTX8, f"trace={DATA / 'ltx2_infer.jsonl.gz'}", "mode=calibrate", f"out={target}")
    _assert_refused(r, tmp_path / "run", "already exists")
    assert target.read_text() == "keep me\n"


def test_an_interrupted_sweep_summarizes_what_finished(tmp_path):
    budgets = ",".join(str(b) for b in range(40, 240, 4))
    p = subprocess.Popen([sys.executable, "-m", "engine", "-m", f"hydra.sweep.dir={tmp_path}/multirun",
                          "+model=tiny", f"budget={budgets}"], cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(list((tmp_path / "multirun").glob("*/report.json"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, (out[-800:], err[-800:])
    assert "interrupted" in out and "Traceback" not in err
    assert (tmp_path / "multirun" / "summary.md").exists()
    assert not (tmp_path / "multirun" / PROGRESS).exists()
