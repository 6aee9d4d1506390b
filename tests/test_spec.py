"""Model specs from conf/model/*.yaml: exact parameter counts, kernel and weight invariants, errors."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from engine.models import (MODEL_DIR, MODEL_SCHEMAS, available_models, build_spec, load_model_config, load_spec,
                           model_config)
from engine.models.dit import DitModelConfig
from engine.models.llama import LlamaModelConfig
from engine.models.spec import SpecError


def workload(kind: str = "infer", **kw: int) -> SimpleNamespace:
    base = dict(batch=1, video_tokens=6144, audio_tokens=128, text_tokens=256, context_tokens=4096, lora_rank=32)
    return SimpleNamespace(kind=kind, **{**base, **kw})


PARAMS = {
    "ltx": 18_876_174_592,
    "ltxv13b": 13_042_569_344,
    "flux": 11_901_408_320,
    "wan14b": 14_288_491_584,
    "llama8b": 8_030_261_248,
    "llama70b": 70_553_706_496,
}
MODELS = sorted(PARAMS) + ["tiny"]


def spec_of(name: str, kind: str = "infer"):
    return load_spec(name, workload("decode" if name.startswith("llama") else kind))


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_parameter_count_is_exact(name):
    assert spec_of(name).param_count == PARAMS[name]


def test_ltx2_bytes_in_bf16():
    assert spec_of("ltx").model_bytes == 37_752_349_184


def test_every_yaml_is_listed_and_names_its_family_schema():
    assert available_models() == sorted(MODELS)
    for name in MODELS:
        raw = OmegaConf.load(MODEL_DIR / f"{name}.yaml")
        assert list(raw.defaults) == [f"/{raw.family}_schema@_here_", "_self_"]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("kind", ["infer", "train_lora"])
def test_kernels_cover_weights_uniquely(name, kind):
    spec = spec_of(name, kind)
    names = [k.name for k in spec.kernels]
    assert len(names) == len(set(names))
    read = [w for k in spec.kernels for w in k.weights]
    assert set(read) == set(spec.weights)
    for k in spec.kernels:
        assert k.layer == -1 or 0 <= k.layer < spec.num_layers
        if k.op in ("linear", "attention"):
            assert k.flops > 0 and k.io_bytes > 0, k.name
        if k.op == "attention":
            assert not k.weights


def test_ltx2_block_kernels():
    spec = spec_of("ltx")
    block = [k for k in spec.kernels if k.layer == 3]
    local = [k.name.removeprefix("blocks.3.") for k in block]
    attn = lambda p, cross: [f"{p}.q", f"{p}.kv"] if cross else [f"{p}.qkv"]  # noqa: E731
    expected = ["ada"]
    for p, norm, cross in [("attn1", "norm1", False), ("audio_attn1", "audio_norm1", False),
                           ("attn2", "norm2", True), ("audio_attn2", "audio_norm2", True)]:
        expected += [norm, *attn(p, cross), f"{p}.attention", f"{p}.to_out"]
    expected += ["audio_to_video_norm", "video_to_audio_norm"]
    for p in ("audio_to_video_attn", "video_to_audio_attn"):
        expected += [*attn(p, True), f"{p}.attention", f"{p}.to_out"]
    expected += ["norm3", "ff.up", "ff.down", "audio_norm3", "audio_ff.up", "audio_ff.down"]
    assert local == expected
    assert sum(spec.kernel_bytes(k) for k in block) == 386_074_624 * 2
    qkv = next(k for k in block if k.name == "blocks.3.attn1.qkv")
    assert qkv.weights == tuple(f"transformer_blocks.3.attn1.{w}" for w in (
        "to_q.weight", "to_q.bias", "norm_q.weight", "to_k.weight", "to_k.bias", "norm_k.weight",
        "to_v.weight", "to_v.bias"))
    assert qkv.flops == 2 * 6144 * 4096 * 3 * 4096
    core = next(k for k in block if k.name == "blocks.3.attn1.attention")
    assert core.flops == 4 * 1 * 32 * 6144 * 6144 * 128
    a2v = next(k for k in block if k.name == "blocks.3.audio_to_video_attn.attention")
    assert a2v.flops == 4 * 32 * 6144 * 128 * 64  # Q video, K/V audio, audio heads


def test_each_kernel_lists_the_memory_passes_its_forward_runs():
    """Bytes read plus written over the block's activations (engine/models/builder.py)."""
    spec = spec_of("ltx")
    k = {x.name.removeprefix("blocks.3."): x for x in spec.kernels if x.layer == 3}
    act = 6144 * 4096 * 2  # the video stream, bf16
    assert k["norm1"].passes == (("rms_norm", 2 * act), ("broadcast", 4 * act))  # RMSNorm, then modulated
    assert k["norm2"].passes == (("rms_norm", 2 * act),)  # a plain norm before the cross attention
    assert k["audio_to_video_norm"].passes == (("rms_norm", 2 * act), ("broadcast", 4 * act), ("broadcast", 4 * act))
    # a gated residual add: the gate scales (per sample), then the add
    assert k["attn1.to_out"].passes == (("broadcast", 2 * act), ("pointwise", 3 * act))
    assert k["attn2.to_out"].passes == (("pointwise", 3 * act),)  # an ungated one
    assert k["attn1.qkv"].passes == (("rms_norm", 2 * act), ("rms_norm", 2 * act))  # q and k normed, full width
    assert k["ff.up"].passes == (("pointwise", 2 * 6144 * 16384 * 2),)  # GELU over the hidden width
    assert k["attn1.attention"].passes == (("head_copy", 2 * act),)  # heads copied back into rows
    assert k["norm1"].io_bytes == 2 * act + spec.kernel_bytes(k["norm1"])  # in and out, alive together
    decode = load_spec("llama8b", workload("decode", batch=2, context_tokens=1000))
    core = next(x for x in decode.kernels if x.name == "layers.5.self_attn.attention")
    cache = 2 * 1001 * 8 * 128 * 2  # one of k and v, batch 2, bf16
    assert core.passes[:4] == (("pointwise", 2 * cache),) * 4  # each made contiguous, then concatenated
    flux = spec_of("flux")
    proj = next(x for x in flux.kernels if x.name == "single_blocks.0.proj_out")
    rows = 6144 + 256  # [text, image] in the single blocks
    assert proj.passes == (("pointwise", 2 * rows * (3072 + 12288) * 2), ("broadcast", 2 * rows * 3072 * 2),
                           ("pointwise", 3 * rows * 3072 * 2))
    qkv = next(x for x in flux.kernels if x.name == "single_blocks.0.qkv_mlp")
    assert qkv.passes[0] == ("head_rms_norm", 2 * rows * 3072 * 2)  # FLUX norms q and k per head
    # Wan's stream is its patch embedding's output transposed, never made contiguous: its
    # adds keep that layout, and each norm copies it contiguous first.
    wan = {x.name.removeprefix("blocks.3."): x for x in spec_of("wan14b").kernels if x.layer == 3}
    act = 6144 * 5120 * 2
    assert wan["norm2"].passes == (("transposed_copy", 2 * act), ("layer_norm", 2 * act))
    assert wan["attn1.to_out"].passes == (("broadcast", 2 * act), ("transposed", 3 * act))


def test_llama_decode_kernels():
    spec = load_spec("llama8b", workload("decode", batch=2, context_tokens=1000))
    layer = [k.name.removeprefix("layers.5.") for k in spec.kernels if k.layer == 5]
    assert layer == ["input_layernorm", "self_attn.qkv", "self_attn.attention", "self_attn.o_proj",
                     "post_attention_layernorm", "mlp.gate_up", "mlp.down_proj"]
    assert spec.kernels[0].name == "model.embed_tokens" and spec.kernels[-1].name == "lm_head"
    core = next(k for k in spec.kernels if k.name == "layers.5.self_attn.attention")
    assert core.flops == 4 * 2 * 32 * 1 * 1001 * 128
    cache = 2 * 2 * 1001 * 8 * 128 * 2  # k and v, batch 2, bf16
    assert core.io_bytes > cache
    down = next(k for k in spec.kernels if k.name == "layers.5.mlp.down_proj")
    assert down.flops == 2 * 2 * 4096 * 14336


def test_lora_activations_in_ballpark_of_measured_step():
    # The LTX-2-shaped LoRA step of benchmarks/train_bench.py (16 blocks, 6144 video tokens, rank 32):
    # the saved bytes CUDA autograd keeps for it lie in this range.
    cfg = replace(load_model_config("ltx"), num_layers=16)
    spec = build_spec(cfg, workload("train_lora"))
    total = sum(t.nbytes for k in spec.kernels for t in k.saved)
    assert 18e9 < total < 24e9
    names = [t.name for k in spec.kernels for t in k.saved]
    assert len(names) == len(set(names))  # each tensor once, at its first save
    assert all(t.layer == k.layer for k in spec.kernels for t in k.saved)


def test_lora_targets_change_saved_and_flops():
    base = spec_of("tiny", "train_lora")
    untargeted = SimpleNamespace(**vars(workload("train_lora")), lora_targets=["nothing"])
    none = build_spec(load_model_config("tiny"), untargeted)
    saved = lambda s: sum(t.nbytes for k in s.kernels for t in k.saved)  # noqa: E731
    assert saved(none) < saved(base)
    assert sum(k.flops for k in none.kernels) < sum(k.flops for k in base.kernels)


def test_plain_dictconfig_and_dataclass_agree():
    raw = OmegaConf.load(MODEL_DIR / "ltxv13b.yaml")
    a = build_spec(raw, workload())
    b = build_spec(load_model_config("ltxv13b"), workload())
    assert a.kernels == b.kernels and a.weights == b.weights


def test_structured_schema_rejects_bad_key_and_type():
    for bad in ({"dimm": 4096}, {"dim": "wide"}):
        raw = OmegaConf.merge(OmegaConf.load(MODEL_DIR / "ltxv13b.yaml"), bad)
        with pytest.raises(SpecError, match="model.dim"):
            model_config(raw)
    # As Hydra would do it: the family schema first, then the yaml.
    yaml = OmegaConf.load(MODEL_DIR / "llama8b.yaml")
    merged = OmegaConf.merge(OmegaConf.structured(MODEL_SCHEMAS["llama"]),
                             OmegaConf.masked_copy(yaml, [k for k in yaml if k != "defaults"]))
    assert isinstance(OmegaConf.to_object(merged), LlamaModelConfig)


@pytest.mark.parametrize("change, match", [
    (dict(heads=30), r"heads\*model.head_dim = 30\*32 = 960 != model.dim=128"),
    (dict(dim=0), "model.dim=0 must be positive"),
    (dict(variant="sora"), "model.variant='sora'"),
    (dict(variant="wan", patch_size=[1, 2, 2]), "audio_dim > 0 needs variant ltx"),
    (dict(audio_heads=7), r"audio_heads\*model.audio_head_dim"),
    (dict(dtype="int3"), "model.dtype='int3'"),
    (dict(family="llama"), "set family: dit"),
])
def test_inconsistent_dit_configs_raise(change, match):
    cfg = replace(load_model_config("tiny"), **change)
    with pytest.raises(SpecError, match=match):
        build_spec(cfg, workload())


def test_unknown_family_and_missing_field_and_tokens():
    with pytest.raises(SpecError, match="model.family='mamba'"):
        build_spec({"name": "x", "family": "mamba", "num_layers": 2}, workload())
    with pytest.raises(SpecError, match="model.dim"):
        build_spec({"name": "x", "family": "dit", "num_layers": 2, "heads": 1, "head_dim": 8, "ffn_dim": 8},
                   workload())
    with pytest.raises(SpecError, match="workload.audio_tokens=0"):
        load_spec("tiny", workload(audio_tokens=0))
    with pytest.raises(SpecError, match="no model file"):
        load_spec("gpt5", workload())
    with pytest.raises(SpecError, match="kv_heads"):
        build_spec(replace(load_model_config("llama8b"), kv_heads=5), workload("decode"))
    assert isinstance(SpecError("x"), ValueError)


def test_single_stream_ltx_has_no_audio_weights():
    cfg = replace(load_model_config("tiny"), audio_dim=0)
    spec = build_spec(cfg, workload(audio_tokens=0))
    assert not any("audio" in w for w in spec.weights)
    assert isinstance(cfg, DitModelConfig)


def test_building_a_spec_loads_no_torch():
    code = ("import sys; from types import SimpleNamespace; from engine.models import load_spec; "
            "load_spec('tiny', SimpleNamespace(kind='train_lora', batch=1, video_tokens=8, audio_tokens=2, "
            "text_tokens=3, context_tokens=0, lora_rank=4)); assert 'torch' not in sys.modules, 'torch loaded'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
