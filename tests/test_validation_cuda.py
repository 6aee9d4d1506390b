"""mode=validate's measuring on a real GPU: a spec model's rows and a real module's, timed
until settled, their stalls read from stamped steps (CUDA events read only once the steps ended),
the pool's events counted.

Skipped cleanly without an NVIDIA GPU or without cuda-python's runtime bindings.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]
pytest.importorskip("cuda.bindings.runtime", reason="needs cuda-python (pip install cuda-python)")

from hydra import compose, initialize_config_dir  # noqa: E402

from engine import validation as v  # noqa: E402
from engine.config import register  # noqa: E402
from engine.job import prepare  # noqa: E402

CONF = Path(__file__).resolve().parents[1] / "conf"


def _job(tmp_path: Path, *overrides: str, mode: str = "validate"):
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, f"mode={mode}", "hardware=h200", "sim.timeline=false"])
    return prepare(cfg, tmp_path)


def _check(data: dict, rows: list[dict]) -> None:
    assert [r["id"] for r in data["rows"]] == [r["id"] for r in rows] and not data["skipped"]
    assert data["backend"] == "cuda" and data["link"]["h2d_gbps"] > 0
    streamed, resident = (r["measured"] for r in data["rows"])
    assert streamed["h2d_bytes"] > 0 and streamed["stall_ms"] >= 0 and resident["h2d_bytes"] == 0
    for m in (streamed, resident):
        assert len(m["steps_ms"]) > v.TIMED_STEPS and m["reserve_releases"] == 0 and m["relocations"] == 0


def test_a_spec_models_rows_are_measured_on_the_gpu(tmp_path) -> None:
    from engine.models import build_spec

    job = _job(tmp_path, "model=tiny", "workload.video_tokens=64", "workload.audio_tokens=16",
               "workload.text_tokens=8")
    rows = [r for r in v.grid(job.trace) if r["eviction"] == "belady"][:1] + [v.grid(job.trace)[-1]]
    data = v.measure(job.cfg, build_spec(job.cfg.model, job.cfg.workload), job.trace, rows)
    _check(data, rows)
    assert data["peak"] == "pool"


def test_a_real_modules_rows_are_measured_on_the_gpu(tmp_path) -> None:
    pytest.importorskip("transformers", reason="needs the models extra: pip install 'offload-engine[models]'")
    from engine.modes.module import materialize_module
    from engine.modes.module_validate import measure_module

    model = ("model=tiny_llama_hf", "model.module.config.num_hidden_layers=8", "workload.text_tokens=16")
    ckpt = tmp_path / "tiny.safetensors"
    materialize_module(_job(tmp_path / "mat", *model, f"out={ckpt}", mode="materialize"))
    job = _job(tmp_path, *model, f"weights.file={ckpt}")
    rows = [r for r in v.grid(job.trace) if r["eviction"] == "lru"][:1] + [v.grid(job.trace)[-1]]
    data = measure_module(job, job.trace, rows)
    _check(data, rows)
    assert data["peak"] == "pool_torch"


@pytest.mark.parametrize("module", [False, True], ids=["spec", "real module"])
def test_a_training_steps_rows_are_measured_streamed_and_resident(tmp_path, module) -> None:
    """A LoRA step with every frozen weight resident and one with them streamed at the grid's
    first budget: the streamed one copies weights in its steps and times its waits on them."""
    if module:
        pytest.importorskip("transformers", reason="needs the models extra: pip install 'offload-engine[models]'")
        from engine.modes.module import materialize_module
        from engine.modes.module_validate import measure_module

        model = ("model=tiny_llama_hf", "model.module.config.num_hidden_layers=8", "workload.text_tokens=16")
        ckpt = tmp_path / "tiny.safetensors"
        materialize_module(_job(tmp_path / "mat", *model, f"out={ckpt}", mode="materialize"))
        job = _job(tmp_path, *model, "workload=train_lora", "workload.lora_rank=4", f"weights.file={ckpt}")
    else:
        from engine.models import build_spec

        job = _job(tmp_path, "model=tiny", "workload=train_lora", "workload.video_tokens=64",
                   "workload.audio_tokens=16", "workload.text_tokens=8")
    rows = v.grid(job.trace)
    rows = [rows[0], next(r for r in rows if r["budget_mb"] is not None)]
    data = (measure_module(job, job.trace, rows) if module
            else v.measure(job.cfg, build_spec(job.cfg.model, job.cfg.workload), job.trace, rows))
    assert [r["id"] for r in data["rows"]] == [r["id"] for r in rows] and not data["skipped"]
    resident, streamed = (r["measured"] for r in data["rows"])
    assert resident["stall_ms"] >= 0 and streamed["stall_ms"] >= 0 and streamed["h2d_bytes"] > 0
    assert len(streamed["steps_ms"]) > v.TIMED_STEPS and streamed["reserve_releases"] == 0
    rep = v.report(job.trace, data, job.cfg.hardware)
    assert [g["kind"] for g in rep["ranking"]] == ["train_lora"]
