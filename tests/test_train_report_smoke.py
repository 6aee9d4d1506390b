"""benchmarks/train_report.py on a kept GPU run, on the CPU.

The run (benchmarks/results/train-h200-2026-11-29/runs/llama-b: Llama-3.1-8B's LoRA step at 8000
on the lent H200, replaying a recording made on an earlier lease) printed 376.79 ms predicted
beside 367.55 measured and 401.07 for the plain module every weight resident; replayed here,
the report's recording column is that prediction, and the plain step is predicted with no budget.
Needs the models extra (the step is synthesized on the meta device too)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "results" / "train-h200-2026-11-29" / "runs" / "llama-b"
REPORT = ROOT / "benchmarks" / "train_report.py"


def test_the_report_replays_a_lora_run_as_it_was_predicted() -> None:
    pytest.importorskip("transformers", reason="needs the models extra: pip install 'offload-engine[models]'")
    done = subprocess.run([sys.executable, str(REPORT), str(RUN), "--hardware", "h200"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = re.findall(r"^\| llama-b \| llama3\.1-8b-hf \| ([^|]+?) \| ([\d.]+) \| ([^|]+?) \| ([\d.]+) \(",
                      done.stdout, re.M)
    # The streamed row beside the steps its median is taken over (from the run's telemetry: it
    # predates the report's steps_ms); the plain steps were not kept then.
    assert rows == [("8000.0", "367.6", "343.5-382.7", "376.8"), ("all resident", "401.1", "-", "373.0")], done.stdout
    assert "synthesized: 2 rows, mean |error|" in done.stdout
    assert "inside the measured steps' range in 1 of 1 rows that kept them" in done.stdout


def test_a_run_without_its_report_is_one_line(tmp_path) -> None:
    done = subprocess.run([sys.executable, str(REPORT), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert "no report.json and trace.jsonl.gz" in done.stderr


def test_a_file_that_is_no_recording_is_one_line(tmp_path) -> None:
    log = tmp_path / "llama.log"  # a run's log beside its directory, as a glob of runs/* picks up
    log.write_text("not a recording")
    done = subprocess.run([sys.executable, str(REPORT), str(log)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert "neither a run directory nor a recording" in done.stderr
