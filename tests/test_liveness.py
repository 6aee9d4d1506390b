"""engine/models/liveness.py: the forward's live activation bytes, traced on the meta device."""
from __future__ import annotations

from types import SimpleNamespace

from omegaconf import OmegaConf

from engine.config import load_hardware
from engine.models import load_spec
from engine.models.liveness import activation_peak_bytes
from engine.models.synthesize import synthesize


def workload(kind: str = "infer", **kw: int) -> SimpleNamespace:
    base = dict(batch=1, video_tokens=6144, audio_tokens=128, text_tokens=256, context_tokens=4096, lora_rank=0)
    return SimpleNamespace(kind=kind, **{**base, **kw})


def test_the_full_ltx2_forward_holds_what_the_gpu_measured_beside_its_weights():
    """mode=execute on the H100 (benchmarks/results/real-2026-11-26/full-ltx-spec-16000): torch's
    peak beside the pool was 707.6 MB; the trace misses only cuBLAS's workspace, tens of MB."""
    spec = load_spec("ltx", workload())
    peak = activation_peak_bytes(spec, workload())
    assert 0.9 * 707.6e6 <= peak <= 707.6e6
    stream = 6144 * 4096 * 2  # the video stream in bf16
    assert peak > max(k.io_bytes - spec.kernel_bytes(k) for k in spec.kernels) + stream


def test_the_shortest_model_with_every_kind_of_block_twice_traces_the_whole_models_peak():
    from engine.models import shortest
    from engine.models.liveness import traced_peak_bytes

    for name, kind in (("flux", "infer"), ("llama8b", "decode")):  # two kinds of block; a cache per layer
        spec = load_spec(name, workload(kind))
        assert shortest(spec, workload(kind)).num_layers < spec.num_layers
        assert activation_peak_bytes(spec, workload(kind)) == traced_peak_bytes(spec, workload(kind))


def test_attention_counts_as_the_fused_kernel_and_a_decodes_cache_counts_as_held():
    spec = load_spec("llama8b", workload("decode", context_tokens=4096))
    cache = 32 * 2 * 4096 * 8 * 128 * 2  # every layer's k and v, bf16
    peak = activation_peak_bytes(spec, workload("decode", context_tokens=4096))
    assert cache < peak < cache + 32 * 4096 * 4096 * 2  # the cache, never a score matrix
    longer = activation_peak_bytes(spec, workload("decode", context_tokens=8192))
    assert longer - peak >= cache  # twice the context, twice the cache


def test_a_synthesized_inference_carries_its_peak_and_a_training_step_does_not():
    hw = load_hardware("h100_pcie5")
    infer = OmegaConf.create({"name": "infer", "kind": "infer", "batch": 1, "video_tokens": 64, "audio_tokens": 16,
                              "text_tokens": 16, "context_tokens": 0, "lora_rank": 0})
    t = synthesize(load_spec("tiny", infer), infer, hw)
    assert t.header["activation_peak_bytes"] == activation_peak_bytes(load_spec("tiny", infer), infer) > 0
    train = OmegaConf.merge(infer, {"name": "train", "kind": "train_lora", "lora_rank": 4})
    assert "activation_peak_bytes" not in synthesize(load_spec("tiny", train), train, hw).header
