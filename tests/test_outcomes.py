"""engine.modules.outcomes: the plain module's outputs kept distinct, and offloaded outputs
compared with them on the device, in chunks, by the rule the spec models' execute applies."""
from __future__ import annotations

import math

import torch

from engine.modules import outcomes
from engine.modules.outcomes import Comparison, distinct

BF16 = torch.bfloat16


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=BF16)


def run(plain: list[torch.Tensor], offloaded: list[torch.Tensor]) -> outcomes.Verdict:
    c = Comparison(plain, len(plain))
    for out in offloaded:
        c.add(out)
    return c.verdict()


def test_distinct_keeps_the_first_of_each_and_tells_signed_zeros_apart() -> None:
    a, b = t(1.0, 2.0), t(1.0, 2.015625)
    kept = distinct([a, a.clone(), b, a.clone(), b.clone(), t(-0.0, 2.0)])
    assert len(kept) == 3 and kept[0] is a and kept[1] is b
    assert len(distinct([t(0.0), t(-0.0)])) == 2


def test_a_deterministic_plain_module_passes_only_bitwise() -> None:
    a = t(1.0, 2.0, 3.0)
    v = run([a, a.clone()], [a.clone(), a.clone()])
    assert v.bitwise == [True, True] and v.passed and v.outcomes == 1 and v.spread == 0.0
    assert v.text() == "True"
    v = run([a, a.clone()], [a.clone(), t(1.0, 2.0, 3.015625)])
    assert v.bitwise == [True, False] and not v.passed and v.unmatched_diff == 0.015625
    assert v.text() == "False: 1 of 2 steps match none of the plain module's 1 output, the farthest 0.0156 from the nearest"
    assert v.summary() == {"outcomes": 1, "plain_steps": 2, "spread": 0.0, "unmatched_max_diff": 0.015625,
                           "passed": False}


def test_an_unseen_outcome_passes_within_the_plain_outputs_own_spread() -> None:
    a, b = t(1.0, 2.0), t(1.0, 2.0625)  # the plain module's two outcomes, 0.0625 apart
    v = run([a, b, a.clone()], [b.clone(), t(1.0, 2.03125), a.clone()])
    assert v.bitwise == [True, False, True] and v.outcomes == 2 and v.plain_steps == 3
    assert v.spread == 0.0625 and v.unmatched_diff == 0.03125 and v.passed
    assert v.text() == ("True in 2 of 3 steps (its own 3 steps gave 2 different outputs, up to 0.0625 apart); "
                        "the other 1 lie within 0.0312 of one, inside that spread")
    far = run([a, b], [t(1.0, 2.25)])
    assert far.unmatched_diff == 0.1875 and not far.passed


def test_chunks_give_what_one_pass_gives(monkeypatch) -> None:
    """Compared a few elements at a time (the temporaries bounded), a difference in the last
    chunk alone is found and measured exactly."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1000, generator=g).to(BF16)
    b = a.clone()
    b[-1] += 1.0
    whole = run([a], [a.clone(), b])
    monkeypatch.setattr(outcomes, "CHUNK_ELEMENTS", 7)
    chunked = run([a], [a.clone(), b])
    assert whole == chunked and chunked.bitwise == [True, False]
    assert chunked.unmatched_diff == (b[-1] - a[-1]).abs().float().item() > 0.9


def test_a_wrong_shape_or_dtype_or_a_nan_is_infinitely_far() -> None:
    a, b = t(1.0, 2.0), t(1.0, 2.0625)
    assert run([a, b], [t(1.0, 2.0, 3.0)]).unmatched_diff == math.inf
    assert run([a, b], [a.float()]).unmatched_diff == math.inf
    nan = run([a, b], [t(1.0, float("nan"))])
    assert nan.unmatched_diff == math.inf and not nan.passed


def test_it_holds_only_the_distinct_plain_outputs() -> None:
    a = torch.zeros(256, dtype=BF16)
    c = Comparison([a, a.clone(), a.clone()], 3)
    assert c.held_bytes == 512 and c.outcomes == [a]


def test_the_plain_run_keeps_large_outputs_distinct_as_it_goes(monkeypatch) -> None:
    """plain_infer_run hands back one output a step, or, past PLAIN_OUTPUT_BYTES together (an LM
    prefill's logits), only the distinct ones: a module alternating two outputs keeps two."""
    from types import SimpleNamespace

    from engine.modes import module as module_mode

    class Alternating(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return x + (self.calls % 2)

    cfg = SimpleNamespace(workload=SimpleNamespace(steps=5, loop="free"))
    inputs = {"x": torch.zeros(4, dtype=BF16)}
    outputs, times = module_mode.plain_infer_run(cfg, Alternating(), torch.device("cpu"), inputs)
    assert len(outputs) == 5 and len(times) == 5
    monkeypatch.setattr(module_mode, "PLAIN_OUTPUT_BYTES", 0)
    outputs, times = module_mode.plain_infer_run(cfg, Alternating(), torch.device("cpu"), inputs)
    assert len(outputs) == 2 and len(times) == 5
    assert Comparison(outputs, 5).verdict().plain_steps == 5
