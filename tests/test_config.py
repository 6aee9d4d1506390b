"""Configs compose through Hydra's compose API, and the schema rejects bad input."""
import fnmatch
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from engine.config import available_models, check_config, register
from engine.errors import ConfigError

register()

MODELS = ["auraflow_diffusers", "flux", "flux2_diffusers", "flux_diffusers", "gemma3_12b_hf", "gpt_oss_hf",
          "hunyuan_image_diffusers", "hunyuan_video15_diffusers", "hunyuan_video_diffusers", "llama70b", "llama8b",
          "llama8b_hf", "ltx", "ltx2_diffusers", "ltxv13b", "mistral7b_hf", "mochi_diffusers", "qwen25_14b_hf",
          "qwen3_8b_hf", "qwen3_moe_hf", "qwen_image_diffusers", "sd35_large_diffusers", "tiny", "tiny_llama_hf",
          "wan14b", "wan14b_diffusers", "zimage_diffusers"]


def _compose(*overrides: str):
    with initialize_config_module(config_module="conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_every_shipped_model_is_listed():
    assert available_models() == MODELS


@pytest.mark.parametrize("model", MODELS)
def test_every_model_composes_and_validates(model):
    cfg = _compose(f"model={model}", "budget=16000")
    check_config(cfg)
    assert cfg.model.name
    assert cfg.budget == 16000.0


def test_defaults_are_the_documented_ones():
    cfg = _compose("model=ltx")
    assert cfg.hardware.name == "h100_pcie5"
    assert cfg.workload.name == "infer" and cfg.workload.video_tokens == 6144
    assert cfg.activations.mode == "off"
    assert cfg.budget is None and cfg.trace is None


@pytest.mark.parametrize("hardware", ["h100_pcie5", "rtx4090", "rtx3090ti"])
def test_hardware_profiles_compose(hardware):
    cfg = _compose("model=tiny", f"hardware={hardware}")
    assert cfg.hardware.h2d_gbps > 0 and cfg.hardware.source


def test_an_installed_package_carries_every_config_file():
    """A non-editable install holds only what pyproject's package-data names: every file under
    conf/ (profiles, their kernel tables) must match one of its patterns."""
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[1]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["conf"]
    files = [p.relative_to(root / "conf") for p in (root / "conf").rglob("*")
             if p.is_file() and p.suffix not in (".py", ".pyc")]
    assert files and all(any(f.match(pat) or fnmatch.fnmatch(str(f), pat) for pat in patterns) for f in files), \
        [str(f) for f in files if not any(f.match(pat) or fnmatch.fnmatch(str(f), pat) for pat in patterns)]


@pytest.mark.parametrize("override", [
    "weights.nonsense=1",          # unknown key in a group
    "nonsense=1",                  # unknown top-level key
    "budget=abc",                  # wrong type
    "hardware.h2d_gbps=fast",      # wrong type in a group
    "model.num_layers=many",
])
def test_schema_rejects_at_compose_time(override):
    with pytest.raises((ConfigCompositionException, ValidationError)):
        _compose("model=tiny", override)


@pytest.mark.parametrize("overrides, fragment", [
    (["model=tiny", "budget=-5"], "negative"),
    (["model=tiny", "weights.eviction=fifo"], "weights.eviction='fifo'"),
    (["model=tiny", "mode=dance"], "mode='dance'"),
    (["model=tiny", "trace=/no/such/trace.jsonl"], "does not exist"),
    (["model=tiny", "weights.lookahead=-1"], "weights.lookahead=-1 is not a number of kernels"),
    # an int or auto, which no schema type says: check_config does
    (["model=tiny", "weights.lookahead=two"], "weights.lookahead='two' is not a number of kernels; give an "
                                              "integer >= 0 or auto"),
    (["model=tiny", "weights.lookahead=2.5"], "weights.lookahead=2.5 is not"),
    (["model=tiny", "weights.lookahead=true"], "weights.lookahead=True is not"),
])
def test_check_config_names_the_problem(overrides, fragment):
    cfg = _compose(*overrides)
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace("'", "'")):
        check_config(cfg)


def test_the_allowed_modes_are_the_registrys():
    """engine.modes.MODES is the one list: config accepts exactly its names, and each runs a function."""
    from engine.modes import MODES, runner

    with pytest.raises(ConfigError, match=", ".join(MODES)):
        check_config(_compose("model=tiny", "mode=dance"))
    for name in MODES:
        check_config(_compose("model=tiny", f"mode={name}"))
        assert callable(runner(name))


def test_model_is_mandatory_in_the_defaults():
    with pytest.raises(ConfigCompositionException, match="You must specify 'model'"):
        _compose("budget=1")
