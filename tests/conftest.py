import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def run_cli(tmp_path):
    """Run `python -m engine ...` in a subprocess with its outputs under tmp_path."""

    def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
        env = dict(os.environ, PYTHONPATH=str(ROOT), HYDRA_FULL_ERROR="")
        env.pop("HYDRA_FULL_ERROR")
        # Hydra's flags (-m, --cfg) must precede the overrides.
        flags = [a for a in args if a.startswith("-")]
        overrides = [a for a in args if not a.startswith("-")]
        return subprocess.run(
            [sys.executable, "-m", "engine", *flags, f"hydra.run.dir={tmp_path}/run",
             f"hydra.sweep.dir={tmp_path}/multirun", *overrides],
            cwd=cwd or ROOT, env=env, capture_output=True, text=True, timeout=300)

    return run
