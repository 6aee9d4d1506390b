"""engine.offload(training=True) on the CPU: bitwise losses and gradients against the plain
step, the pool sized from the first step, Stagehand's telemetry fields, and its loud failures."""
from __future__ import annotations

import time
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import engine
import engine.errors
from engine.errors import ConfigError, ExecutorError
from engine.trace import Trace

STAGEHAND = ("activations_saved", "activations_kept", "activations_spilled", "activations_restored",
             "spill_bytes", "restore_bytes", "stall_time_ms", "stall_count", "pool_hits", "pool_misses",
             "vram_peak_mb")


class Adapted(nn.Module):
    """A frozen linear with a trainable low-rank adapter, as peft builds one."""

    def __init__(self, d_in: int, d_out: int, rank: int = 4):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, d_in) * 0.1)
        self.b = nn.Parameter(torch.randn(d_out, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + F.linear(F.linear(x, self.a), self.b)


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = Adapted(d, 4 * d)
        self.down = Adapted(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d: int = 64, n: int = 4, ckpt: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.ckpt = ckpt

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.ckpt else b(x)
        return x


def make(**kw) -> Net:
    torch.manual_seed(0)
    return Net(**kw)


def step(net: Net, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    for p in net.parameters():
        p.grad = None
    loss = net(x).pow(2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in net.named_parameters() if p.requires_grad}


X = torch.randn(2, 128, 64)
SYNC = {"mode": "sync", "num_offload_layers": 2, "min_tensor_bytes": 4096}
WATERMARK = {"mode": "watermark", "high_watermark_mb": 0.1, "low_watermark_mb": 0.05, "min_tensor_bytes": 4096}


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("activations", [SYNC, WATERMARK], ids=["sync", "watermark"])
def test_losses_and_gradients_are_bitwise_and_the_pool_is_sized_by_the_first_step(activations, ckpt):
    loss_ref, grads_ref = step(make(ckpt=ckpt), X)
    net = make(ckpt=ckpt)
    h = engine.offload(net, budget_mb=None, training=True, backend="cpu", activations=activations)
    for _ in range(3):
        with h.step():
            loss, grads = step(net, X)
        assert torch.equal(loss, loss_ref)
        assert grads.keys() == grads_ref.keys() and all(torch.equal(grads[k], grads_ref[k]) for k in grads)
    rows = h.telemetry()
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert tuple(rows[0])[:len(STAGEHAND)] == STAGEHAND
    assert rows[0]["activations_spilled"] > 0
    assert rows[0]["pool_hits"] == 0 and rows[0]["pool_misses"] == rows[0]["activations_spilled"]  # sizing
    assert rows[1]["pool_misses"] == 0 and rows[1]["pool_hits"] == rows[1]["activations_spilled"]  # exact
    assert rows[1]["activations_restored"] == rows[1]["activations_spilled"]
    h.remove()


def test_no_trainable_parameters():
    net = make().requires_grad_(False)
    with pytest.raises(ConfigError, match="has no trainable parameters; add the adapters"):
        engine.offload(net, budget_mb=None, training=True, backend="cpu", activations=SYNC)


def test_a_budget_needs_example_inputs_and_resident_weights_need_a_policy():
    with pytest.raises(ConfigError, match="give example_inputs"):
        engine.offload(make(), budget_mb=1000, training=True, backend="cpu", activations=SYNC)
    with pytest.raises(ConfigError, match="training=True spills activations: give activations="):
        engine.offload(make(), budget_mb=None, training=True, backend="cpu")


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("activations", [None, SYNC], ids=["weights-only", "sync"])
def test_weights_streamed_under_autograd_are_bitwise(activations, ckpt):
    """Frozen weights stream through the budget during training (forward by the hooks,
    backward by the saved views' handles, or by the recompute under checkpointing)."""
    loss_ref, grads_ref = step(make(ckpt=ckpt), X)
    net = make(ckpt=ckpt)
    block = sum(p.numel() * 4 for p in net.blocks[0].parameters() if not p.requires_grad)
    h = engine.offload(net, budget_mb=3 * block / 1e6, training=True, backend="cpu", example_inputs=(X,),
                       activations=activations, eviction="belady")
    assert {"blocks.0.up.a", "blocks.0.up.b"} <= set(h.streamed.resident_params)  # the adapters stay
    for _ in range(3):
        with h.step():
            loss, grads = step(net, X)
        assert torch.equal(loss, loss_ref)
        assert all(torch.equal(grads[k], grads_ref[k]) for k in grads_ref)
        # Between steps no streamed parameter holds a weight (the recompute's included).
        assert all(p.untyped_storage().nbytes() <= p.element_size() for p in net.parameters()
                   if id(p) in h.streamed.placeholders)
    row = h.telemetry()[-1]
    assert row["weight_h2d_bytes"] > 0 and row["weight_evictions"] > 0
    assert h.executor.order.kernels[-1] == "blocks.0.bwd"
    with pytest.raises(ExecutorError, match="runs inside `with handle.step\\(\\):`"):
        net(X)
    h.remove()
    assert torch.equal(step(net, X)[0], loss_ref)


@pytest.mark.parametrize("ckpt", [False, True])
def test_a_streamed_step_that_relocates_is_bitwise(monkeypatch, ckpt):
    """A fragmented pool relocates the resident weights inside a training step (the
    pool poisons what it is given back): the saved views' handles, and under
    checkpointing the recompute, fetch the weights where they are now."""
    from engine.executor import runtime
    from split_pool import SplitPool

    loss_ref, grads_ref = step(make(ckpt=ckpt, n=8), X)
    net = make(ckpt=ckpt, n=8)
    block = sum(p.numel() * 4 for p in net.blocks[0].parameters() if not p.requires_grad)
    monkeypatch.setattr(SplitPool, "at", (6, 12, 18, 24, 30))
    monkeypatch.setattr(runtime, "make_backend", lambda name, capacity, largest: SplitPool(capacity))
    h = engine.offload(net, budget_mb=5 * block / 1e6, training=True, backend="cpu", example_inputs=(X,),
                       eviction="belady")
    for _ in range(3):
        with h.step():
            loss, grads = step(net, X)
        assert torch.equal(loss, loss_ref)
        assert all(torch.equal(grads[k], grads_ref[k]) for k in grads_ref)
    rows = h.telemetry()
    assert [r["weight_relocations"] for r in rows] == [4, 1, 0]  # forward and backward (calls 6-44)
    assert rows[0]["weight_relocated_bytes"] > 0 and rows[1]["weight_relocated_bytes"] > 0
    h.remove()


def test_nested_steps_backward_outside_and_adapters_added_late():
    net = make()
    h = engine.offload(net, budget_mb=None, training=True, backend="cpu", activations=SYNC)
    with pytest.raises(ExecutorError, match="step\\(\\) inside a step"):
        with h.step():
            with h.step():
                pass
    h.remove()
    h = engine.offload(net, budget_mb=None, training=True, backend="cpu", activations=SYNC)
    with pytest.raises(ExecutorError, match="saved tensors that backward never used"):
        with h.step():
            net(X).pow(2).mean()  # the backward would come after the step
    h.remove()
    h = engine.offload(net, budget_mb=None, training=True, backend="cpu", activations=SYNC)
    net.blocks[0].up.base.requires_grad_(True)
    with pytest.raises(ExecutorError, match="trainable parameters changed since it was offloaded"):
        with h.step():
            pass
    h.remove()
    net.blocks[0].up.base.requires_grad_(False)
    h = engine.offload(net, budget_mb=None, training=True, backend="cpu", activations=SYNC)
    with h.step():
        step(net, X)
    net.blocks[1].extra = nn.Linear(4, 4)  # an adapter added after wrapping: a new trainable parameter
    with pytest.raises(ExecutorError, match="trainable parameters changed since it was offloaded"):
        with h.step():
            pass
    h.remove()


def test_a_handle_leaves_no_global_hook_behind():
    """The trainable-set check listens to torch's global registration hooks: remove()
    takes them off, and a handle dropped without remove() does not keep its module alive."""
    import gc
    import weakref

    from torch.nn.modules import module as torch_module

    before = (len(torch_module._global_module_registration_hooks),
              len(torch_module._global_parameter_registration_hooks))
    net = make()
    h = engine.offload(net, budget_mb=None, training=True, backend="cpu", activations=SYNC)
    h.remove()
    h = engine.offload(make(), budget_mb=None, training=True, backend="cpu", activations=SYNC)
    dropped = weakref.ref(h.module)
    del h
    gc.collect()
    assert dropped() is None
    assert (len(torch_module._global_module_registration_hooks),
            len(torch_module._global_parameter_registration_hooks)) == before


def test_a_peft_llama_with_gradient_checkpointing():
    transformers = pytest.importorskip("transformers", reason="needs the models extra")
    peft = pytest.importorskip("peft", reason="needs the models extra")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2)

    def build():
        torch.manual_seed(0)
        m = transformers.LlamaForCausalLM(cfg)
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
        return peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"],
                                                      init_lora_weights=False))

    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))

    def run(m):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.requires_grad}

    loss_ref, grads_ref = run(build())
    m = build()
    h = engine.offload(m, budget_mb=None, training=True, backend="cpu",
                       activations={"mode": "sync", "num_offload_layers": 2, "min_tensor_bytes": 1024})
    for _ in range(2):
        for p in m.parameters():
            p.grad = None
        with h.step():
            loss, grads = run(m)
        assert torch.equal(loss, loss_ref) and all(torch.equal(grads[k], grads_ref[k]) for k in grads_ref)
    assert h.telemetry()[-1]["activations_spilled"] > 0
    h.remove()


def checkpointed_lora_llama() -> nn.Module:
    """A 4-layer Llama with transformers' own checkpointing and peft LoRA on q and v."""
    transformers = pytest.importorskip("transformers", reason="needs the models extra")
    peft = pytest.importorskip("peft", reason="needs the models extra")
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2))
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.train()
    return peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))


def test_the_recorder_keeps_no_weight_after_a_checkpointed_step(monkeypatch):
    """The recorder copies each weight in for its kernel; a block's recompute points its
    parameters at the copy. After the timed steps none may still hold one (else the
    whole model stays on the device and the all-resident steps find no room)."""
    m = checkpointed_lora_llama()
    blocks = [p for layer in m.base_model.model.model.layers for p in layer.parameters() if not p.requires_grad]
    holding: list[int] = []

    def fits(nbytes: int, device: torch.device, transient: int | None = None) -> bool:  # right after the timed steps
        holding.append(sum(p.untyped_storage().nbytes() > p.element_size() for p in blocks))
        return True

    monkeypatch.setattr("engine.modules.record.fits_resident", fits)
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(1))
    trace = engine.record(m, {"input_ids": ids}, backend="cpu", loss_fn=lambda out: out.logits.float().pow(2).mean())
    assert holding == [0] and trace.header["pipelined_step_ns"]


def test_the_room_check_leaves_out_the_weight_copies_recompute_held(monkeypatch):
    """The timed steps keep every checkpointed block's weight copies to the step's end; the
    all-resident steps make none. The room they are checked for is what a timed step
    allocated less those copies, plus the saved tensors (the activations before the peak):
    else a model over about 0.45 of the free memory never gets its all-resident steps."""
    m = checkpointed_lora_llama()
    copies = sum(p.numel() * p.element_size() for layer in m.base_model.model.model.layers
                 for p in layer.parameters() if not p.requires_grad)
    activations = 12_345
    monkeypatch.setattr("engine.modules.record._allocated_from", lambda device: lambda: copies + activations)
    seen: list[int | None] = []

    def fits(nbytes: int, device: torch.device, transient: int | None = None) -> bool:
        seen.append(transient)
        return True

    monkeypatch.setattr("engine.modules.record.fits_resident", fits)
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(1))
    trace = engine.record(m, {"input_ids": ids}, backend="cpu", loss_fn=lambda out: out.logits.float().pow(2).mean())
    saved = sum(s.nbytes for r in trace.records for s in r.saved)
    assert saved > 0 and seen == [activations + saved]


def test_all_resident_steps_out_of_memory_leave_a_trace_without_them(monkeypatch, caplog):
    """The room check estimates; where the all-resident steps still run out of device memory,
    the recording keeps its timed kernels and says the steps were skipped."""
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr("engine.modules.record.pipelined_step_ns", out_of_memory)
    torch.manual_seed(0)
    with caplog.at_level("WARNING", logger="engine.modules.record"):
        trace = engine.record(make(), (X,), backend="cpu", loss_fn=lambda out: out.pow(2).mean())
    assert trace.header["pipelined_step_ns"] is None and len(trace.records) > 0
    assert "they ran out of device memory" in caplog.text


class SlowWalk(Net):
    """A Net whose parameter walk takes the host 30 ms, as a peft model's thousands of
    submodules take a real host tens of ms."""

    def parameters(self, recurse: bool = True):
        time.sleep(0.03)
        return super().parameters(recurse)


def test_the_recorded_first_kernel_holds_no_host_walk_of_the_parameters():
    """A training step's gradients are cleared before its first stamp: a walk of the
    module's parameters inside the timed step would land in the first kernel's time (the
    CPU clock is the host's; on a GPU the stream idles through it)."""
    torch.manual_seed(0)
    net = SlowWalk(n=2)
    trace = engine.record(net, (X,), backend="cpu", loss_fn=lambda out: out.pow(2).mean())
    assert trace.records[0].compute_ns < 25_000_000


def test_streamed_training_from_a_checkpoint_of_the_frozen_weights(tmp_path):
    from safetensors.torch import save_file

    loss_ref, grads_ref = step(make(), X)
    net = make()
    path = tmp_path / "base.safetensors"
    save_file({n: p.detach().contiguous() for n, p in net.named_parameters() if not p.requires_grad}, str(path))
    with pytest.raises(engine.errors.BelowFloorError, match="use budget=1 or more"):
        engine.offload(net, budget_mb=0.01, training=True, backend="cpu", example_inputs=(X,), checkpoint=path)
    h = engine.offload(net, budget_mb=0.5, training=True, backend="cpu", example_inputs=(X,), checkpoint=path,
                       source="mmap", activations=SYNC)
    for _ in range(2):
        with h.step():
            loss, grads = step(net, X)
        assert torch.equal(loss, loss_ref) and all(torch.equal(grads[k], grads_ref[k]) for k in grads_ref)
    h.remove()
    assert torch.equal(step(net, X)[0], loss_ref)


class Regularized(Net):
    """Net with dropout and a BatchNorm in training mode: state a forward changes."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.1)
        self.bn = nn.BatchNorm1d(128)

    def forward(self, x):
        return self.bn(self.drop(super().forward(x)))


def test_the_set_up_recording_leaves_gradients_buffers_and_the_generator_as_it_found_them():
    """eviction="auto" with loss_fn records training steps at set-up: the first step after it,
    run as a user runs one (no zeroing first, no seeding again), is the plain first step, bitwise."""
    def first_step(offload: bool) -> tuple[torch.Tensor, dict, torch.Tensor]:
        torch.manual_seed(0)
        net = Regularized()
        torch.manual_seed(1)
        h = engine.offload(net, budget_mb=0.5, training=True, backend="cpu", example_inputs=(X,), eviction="auto",
                           loss_fn=lambda out: out.pow(2).mean()) if offload else None
        assert h is None or (h.eviction, h.lookahead) == (h.prediction["eviction"], h.prediction["lookahead"])
        with h.step() if h else nullcontext():
            loss = net(X).pow(2).mean()
            loss.backward()
        grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.requires_grad}
        if h:
            h.remove()
        return loss.detach(), grads, net.bn.running_mean.clone()

    loss_ref, grads_ref, stats_ref = first_step(offload=False)
    loss, grads, stats = first_step(offload=True)
    assert torch.equal(loss, loss_ref) and torch.equal(stats, stats_ref)
    assert all(torch.equal(grads[k], grads_ref[k]) for k in grads_ref)


def test_an_inference_set_up_leaves_norm_statistics_and_the_generator_as_it_found_them():
    def first_forward(offload: bool) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        net = Regularized()  # left in training mode: dropout draws, the BatchNorm updates its statistics
        torch.manual_seed(1)
        h = engine.offload(net, budget_mb=0.5, backend="cpu", example_inputs=(X,)) if offload else None
        with torch.no_grad():
            out = net(X)
        if h:
            h.remove()
        return out, net.bn.running_var.clone()

    out_ref, stats_ref = first_forward(offload=False)
    out, stats = first_forward(offload=True)
    assert torch.equal(out, out_ref) and torch.equal(stats, stats_ref)



def test_every_step_the_recorder_runs_computes_the_true_gradients():
    """The recorder's training steps (timed kernel by kernel, then all resident) fetch the
    frozen weights backward needs as the user's steps do: every step's gradients are the
    plain step's, never those of the placeholders the hooks leave between fetches."""
    transformers = pytest.importorskip("transformers", reason="needs the models extra")
    peft = pytest.importorskip("peft", reason="needs the models extra")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg).eval(),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    _, steps, true = recorded_seeing_gradients(model, 16)
    assert steps >= 2 and true


def recorded_seeing_gradients(model: nn.Module, tokens: int) -> tuple[Trace, int, bool]:
    """A training step of a causal LM `model` recorded on the CPU, each adapter gradient of every
    step the recorder runs seen: the trace, how many steps computed them, and whether every
    one equals the plain step's."""
    ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(1))
    loss_fn = lambda out: out.logits.float().pow(2).mean()  # noqa: E731
    loss_fn(model(input_ids=ids)).backward()
    grads_ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    seen: list[tuple[str, torch.Tensor]] = []
    for n, p in model.named_parameters():
        if p.requires_grad:
            p.register_hook(lambda g, n=n: seen.append((n, g.clone())))
    trace = engine.record(model, {"input_ids": ids}, backend="cpu", loss_fn=loss_fn)
    return trace, len(seen) // len(grads_ref), all(torch.equal(g, grads_ref[n]) for n, g in seen)


class Projected(Net):
    """Net between two frozen projections of other sizes than a block (as LTX-2's): the
    weight pool's peak and the saved activations' peak fall at different kernels."""

    def __init__(self):
        super().__init__(n=8)
        self.proj_in = nn.Linear(64, 64)
        self.proj_out = nn.Linear(64, 192)
        self.proj_in.requires_grad_(False)
        self.proj_out.requires_grad_(False)

    def forward(self, x):
        return self.proj_out(super().forward(self.proj_in(x)))


def test_the_simulated_training_step_decides_and_peaks_as_the_executed_one():
    """The recorded training step simulated, then run by offload(training=True) on the CPU under
    belady and priority: the same weight decisions, and the predicted device peak is the pool's
    measured peak plus the saved activations' (all kept: the step's saved bytes), each arena's
    peak on its own."""
    from omegaconf import OmegaConf

    from engine.config import ActivationsConfig, WeightsConfig, load_hardware
    from sim import simulate

    def build() -> Net:
        torch.manual_seed(0)
        return Projected()

    trace = engine.record(build(), (X,), backend="cpu", loss_fn=lambda out: out.pow(2).mean())
    saved = sum(s.nbytes for r in trace.records for s in r.saved)
    block = sum(p.numel() * 4 for p in build().blocks[0].parameters() if not p.requires_grad)
    budget_mb = 3.25 * block / 1e6
    for eviction in ("belady", "priority"):
        weights = OmegaConf.merge(OmegaConf.structured(WeightsConfig),
                                  {"eviction": eviction, "lookahead": 2, "backend": "cpu"})
        result = simulate(trace, weights, OmegaConf.structured(ActivationsConfig), load_hardware("h100_pcie5"),
                          round(budget_mb * 1e6), 3, False)
        net = build()
        h = engine.offload(net, budget_mb=budget_mb, training=True, backend="cpu", example_inputs=(X,),
                           eviction=eviction, lookahead=2)
        for _ in range(3):
            with h.step():
                step(net, X)
        pool_peak = max(r["weight_peak_device_bytes"] for r in h.telemetry())
        executed = [(d.step, d.position, d.action, d.target) for d in h.executor.log]
        h.remove()
        assert executed == [(d.step, d.position, d.action, d.target) for d in result.decisions], eviction
        assert result.prediction["peak_device_bytes"] == pool_peak + saved, eviction


class PrefixFirst(nn.Module):
    """Two block lists, the one registered second run first (as HiDream's caption projections
    run before its blocks): layers are numbered as the forward runs them."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(64) for _ in range(3))
        self.prefix = nn.ModuleList(Block(64) for _ in range(2))

    def forward(self, x):
        for b in [*self.prefix, *self.blocks]:
            x = b(x)
        return x


def test_layers_are_numbered_in_the_order_the_forward_runs_them():
    """A sync dict's layers run 0 to N-1 in forward: numbered by module order, the prefix's
    last block (layer 4) would wait for layer 0's offload before layer 0 ran. The recorded
    trace (its pool sized and its policy chosen from it) and the step number them alike."""
    def build() -> PrefixFirst:
        torch.manual_seed(0)
        return PrefixFirst()

    loss_ref, grads_ref = step(build(), X)
    net = build()
    block = sum(p.numel() * 4 for p in net.blocks[0].parameters() if not p.requires_grad)
    h = engine.offload(net, budget_mb=3 * block / 1e6, training=True, backend="cpu", example_inputs=(X,),
                       activations={**SYNC, "num_offload_layers": 1}, loss_fn=lambda out: out.pow(2).mean(),
                       lookahead=2)
    assert h.layers[net.prefix[0]] == 0 and h.layers[net.blocks[0]] == 2
    assert [r.layer for r in h.trace.records if r.phase == "fwd"] == [0, 1, 2, 3, 4]
    for _ in range(2):
        with h.step():
            loss, grads = step(net, X)
        assert torch.equal(loss, loss_ref) and all(torch.equal(grads[k], grads_ref[k]) for k in grads_ref)
    assert h.telemetry()[-1]["activations_spilled"] > 0
    h.remove()


class DualBlock(nn.Module):
    """A block of two streams (a dual-stream DiT's image and text)."""

    def __init__(self, d: int):
        super().__init__()
        self.x = Block(d)
        self.c = Block(d)

    def forward(self, x, c):
        return self.x(x + c), self.c(c)


class DropsLastStream(nn.Module):
    """Dual-stream blocks whose model drops the last block's text stream, as CogView4's does:
    what that branch saved, backward never uses (autograd frees it unused)."""

    def __init__(self, n: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(DualBlock(64) for _ in range(n))

    def forward(self, x):
        c = x.flip(-1)
        for b in self.blocks:
            x, c = b(x, c)
        return x


@pytest.mark.parametrize("activations", [SYNC, WATERMARK], ids=["sync", "watermark"])
def test_a_branch_the_loss_does_not_reach_is_released_at_the_step_end(activations):
    """Its saved tensors are unpacked for the policy when backward is over (a spilled one
    restored first, watermark), so the step ends (the policy's books empty, else it raises),
    bitwise, and the next one runs."""
    def build() -> DropsLastStream:
        torch.manual_seed(0)
        return DropsLastStream()

    def dropped_step(net: DropsLastStream) -> tuple[torch.Tensor, dict]:
        loss = net(X).pow(2).mean()
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in net.named_parameters() if p.grad is not None}

    loss_ref, grads_ref = dropped_step(build())
    assert "blocks.2.c.up.a" not in grads_ref  # the dropped stream's adapters get no gradient
    net = build()
    h = engine.offload(net, budget_mb=None, training=True, backend="cpu", activations=activations)
    for _ in range(3):  # the sizing step, then two on the sized pool
        net.zero_grad(set_to_none=True)
        with h.step():
            loss, grads = dropped_step(net)
        assert torch.equal(loss, loss_ref) and grads.keys() == grads_ref.keys()
        assert all(torch.equal(grads[k], grads_ref[k]) for k in grads_ref)
    assert h.telemetry()[-1]["activations_spilled"] > 0
    h.remove()


def test_the_plain_reference_steps_run_with_gc_paused_as_the_offloaded_ones():
    """execute's "step of the plain module" runs each step as the offloaded steps do, cyclic GC
    paused inside (engine/gc_pause.py), and leaves it on after."""
    import gc

    from omegaconf import OmegaConf

    from engine.modes.module_train import plain_train_run

    seen: list[bool] = []

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lora = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(gc.isenabled())
            return self.lora(x)

    model = Probe()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = OmegaConf.create({"seed": 0, "workload": {"kind": "train_lora", "steps": 3, "loop": "free"}})
    assert gc.isenabled()
    steps, ms = plain_train_run(cfg, model, torch.device("cpu"), {"x": torch.ones(2, 4)}, initial)
    assert seen == [False, False, False] and gc.isenabled()
    assert len(steps) == len(ms) == 3 and all(t > 0 for t in ms)
    assert steps[0][0] != steps[2][0]  # the adapters took their SGD updates between steps


def test_a_host_bound_training_recording_times_the_plain_step_too(monkeypatch):
    """Where the host bounds a training step, the recorder also times the plain module's steps
    (weights bound, hooks off, as a training step runs without offload), and the header's
    plain_host_factor takes the host times to them: the simulator's all-resident step is the
    plain one. Those steps, checkpointed blocks recomputed with the hooks off, compute the
    true gradients too."""
    from engine.modules.record import fit_to_pipelined

    for where in ("record", "resident_steps"):  # the fit, and the all-resident steps in turns
        monkeypatch.setattr(f"engine.modules.{where}.host_bound", lambda kernels_ns, step_ns: True)
    trace, steps, true = recorded_seeing_gradients(checkpointed_lora_llama(), 32)
    h = trace.header
    compute = sum(r.compute_ns for r in trace.records) / h["compute_scale"]
    host = sum(r.host_ns for r in trace.records) / h["host_scale"]
    assert h["plain_step_ns"] > 0
    assert h["plain_host_factor"] == pytest.approx(
        fit_to_pipelined(compute, host, h["plain_step_ns"])[1] / h["host_scale"], rel=1e-3)
    assert steps >= 3 and true


def test_the_pace_note_names_the_recordings_own_resident_step():
    """execute's training report sets the plain step beside the recording's own: its plain step
    where the host bounded it, else its step through the hooks; nothing for a synthesized trace
    or without a plain step measured here."""
    from engine.modes.module_setup import pace_note

    rec = Trace({"plain_step_ns": 200_000_000, "pipelined_step_ns": 250_000_000}, {}, ())
    line = pace_note(rec, 250.0)
    assert "ran 250.00 ms here" in line and "the plain step at 200.00 ms (+25.0%)" in line
    hooked = pace_note(Trace({"pipelined_step_ns": 250_000_000}, {}, ()), 200.0)
    assert "the step through the hooks at 250.00 ms (-20.0%)" in hooked
    assert pace_note(Trace({"source": "synthesized"}, {}, ()), 200.0) is None
    assert pace_note(rec, None) is None


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("activations", [None, SYNC], ids=["weights-only", "sync"])
def test_every_weight_within_the_budget_is_bound_and_each_step_is_the_plain_one(activations, ckpt):
    """A budget every frozen weight fits: offload(training=True) binds them once and takes the
    hooks off, as it binds an inference. The steps' losses and gradients are the plain module's,
    the frozen weights autograd saves are known as weights (the spills are those of the same
    policy with no budget at all), and remove() gives the module back."""
    loss_ref, grads_ref = step(make(ckpt=ckpt), X)
    spilled_ref = None
    if activations is not None:
        net = make(ckpt=ckpt)
        ref = engine.offload(net, budget_mb=None, training=True, backend="cpu", activations=activations)
        for _ in range(2):
            with ref.step():
                step(net, X)
        spilled_ref = ref.telemetry()[-1]["activations_spilled"]
        ref.remove()
    net = make(ckpt=ckpt)
    h = engine.offload(net, budget_mb=100, training=True, backend="cpu", example_inputs=(X,),
                       activations=activations, eviction="priority")
    assert h.bound
    for _ in range(2):
        with h.step():
            loss, grads = step(net, X)
        assert torch.equal(loss, loss_ref) and all(torch.equal(grads[k], grads_ref[k]) for k in grads_ref)
    row = h.telemetry()[-1]
    assert row["weight_h2d_bytes"] == 0 and row["weight_hits"] == len(h.executor.order)
    if activations is not None:
        assert row["activations_spilled"] == spilled_ref > 0
    h.remove()
    assert torch.equal(step(net, X)[0], loss_ref)
