"""Torch math of spec-built models on the CPU: fetch discipline, LoRA gradients, determinism."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.models import build_spec, forward, load_spec, make_inputs
from engine.models.dit import DitModelConfig
from engine.models.flux import FluxModelConfig
from engine.models.llama import LlamaModelConfig
from engine.models.lora import init_lora, lora_backward, lora_sgd
from engine.models.run import DictSource, MissingWeightError, ScheduleError
from engine.models.seeded import random_weights


def workload(kind: str = "infer", **kw: int) -> SimpleNamespace:
    base = dict(batch=2, video_tokens=24, audio_tokens=6, text_tokens=5, context_tokens=7, lora_rank=4)
    return SimpleNamespace(kind=kind, **{**base, **kw})


class Recording(DictSource):
    def __init__(self, spec, weights):
        super().__init__(spec, weights)
        self.calls: list[int] = []

    def fetch(self, kernel_index):
        self.calls.append(kernel_index)
        return super().fetch(kernel_index)


@pytest.fixture(scope="module")
def tiny():
    spec = load_spec("tiny", workload("train_lora"))
    return spec, random_weights(spec, seed=0)


def run(spec, weights, seed=1, lora=None, source=None):
    inp = make_inputs(spec, workload(spec.meta["workload"]["kind"]), seed=seed)
    return forward(spec, source or DictSource(spec, weights), inp, lora)


def test_tiny_is_small_and_bf16(tiny):
    spec, weights = tiny
    assert spec.model_bytes < 8_000_000
    assert all(t.dtype == torch.bfloat16 for t in weights.values())


def test_infer_forward_shapes_and_fetch_order(tiny):
    spec, weights = tiny
    src = Recording(spec, weights)
    with torch.no_grad():
        out = run(spec, weights, source=src)
    assert src.calls == list(range(len(spec.kernels)))
    assert out["video"].shape == (2, 24, 16) and out["audio"].shape == (2, 6, 16)
    assert all(torch.isfinite(o.float()).all() for o in out.values())


def test_train_lora_gives_gradients_to_every_adapter(tiny):
    spec, weights = tiny
    lora = init_lora(spec, 4, seed=3)
    assert lora and all(t.requires_grad for t in lora.values())
    out = run(spec, weights, lora=lora)
    sum(o.float().pow(2).mean() for o in out.values()).backward()
    for name, t in lora.items():
        assert t.grad is not None and t.grad.abs().sum() > 0, name
    assert all(not w.requires_grad for w in weights.values())


def test_lora_step_helpers(tiny):
    spec, weights = tiny
    lora = init_lora(spec, 4, seed=3)
    inp = make_inputs(spec, workload("train_lora"), seed=1)
    loss = lora_backward(spec, DictSource(spec, weights), inp, lora)
    grads = {k: t.grad.clone() for k, t in lora.items()}
    assert torch.equal(lora_backward(spec, DictSource(spec, weights), inp, lora), loss)
    assert all(torch.equal(t.grad, grads[k]) for k, t in lora.items())  # cleared first, not accumulated
    before = {k: t.detach().clone() for k, t in lora.items()}
    taken = lora_sgd(lora, 0.5)
    assert all(torch.equal(taken[k], grads[k]) and lora[k].grad is None for k in lora)
    assert any(not torch.equal(lora[k], before[k]) for k in lora)


def test_random_weights_drawn_on_the_cpu_device_match(tiny):
    spec, weights = tiny
    drawn = random_weights(spec, 0, device="cpu", draw_on_device=True)
    assert all(torch.equal(drawn[n], w) for n, w in weights.items())


def test_deterministic_for_a_seed(tiny):
    spec, weights = tiny
    with torch.no_grad():
        a, b = run(spec, weights, seed=5), run(spec, weights, seed=5)
        c = run(spec, weights, seed=6)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["video"], c["video"])
    again, other = random_weights(spec, 0), random_weights(spec, 1)
    assert all(torch.equal(again[n], w) for n, w in weights.items())
    assert not torch.equal(other["proj_in.weight"], weights["proj_in.weight"])


def test_missing_weight_raises(tiny):
    spec, weights = tiny
    name = "transformer_blocks.2.attn1.to_k.weight"
    partial = {n: w for n, w in weights.items() if n != name}
    with pytest.raises(MissingWeightError, match="blocks.2.attn1.qkv"):
        run(spec, partial)

    class Forgetful(DictSource):  # a source that hands over less than the kernel reads
        def fetch(self, i):
            return {n: t for n, t in super().fetch(i).items() if n != name}

    with pytest.raises(MissingWeightError, match=name):
        run(spec, weights, source=Forgetful(spec, weights))


def test_wrong_shape_and_unknown_adapter_raise(tiny):
    spec, weights = tiny
    bad = dict(weights, **{"proj_in.weight": torch.zeros(3, 3, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="proj_in.weight has shape"):
        run(spec, bad)
    with pytest.raises(ScheduleError, match="matches no linear"):
        run(spec, weights, lora={"nowhere.lora_A": torch.zeros(1), "nowhere.lora_B": torch.zeros(1)})


def test_spec_from_another_model_is_refused(tiny):
    spec, weights = tiny
    other = load_spec("tiny", workload("train_lora", audio_tokens=6))
    shuffled = type(other)(other.name, other.family, other.num_layers, other.weights,
                           other.kernels[1:2] + other.kernels[:1] + other.kernels[2:], other.meta)
    with pytest.raises(ScheduleError, match="disagree"):
        run(shuffled, weights)


FAMILIES = {
    "wan": DitModelConfig(name="w", variant="wan", num_layers=2, dim=64, heads=4, head_dim=16, ffn_dim=128,
                          in_channels=4, patch_size=[1, 2, 2], text_dim=32, timestep_dim=16),
    "ltxv": DitModelConfig(name="v", num_layers=2, dim=64, heads=4, head_dim=16, ffn_dim=128, in_channels=8,
                           text_dim=32, timestep_dim=16),
    "flux": FluxModelConfig(name="f", num_layers=3, num_double_layers=1, dim=64, heads=4, head_dim=16,
                            ffn_dim=128, in_channels=8, text_dim=32, pooled_dim=24, timestep_dim=16),
    "llama": LlamaModelConfig(name="l", num_layers=2, hidden=64, intermediate=96, heads=4, kv_heads=2,
                              head_dim=16, vocab=100),
}


@pytest.mark.parametrize("family, kind", [("wan", "train_lora"), ("ltxv", "train_lora"), ("flux", "train_lora"),
                                          ("llama", "train_lora"), ("llama", "decode")])
def test_every_family_runs_its_spec(family, kind):
    spec = build_spec(FAMILIES[family], workload(kind))
    weights = random_weights(spec, seed=0)
    src = Recording(spec, weights)
    lora = init_lora(spec, 4, seed=1)
    out = run(spec, weights, lora=lora, source=src)  # forward checks every declared weight is used
    assert src.calls == list(range(len(spec.kernels)))
    sum(o.float().pow(2).mean() for o in out.values()).backward()
    assert all(t.grad is not None for t in lora.values())
