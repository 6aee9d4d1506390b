import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_WORKLOAD = dict(name="infer", kind="infer", batch=1, video_tokens=24, audio_tokens=6, text_tokens=5,
                     context_tokens=0, lora_rank=0, steps=3, loop="free")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model on the CPU: its spec, a weight file, inputs, the all-resident
    outputs, one forward's access order and its synthesized trace."""
    import torch
    from omegaconf import OmegaConf

    from engine.config import load_hardware
    from engine.models import forward, load_spec, make_inputs
    from engine.models.run import DictSource
    from engine.policy import AccessOrder
    from engine.models.synthesize import synthesize
    from engine.weightfile import WeightFile, materialize

    workload = SimpleNamespace(**TINY_WORKLOAD)
    spec = load_spec("tiny", workload)
    path = materialize(spec, tmp_path_factory.mktemp("w") / "tiny.ptd", seed=1, device="cpu")
    wf = WeightFile(path, spec)
    inputs = make_inputs(spec, workload, seed=2)
    with torch.no_grad():
        reference = forward(spec, DictSource(spec, {n: t.clone() for n, t in wf.tensors().items()}), inputs)
    order = AccessOrder(tuple(k.name for k in spec.kernels), tuple(k.weights for k in spec.kernels),
                        {n: w.nbytes for n, w in spec.weights.items()})
    trace = synthesize(spec, OmegaConf.create(TINY_WORKLOAD), load_hardware("h100_pcie5"))
    yield SimpleNamespace(spec=spec, wf=wf, path=path, inputs=inputs, reference=reference, order=order,
                          trace=trace, workload=dict(TINY_WORKLOAD))
    wf.close()


@pytest.fixture
def run_cli(tmp_path):
    """Run `python -m engine ...` in a subprocess with its outputs under tmp_path."""

    def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
        # The repository first; what the caller's path adds (a device's wheels) after it.
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, PYTHONPATH=path, HYDRA_FULL_ERROR="")
        env.pop("HYDRA_FULL_ERROR")
        # Hydra's flags (-m, --cfg) must precede the overrides.
        flags = [a for a in args if a.startswith("-")]
        overrides = [a for a in args if not a.startswith("-")]
        return subprocess.run(
            [sys.executable, "-m", "engine", *flags, f"hydra.run.dir={tmp_path}/run",
             f"hydra.sweep.dir={tmp_path}/multirun", *overrides],
            cwd=cwd or ROOT, env=env, capture_output=True, text=True, timeout=300)

    return run
