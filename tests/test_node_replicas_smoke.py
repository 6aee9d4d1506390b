"""benchmarks/node_replicas.py end to end on the CPU: two replica processes of the tiny transformers
Llama map one checkpoint, run alone in turn and then together (timings meaningless)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_node_replicas_runs_two_cpu_replicas(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="needs the models extra: pip install 'offload-engine[models]'")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "node_replicas.py"), "--model", "tiny", "--device", "cpu",
         "--budget", "0", "--steps", "2", "--warmup", "1", "--dir", str(tmp_path), "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "out" / "node_replicas.json").read_text())
    assert [r["rank"] for r in result["replicas"]] == [0, 1]
    assert all(len(r["alone"]) == 2 and len(r["together"]) == 2 for r in result["replicas"])
    assert not list(tmp_path.glob("*.safetensors"))  # the checkpoint is deleted after the run
    assert "| 1 | priority |" in done.stdout
