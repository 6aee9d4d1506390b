"""engine.offload as a hostile (or hurried) user calls it: clear errors, the module left whole."""
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import engine
from engine.errors import ConfigError, ExecutorError, WeightFileError
from engine.executor.setup import bitwise_equal
from engine.models import load_spec
from engine.weightfile import WeightFile, materialize


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _offload(net: nn.Module, **kw):
    kw.setdefault("budget_mb", None)
    kw.setdefault("example_inputs", (torch.randn(2, 16),))
    return engine.offload(net, backend="cpu", **kw)


def test_offloading_an_offloaded_module_is_refused():
    net = Net()
    x = torch.randn(2, 16)
    with torch.no_grad():
        ref = net(x)
    h = _offload(net)
    with pytest.raises(ExecutorError, match="already offloaded"):
        _offload(net)
    with torch.no_grad():
        assert bitwise_equal(net(x), ref)
    h.remove()
    h2 = _offload(net)  # after remove() it can be offloaded again
    with torch.no_grad():
        assert bitwise_equal(net(x), ref)
    h2.remove()
    assert all(torch.isfinite(p).all() for p in net.parameters())


def test_one_tensor_is_one_argument():
    net = Net()
    x = torch.randn(3, 16)
    with torch.no_grad():
        ref = net(x)
    h = _offload(net, example_inputs=x)
    with torch.no_grad():
        assert bitwise_equal(net(x), ref)
    h.remove()


@pytest.mark.parametrize("budget", ["16000", float("nan"), float("inf"), -1, True])
def test_a_budget_that_is_not_a_number_of_mb(budget):
    net = Net()
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(ConfigError, match="budget_mb"):
        _offload(net, budget_mb=budget)
    assert all(bitwise_equal(a, b) for a, b in zip(before, net.parameters()))


def test_eviction_auto_picks_the_fastest_predicted():
    net = Net()
    x = torch.randn(2, 16)
    with torch.no_grad():
        ref = net(x)
    size = sum(p.numel() * p.element_size() for p in net.a.parameters()) / 1e6
    h = _offload(net, budget_mb=10 * size, eviction="auto", example_inputs=(x,))
    assert h.eviction in ("lru", "belady", "priority")
    assert h.prediction["candidates"][f"{h.eviction}/2"] == min(h.prediction["candidates"].values())
    with torch.no_grad():
        for _ in range(3):
            assert bitwise_equal(net(x), ref)
    h.remove()


def test_unknown_eviction():
    with pytest.raises(ConfigError, match="auto"):
        _offload(Net(), eviction="fifo")


def test_a_submodule_called_on_its_own():
    class Three(Net):
        def __init__(self) -> None:
            super().__init__()
            self.c = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(super().forward(x))

    net = Three()
    h = _offload(net, budget_mb=0.0032, eviction="lru", lookahead=0)  # streamed: two of three linears fit
    assert not h.bound
    with torch.no_grad(), pytest.raises(ExecutorError, match="called on its own"):
        net.a(torch.randn(2, 16))
    h.remove()


def test_divergence_advice_says_remove_first():
    class Branchy(Net):
        def forward(self, x: torch.Tensor, skip: bool = False) -> torch.Tensor:
            return self.a(x) if skip else self.b(torch.relu(self.a(x)))

    net = Branchy()
    h = _offload(net, example_inputs={"x": torch.randn(2, 16), "skip": True})
    with torch.no_grad(), pytest.raises(ExecutorError, match="remove"):
        net(torch.randn(2, 16))
    h.remove()


def test_resident_parameters_outside_the_budget_warn():
    class Scaled(Net):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * self.scale

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h = _offload(Scaled())
    assert any("resident outside the budget" in str(w.message) for w in caught)
    assert h.resident_params == ["scale"]
    h.remove()


def test_nan_outputs_compare_equal_by_bits():
    a = torch.tensor([float("nan"), 1.0])
    assert bitwise_equal(a, a.clone())
    assert not bitwise_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not bitwise_equal(a, a.to(torch.float64))


# Weight files: a second writer, SIGTERM, truncation while in use.

WORKLOAD = SimpleNamespace(kind="infer", batch=1, video_tokens=64, audio_tokens=8, text_tokens=8,
                           context_tokens=0, lora_rank=0)


def test_a_second_materialize_of_one_file_is_refused(tmp_path):
    spec = load_spec("tiny", WORKLOAD)
    (tmp_path / "w.ptd.partial").write_bytes(b"another writer")
    with pytest.raises(WeightFileError, match="another materialize"):
        materialize(spec, tmp_path / "w.ptd", device="cpu")
    assert (tmp_path / "w.ptd.partial").read_bytes() == b"another writer"  # not ours to delete
    assert not (tmp_path / "w.ptd").exists()


def test_sigterm_during_materialize_leaves_nothing(tmp_path):
    out = tmp_path / "big.ptd"
    code = ("from types import SimpleNamespace as S; from engine.models import load_spec; "
            "from engine.weightfile import materialize; "
            "w = S(kind='infer', batch=1, video_tokens=64, audio_tokens=8, text_tokens=8, context_tokens=0, "
            f"lora_rank=0); materialize(load_spec('llama8b', w), {str(out)!r}, device='cpu')")
    p = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1])),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partial = tmp_path / "big.ptd.partial"
    deadline = time.monotonic() + 60
    while not partial.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert partial.exists()
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=60)
    assert not partial.exists() and not out.exists()


def test_a_weight_file_truncated_in_use(tmp_path):
    spec = load_spec("tiny", WORKLOAD)
    path = materialize(spec, tmp_path / "w.ptd", device="cpu")
    wf = WeightFile(path, spec)
    wf.check_intact()
    os.truncate(path, path.stat().st_size - 4096)
    with pytest.raises(WeightFileError, match="truncated"):
        wf.check_intact()
    wf.close()
