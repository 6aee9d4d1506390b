"""offload() on plain torch modules (cpu backend): bitwise outputs, restore, and its loud failures."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine
from engine.errors import BelowFloorError, ConfigError, ExecutorError
from engine.policy.weights import WeightResidency


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.gain = nn.Parameter(torch.randn(d))  # owned by a module with children: kept resident

    def forward(self, x):
        return x + self.gain * self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d: int = 32, n: int = 4, tied: bool = False):
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 8)
        self.unused = nn.Linear(d, d)
        self.register_buffer("scale", torch.tensor(0.5))
        if tied:
            self.head.weight = nn.Parameter(self.embed.weight.t().contiguous())
            self.out = nn.Linear(d, 8, bias=False)
            self.out.weight = self.head.weight  # one parameter, two leaf modules

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        y = self.head(h) * self.scale
        if hasattr(self, "out"):
            y = y + self.out(h)
        return y


def make(**kw) -> tuple[Net, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    net = Net(**kw).eval()
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        ref = net(x)
    return net, x, ref


@pytest.mark.parametrize("eviction", ["lru", "belady", "priority"])
@pytest.mark.parametrize("grouping,budget_mb", [("leaf", 0.06), ("leaf", 0.1), ("leaf", None),
                                                 ("block", 0.11), ("block", 0.2), ("block", None)])
def test_offload_matches_bitwise_and_restores(eviction, grouping, budget_mb):
    net, x, ref = make()
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    h = engine.offload(net, budget_mb=budget_mb, example_inputs=(x,), eviction=eviction, backend="cpu",
                       grouping=grouping)
    assert "unused" not in h.order.kernels
    if grouping == "leaf":
        assert h.order.kernels[:2] == ("embed", "blocks.0.norm")
        assert set(h.resident_params) == {f"blocks.{i}.gain" for i in range(4)}
    else:  # one kernel per block, reading one packed span of all its weights (gain included)
        assert h.order.kernels == ("embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head")
        assert h.order.reads[1] == ("blocks.0.*",)
        assert h.resident_params == []
    # Every weight fits: bound at set-up, the hooks off (the unused leaf keeps its loud one).
    assert h.bound == (budget_mb is None or budget_mb * 1e6 >= sum(h.order.sizes.values()))
    hooked = [n for n, m in net.named_modules() if m._forward_pre_hooks or m._forward_hooks]
    if h.bound:
        assert hooked == ["unused"]
    else:
        assert set(h.order.kernels) < set(hooked)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(net(x), ref)
    rows = h.telemetry()
    assert len(rows) == (4 if h.bound else 3)  # bound: first the set-up's step that fetched every weight
    if h.bound:
        assert [(r["h2d_bytes"], r["hits"]) for r in rows[1:]] == [(0, len(h.order))] * 3
    if budget_mb is not None:
        assert all(r["peak_device_bytes"] <= budget_mb * 1e6 for r in rows)
    h.remove()
    assert all(torch.equal(p, before[n]) for n, p in net.named_parameters())
    assert "forward" not in net.__dict__
    with torch.no_grad():
        assert torch.equal(net(x), ref)


def test_reconfigure_runs_each_policy_on_one_set_up():
    """One set-up, then budgets streamed, bound and streamed again: each forward bitwise the
    plain module's, each executor's telemetry its own, the bytes by the policy's copies; a
    bad policy or a budget under the floor leaves the handle running as it was."""
    net, x, ref = make()
    h = engine.offload(net, budget_mb=0.11, example_inputs=(x,), eviction="lru", lookahead=1, backend="cpu")
    model = sum(h.order.sizes.values())
    for budget, eviction, lookahead in [(0.2, "belady", 4), (None, "priority", 1), (0.11, "priority", 2)]:
        h.reconfigure(budget_mb=budget, eviction=eviction, lookahead=lookahead)
        fits = budget is None or budget * 1e6 >= model
        assert (h.eviction, h.lookahead, h.bound) == (eviction, lookahead, fits)
        with torch.no_grad():
            assert all(torch.equal(net(x), ref) for _ in range(2))
        rows = h.telemetry()
        assert len(rows) == (3 if fits else 2)  # bound: the set-up's step that fetched every weight first
        assert (rows[-1]["h2d_bytes"] == 0) == fits
    executor = h.executor
    floor = WeightResidency(h.order, None, "priority", 2).floor.bytes
    with pytest.raises(BelowFloorError):
        h.reconfigure(budget_mb=floor / 2e6, eviction="lru", lookahead=2)
    with pytest.raises(ConfigError, match="eviction='fifo'"):
        h.reconfigure(budget_mb=0.2, eviction="fifo", lookahead=2)
    with pytest.raises(ConfigError, match="lookahead=-1"):
        h.reconfigure(budget_mb=0.2, eviction="lru", lookahead=-1)
    assert h.executor is executor
    with torch.no_grad():
        assert torch.equal(net(x), ref)
    h.remove()
    with torch.no_grad():
        assert torch.equal(net(x), ref)


def test_fetches_through_a_timer():
    """Forwards inside fetches_through fetch each kernel through the wrapper, once a kernel."""
    net, x, ref = make()
    h = engine.offload(net, budget_mb=0.11, example_inputs=(x,), eviction="priority", backend="cpu")

    class Counting:
        def __init__(self, inner):
            self.inner, self.fetched = inner, []

        def fetch(self, i):
            self.fetched.append(i)
            return self.inner.fetch(i)

    counting = Counting(h.executor)
    with torch.no_grad():
        with h.fetches_through(counting):
            assert torch.equal(net(x), ref)
        assert torch.equal(net(x), ref)
    assert counting.fetched == list(range(len(h.order)))
    h.remove()


def test_decision_parity_with_a_bare_policy():
    net, x, _ = make()
    h = engine.offload(net, budget_mb=0.07, example_inputs=(x,), eviction="belady", lookahead=3, backend="cpu",
                       grouping="leaf")
    with torch.no_grad():
        net(x)
        net(x)
    bare = WeightResidency(h.order, 70_000, "belady", 3)
    for _ in range(2):
        for i in range(len(h.order)):
            bare.issue(i)
    assert h.executor.log == bare.log
    h.remove()


def test_a_read_outside_the_owner_and_tied_weights():
    net, x, ref = make(tied=True)

    class Peek(nn.Module):  # reads a leaf's weight from the parent
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x) + self.inner.embed.bias.sum()

    outer = Peek(net)
    with torch.no_grad():
        ref = outer(x)
    h = engine.offload(outer, budget_mb=None, example_inputs=(x,), backend="cpu", grouping="leaf")
    assert "inner.embed.bias" in h.resident_params
    shared = "inner.head.weight"
    assert shared in h.resident_params  # read by head and out: one weight, kept on the device
    assert not any(shared in r for r in h.order.reads)
    with torch.no_grad():
        assert torch.equal(outer(x), ref)
    h.remove()
    assert outer.inner.out.weight is outer.inner.head.weight


def test_below_floor_names_the_minimum_and_leaves_the_module_alone():
    net, x, ref = make()
    with pytest.raises(BelowFloorError, match=r"use budget=1 or more"):
        engine.offload(net, budget_mb=0.001, example_inputs=(x,), backend="cpu")
    assert "forward" not in net.__dict__
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in net.modules())
    with torch.no_grad():
        assert torch.equal(net(x), ref)


def test_divergence_when_another_path_runs():
    class Branchy(Net):
        def forward(self, x, skip: bool = False):
            h = self.embed(x)
            for b in self.blocks[: 2 if skip else 4]:
                h = b(h)
            return self.head(h)

    torch.manual_seed(0)
    net = Branchy().eval()
    x = torch.randn(2, 5, 8)
    h = engine.offload(net, budget_mb=0.1, example_inputs=(x,), backend="cpu", grouping="leaf")
    with torch.no_grad(), pytest.raises(ExecutorError, match=r"schedule divergence at kernel 7: head ran where "
                                                             r"the recording ran blocks.2.norm; .*offload or record again"):
        net(x, skip=True)
    h.remove()
    h = engine.offload(net, budget_mb=0.11, example_inputs=(x,), backend="cpu")
    with torch.no_grad(), pytest.raises(ExecutorError, match=r"schedule divergence at kernel 3: head ran where "
                                                             r"the recording ran blocks.2"):
        net(x, skip=True)
    h.remove()
    with torch.no_grad():
        ref = net(x, skip=True)
    h = engine.offload(net, budget_mb=None, example_inputs=(x,), backend="cpu")
    with torch.no_grad():  # every weight bound: any path the recorded kernels take runs
        assert h.bound and torch.equal(net(x, skip=True), ref)
    h.remove()

    net = Net().eval()
    h = engine.offload(net, budget_mb=None, example_inputs=(x,), backend="cpu")
    with torch.no_grad(), pytest.raises(ExecutorError, match="unused ran but did not run in the recording"):
        net.unused(torch.randn(32))
    h.remove()


def test_grad_mode_is_refused():
    net, x, _ = make()
    h = engine.offload(net, budget_mb=None, example_inputs=(x,), backend="cpu")
    with pytest.raises(ExecutorError, match="under torch.no_grad"):
        net(x)
    h.remove()


def test_concurrent_forward_on_one_module_fails_at_once():
    net, x, ref = make()
    inside, release = threading.Event(), threading.Event()

    def slow(module, inputs):
        inside.set()
        release.wait(10)

    h = engine.offload(net, budget_mb=None, example_inputs=(x,), backend="cpu")
    hook = net.blocks[0].fc1.register_forward_pre_hook(slow)
    results = []

    def first():
        with torch.no_grad():
            results.append(net(x))

    t = threading.Thread(target=first)
    t.start()
    assert inside.wait(10)
    with torch.no_grad(), pytest.raises(ExecutorError, match="concurrent execute"):
        net(x)
    release.set()
    t.join(10)
    assert torch.equal(results[0], ref)
    hook.remove()
    h.remove()


def test_unknown_backend():
    net, x, _ = make()
    with pytest.raises(ExecutorError, match="backend='tpu'"):
        engine.offload(net, budget_mb=None, example_inputs=(x,), backend="tpu")


def test_a_transformers_model_from_a_config():
    transformers = pytest.importorskip("transformers", reason="needs the models extra: pip install 'offload-engine[models]'")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    h = engine.offload(model, budget_mb=0.444, example_inputs={"input_ids": ids}, backend="cpu")
    with torch.no_grad():
        assert all(torch.equal(model(input_ids=ids).logits, ref) for _ in range(2))
    assert h.telemetry()[-1]["h2d_bytes"] > 0
    h.remove()


def test_a_diffusers_model_from_a_config():
    diffusers = pytest.importorskip("diffusers", reason="needs the models extra: pip install 'offload-engine[models]'")
    torch.manual_seed(0)
    model = diffusers.LTXVideoTransformer3DModel(in_channels=16, out_channels=16, num_attention_heads=4,
                                                 attention_head_dim=16, cross_attention_dim=64, num_layers=2,
                                                 caption_channels=32).eval()
    f, hh, ww = 2, 4, 4
    inputs = dict(hidden_states=torch.randn(1, f * hh * ww, 16), encoder_hidden_states=torch.randn(1, 7, 32),
                  timestep=torch.tensor([500]), encoder_attention_mask=torch.ones(1, 7), num_frames=f,
                  height=hh, width=ww, return_dict=False)
    with torch.no_grad():
        ref = model(**inputs)[0]
    h = engine.offload(model, budget_mb=0.9, example_inputs=inputs, backend="cpu")
    assert "scale_shift_table" in h.resident_params  # owned by the model itself, read between its children
    assert h.order.reads[h.order.kernels.index("transformer_blocks.0")] == ("transformer_blocks.0.*",)
    with torch.no_grad():
        assert all(torch.equal(model(**inputs)[0], ref) for _ in range(2))
    h.remove()


def test_weights_that_fit_by_their_bytes_but_not_as_placed_are_streamed(monkeypatch):
    """On a backend of granules each streamed weight takes whole ones: bytes that fit the
    budget may not fit as placed, and binding them would evict some in the bind step (their
    parameters then read reused memory). The decision is the placement's."""
    from engine.policy.placement import all_resident

    monkeypatch.setattr("engine.executor.runtime.backend_granule", lambda name: 4096)
    net, x, ref = make()
    probe = engine.offload(net, budget_mb=None, example_inputs=(x,), backend="cpu")
    placed = probe.executor.placement
    raw = sum(probe.order.sizes.values())
    probe.remove()
    budget = raw + 1  # every weight's bytes fit; as placed they need more
    assert placed.capacity_bytes > budget
    h = engine.offload(net, budget_mb=budget / 1e6, example_inputs=(x,), eviction="priority", lookahead=1,
                       backend="cpu")
    assert not h.bound and not all_resident(h.executor.placement)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(net(x), ref)
    assert h.telemetry()[-1]["evictions"] > 0  # the weights take turns, as the policy planned
    h.remove()


def test_a_budget_over_the_model_sizes_the_pool_and_its_prediction_by_the_model():
    """A budget larger than every weight holds every weight: the pool is made for the model
    (a pool capped at 1 PB could not be made on a GPU), and the simulator's device bound says so."""
    from engine.config import load_hardware
    from engine.modules.offload import predict

    net, x, ref = make()
    h = engine.offload(net, budget_mb=1e9, example_inputs=(x,), eviction="priority", lookahead=1, backend="cpu")
    placed = h.executor.placement
    assert placed.capacity_bytes >= 10**15 and h.executor.backend.cap_bytes == placed.pool_bytes
    assert placed.pool_bytes == sum(placed.order.sizes.values()) + placed.resident_bytes
    with torch.no_grad():
        assert torch.equal(net(x), ref)
    h.remove()
    hw = load_hardware("h100_pcie5")
    recorded = engine.record(net, (x,), backend="cpu")
    over, exact = (predict(recorded, hw, b, 1, "priority") for b in (10**15, sum(recorded.weight_sizes.values())))
    assert over["device_bound_bytes"] == exact["device_bound_bytes"]
