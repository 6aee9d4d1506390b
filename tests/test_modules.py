"""Real modules (engine/modules) on the CPU: checkpoints mapped on a meta-built module,
packed kernels, recording -> simulation, and the bad checkpoints a user brings."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

import engine
from engine.config import load_hardware
from engine.errors import BelowFloorError, ConfigError, ExecutorError, WeightFileError
from engine.modes.module_setup import pace_note
from engine.modules.build import build_module, parameters_on_meta
from engine.modules.offload import predict
from engine.modules.packing import SUFFIX
from engine.modules.record import fit_to_pipelined
from engine.report import steps_cell
from engine.trace import KernelRecord, Trace, read_trace, write_trace
from engine.sweep_summary import point_row
from engine.units import budget_bytes

ROOT = Path(__file__).resolve().parents[1]


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d: int = 64, n: int = 3):
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 8)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


@pytest.fixture()
def checkpoint(tmp_path: Path) -> tuple[Path, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    net = Net().eval()
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        ref = net(x)
    path = tmp_path / "net.safetensors"
    save_file({n: p.detach().contiguous() for n, p in net.state_dict().items()}, str(path))
    return path, x, ref


def meta_net() -> Net:
    with parameters_on_meta():
        return Net().eval()


def test_a_meta_built_module_runs_bitwise_from_its_checkpoint(checkpoint):
    path, x, ref = checkpoint
    net = meta_net()
    assert all(p.is_meta for p in net.parameters())
    h = engine.offload(net, budget_mb=0.4, example_inputs=(x,), checkpoint=path, source="mmap", backend="cpu",
                       eviction="belady")
    # Each block's tensors lie together in the file, 64-byte aligned: its span is the file's own bytes;
    # only the head (its 32-byte bias puts the weight off alignment) is copied to a host buffer.
    assert h.order.reads[1] == ("blocks.0" + SUFFIX,)
    assert h.streamed.copied_bytes == 256 + 2048
    with torch.no_grad():
        assert all(torch.equal(net(x), ref) for _ in range(3))
    assert h.telemetry()[-1]["h2d_bytes"] > 0
    h.remove()
    assert all(p.is_meta for p in net.parameters())


def test_a_sharded_directory_with_its_index(checkpoint, tmp_path):
    path, x, ref = checkpoint
    from safetensors.torch import load_file

    sd = load_file(str(path))
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    d = tmp_path / "ckpt"
    d.mkdir()
    for shard, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(d / shard))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}))
    net = meta_net()
    h = engine.offload(net, budget_mb=None, example_inputs=(x,), checkpoint=d, source="mmap", backend="cpu",
                       eviction="priority")
    with torch.no_grad():
        assert torch.equal(net(x), ref)
    h.remove()
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightFileError, match="shard model-00002-of-00002.safetensors named by "
                                              "model.safetensors.index.json is missing"):
        engine.offload(meta_net(), budget_mb=None, example_inputs=(x,), checkpoint=d, backend="cpu")


def test_bad_checkpoints_fail_before_the_module_changes(checkpoint, tmp_path):
    path, x, _ = checkpoint
    other = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(3)}, str(other))
    with pytest.raises(WeightFileError, match=r"weight embed.weight \(and 21 more\) .*another model|"
                                              r"this file is for another model"):
        engine.offload(meta_net(), budget_mb=None, example_inputs=(x,), checkpoint=other, backend="cpu")
    wrong = tmp_path / "bf16.safetensors"
    save_file({n: t.to(torch.bfloat16) for n, t in Net().state_dict().items()}, str(wrong))
    with pytest.raises(WeightFileError, match=r"bf16.safetensors: \S+ is BF16\[[0-9, ]+\] in the file but "
                                              r"the model expects F32\["):
        engine.offload(meta_net(), budget_mb=None, example_inputs=(x,), checkpoint=wrong, backend="cpu")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(WeightFileError, match="truncated"):
        engine.offload(meta_net(), budget_mb=None, example_inputs=(x,), checkpoint=cut, backend="cpu")
    net = meta_net()
    with pytest.raises(ExecutorError, match="meta device and no checkpoint"):
        engine.offload(net, budget_mb=None, example_inputs=(x,), backend="cpu")
    assert all(p.is_meta for p in net.parameters()) and "forward" not in net.__dict__


def test_a_module_without_a_checkpoint_is_packed_into_one_host_buffer(checkpoint):
    _, x, ref = checkpoint
    torch.manual_seed(0)
    net = Net().eval()
    h = engine.offload(net, budget_mb=0.4, example_inputs=(x,), backend="cpu", eviction="lru")
    assert h.streamed.copied_bytes >= sum(p.numel() * 4 for p in net.parameters())
    with torch.no_grad():
        assert torch.equal(net(x), ref)
    h.remove()
    with torch.no_grad():
        assert torch.equal(net(x), ref)


def test_record_writes_a_trace_the_simulator_replays(checkpoint, tmp_path, monkeypatch):
    path, x, _ = checkpoint
    for where in ("record", "resident_steps"):  # as a decode step: the fit, and the all-resident steps in turns
        monkeypatch.setattr(f"engine.modules.{where}.host_bound", lambda kernels_ns, step_ns: True)
    trace = engine.record(meta_net(), (x,), checkpoint=path, backend="cpu", name="net")
    assert [r.name for r in trace.records] == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    assert [r.layer for r in trace.records] == [-1, 0, 1, 2, -1]
    assert all(r.host_ns > 0 and r.compute_ns > 0 for r in trace.records)
    assert trace.records[1].flops == 2 * 2 * 5 * (64 * 256 * 2)  # two linears, batch 2 x 5 tokens
    write_trace(tmp_path / "t.jsonl", trace)
    again = read_trace(tmp_path / "t.jsonl")
    assert again.records == trace.records and again.header["num_layers"] == 3
    # The plain module's step, its weights bound: what offload runs where every weight fits.
    h = trace.header
    compute = sum(r.compute_ns for r in trace.records) / h["compute_scale"]  # as timed kernel by kernel
    host = sum(r.host_ns for r in trace.records) / h["host_scale"]
    assert h["plain_step_ns"] > 0
    assert h["plain_host_factor"] == pytest.approx(
        fit_to_pipelined(compute, host, h["plain_step_ns"])[1] / h["host_scale"], rel=1e-3)


COUNTING_NET = """
import sys, torch
from torch import nn
from safetensors.torch import save_file
import engine
from engine.modules.build import parameters_on_meta

class Counting(nn.Module):  # buffers in the checkpoint: one each forward updates, one it reads; a kept parameter
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))
        self.gain = nn.Parameter(torch.ones(32))
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("shift", torch.zeros(32))  # as built; the checkpoint holds other values

    def forward(self, x):
        self.calls += 1
        for b in self.blocks:
            x = b(x)
        return x * self.gain + self.shift

torch.manual_seed(0)
path = sys.argv[1]
state = Counting().state_dict()
state["shift"] = torch.arange(32.0)
save_file({n: t.contiguous() for n, t in state.items()}, path)
x = torch.randn(2, 32)
plain = Counting()
plain.load_state_dict(state)
with torch.no_grad():
    ref = plain(x)
with parameters_on_meta():
    net = Counting()
engine.record(net, (x,), checkpoint=path, backend="cpu", name="counting")
h = engine.offload(net, budget_mb=0.02, example_inputs=(x,), checkpoint=path, source="mmap", backend="cpu")
assert net.calls.item() == 0, net.calls  # set-up's forwards leave it as the checkpoint has it
assert torch.equal(net.shift, state["shift"]), net.shift  # the checkpoint's, not the module's as built
with torch.no_grad():
    assert torch.equal(net(x), ref)
net.gain.data.mul_(2)  # the kept parameter is the module's own too
assert net.calls.item() == 1, net.calls
h.remove()
with parameters_on_meta():
    net = Counting()
h = engine.offload(net, budget_mb=0.02, example_inputs=(x,), checkpoint=path, source="mmap", backend="cpu",
                   eviction="auto", grouping="auto")  # records each grouping, forwards between the two set-ups
assert net.calls.item() == 0 and torch.equal(net.shift, state["shift"]), (net.calls, net.shift)
h.remove()
mine = Counting()  # the module's own weights, no checkpoint: its buffers are the ones set-up's forwards update
mine.load_state_dict(state)
h = engine.offload(mine, budget_mb=0.02, example_inputs=(x,), backend="cpu", eviction="auto", grouping="auto")
assert mine.calls.item() == 0, mine.calls
h.remove()
print("ok")
"""


def test_checkpoint_buffers_are_the_checkpoints_and_writable(tmp_path):
    """Set-up leaves a checkpoint's buffers as the checkpoint has them (not as the module was
    built), and the output the plain module's. The checkpoint is mapped read-only: a buffer
    or kept parameter left a view of it would crash the process (SIGSEGV) at the first
    in-place write. In a subprocess, so a crash fails this test alone."""
    run = subprocess.run([sys.executable, "-c", COUNTING_NET, str(tmp_path / "c.safetensors")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), (run.returncode, run.stderr[-2000:])


def test_a_wrapped_modules_checkpoint_buffer_is_read_by_its_checkpoint_name(tmp_path):
    """Under peft's `base_model.model.` wrapping, a buffer is found in the checkpoint by the
    base model's name, as parameters are (state_dict_name), not left as built."""
    class Shifted(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))
            self.register_buffer("shift", torch.zeros(32))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x + self.shift

    class Wrapped(nn.Module):  # the attribute path get_peft_model puts the base model under
        def __init__(self, inner: nn.Module):
            super().__init__()
            self.base_model = nn.Module()
            self.base_model.model = inner

        def forward(self, x):
            return self.base_model.model(x)

    torch.manual_seed(0)
    state = Shifted().state_dict()
    state["shift"] = torch.arange(32.0)
    path = tmp_path / "s.safetensors"
    save_file({n: t.contiguous() for n, t in state.items()}, str(path))
    with parameters_on_meta():
        net = Wrapped(Shifted())
    x = torch.randn(2, 32)
    h = engine.offload(net, budget_mb=0.02, example_inputs=(x,), checkpoint=path, source="mmap", backend="cpu",
                       eviction="priority")
    assert torch.equal(net.base_model.model.shift, state["shift"])
    h.remove()


def test_a_recording_without_room_for_its_resident_steps_says_so(checkpoint, monkeypatch, caplog):
    path, x, _ = checkpoint
    monkeypatch.setattr("engine.modules.record.fits_resident", lambda nbytes, device, transient=None: False)
    with caplog.at_level("WARNING", logger="engine.modules.record"):
        trace = engine.record(meta_net(), (x,), checkpoint=path, backend="cpu", name="net")
    assert trace.header["pipelined_step_ns"] is None and "activation_peak_bytes" not in trace.header
    assert "the all-resident steps are skipped" in caplog.text and "no measured torch peak" in caplog.text


def test_room_for_the_resident_steps_counts_what_a_step_allocates(monkeypatch):
    """Unmeasured, the weights may take 0.6 of the free memory; with the bytes a step allocates
    beside them measured (the recorder's timed steps), the two together 0.9: a 61 GB model
    with 2 GB of activations records its resident steps on an 83 GB-free card."""
    from engine.executor.setup import fits_resident

    monkeypatch.setattr("engine.executor.setup.os.sysconf", lambda name: 1000)  # 10^6 bytes free
    cpu = torch.device("cpu")
    assert fits_resident(600_000, cpu) and not fits_resident(700_000, cpu)
    assert fits_resident(700_000, cpu, 200_000) and not fits_resident(700_000, cpu, 200_001)


def test_every_weight_resident_is_simulated_at_the_plain_forwards_host_times():
    """A recorded module whose weights all fit runs bound, without hooks: the simulator
    takes its host times by plain_host_factor there, and only there."""
    from engine.policy.placement import place
    from sim.simulator import as_run

    records = (KernelRecord(name="a", layer=0, phase="fwd", weights=("w",), compute_ns=100, flops=0, io_bytes=60,
                            host_ns=1000),
               KernelRecord(name="b", layer=1, phase="fwd", weights=("v",), compute_ns=100, flops=0, io_bytes=40,
                            host_ns=0))
    trace = Trace({"plain_host_factor": 0.75}, {"w": 60, "v": 40}, records)

    def run(budget, granule=1):
        return as_run(trace, place(trace.access_order(), budget, granule))
    for budget in (None, 100, 10**6):
        assert [r.host_ns for r in run(budget).records] == [750, 0]
    assert run(99) is trace  # one weight must wait for another's eviction: hooks
    # On granules of 32 bytes each weight takes whole ones: 64 + 64 bytes, where 100 hold their bytes.
    assert run(127, granule=32) is trace and [r.host_ns for r in run(128, granule=32).records] == [750, 0]
    plain = Trace({}, trace.weight_sizes, records)
    assert as_run(plain, place(plain.access_order(), None, 1)) is plain  # a spec trace, or one recorded before
    # A training step's backward too: offload(training=True) binds its weights where all fit.
    backward = tuple(KernelRecord(name=r.name + ".bwd", layer=r.layer, phase="bwd", weights=r.weights, compute_ns=200,
                                  flops=0, io_bytes=r.io_bytes, host_ns=2000) for r in reversed(records))
    train = Trace({"plain_host_factor": 0.75}, trace.weight_sizes, records + backward)
    for budget in (None, 10**6):
        assert [r.host_ns for r in as_run(train, place(train.access_order(), budget, 1)).records] == [750, 0, 1500, 1500]
    assert as_run(train, place(train.access_order(), 99, 1)) is train


def test_auto_picks_the_fastest_predicted_policy(checkpoint):
    path, x, ref = checkpoint
    net = meta_net()
    h = engine.offload(net, budget_mb=0.4, example_inputs=(x,), checkpoint=path, source="mmap", backend="cpu",
                       lookahead=2)
    p = h.prediction
    assert set(p["candidates"]) == {"lru/2", "belady/2", "priority/2"}
    assert p["eviction"] == h.eviction and p["candidates"][f"{h.eviction}/2"] == min(p["candidates"].values())
    assert p["hardware"] == "h100_pcie5" and h.trace is not None
    # The set-up's seconds by stage (no "register": an unregistered mapping), the recording's too.
    assert set(h.setup_s) == {"map", "order", "pack", "hooks", "record", "simulate", "executor"}
    assert all(s >= 0 for s in h.setup_s.values())
    assert set(h.trace.header["record_stages_s"]) == {"kernels", "resident_steps"}
    with torch.no_grad():
        assert torch.equal(net(x), ref)
    h.remove()


def test_auto_lookahead_walks_the_lookaheads_the_budget_allows(checkpoint):
    """lookahead=None, the default, is "auto" under eviction="auto"; else 2."""
    path, x, ref = checkpoint
    net = meta_net()
    h = engine.offload(net, budget_mb=0.5, example_inputs=(x,), checkpoint=path, source="mmap", backend="cpu")
    p = h.prediction
    tried = {int(c.split("/")[1]) for c in p["candidates"]}
    assert tried and tried <= {1, 2, 3, 4} and 2 in tried  # those whose floor 0.5 MB clears, from 2
    assert (h.eviction, h.lookahead) == (p["eviction"], p["lookahead"])
    assert p["candidates"][f"{h.eviction}/{h.lookahead}"] == min(p["candidates"].values())
    with torch.no_grad():
        assert torch.equal(net(x), ref)
    h.remove()
    fixed = engine.offload(net, budget_mb=0.5, example_inputs=(x,), checkpoint=path, source="mmap",
                           backend="cpu", eviction="lru")
    assert (fixed.lookahead, fixed.prediction) == (2, None)
    fixed.remove()
    with pytest.raises(ConfigError, match="lookahead='auto' is chosen by simulation"):
        engine.offload(meta_net(), budget_mb=0.5, example_inputs=(x,), checkpoint=path, backend="cpu",
                       eviction="lru", lookahead="auto")


def test_a_synced_loop_is_what_the_pick_simulates(checkpoint):
    path, x, ref = checkpoint
    h = engine.offload(meta_net(), budget_mb=0.5, example_inputs=(x,), checkpoint=path, source="mmap",
                       backend="cpu", loop="synced")
    free = predict(h.trace, load_hardware("h100_pcie5"), budget_bytes(0.5), h.lookahead, h.eviction)
    assert h.prediction["loop"] == "synced" and free["loop"] == "free"
    assert h.prediction["step_ms"] >= free["step_ms"]  # the host loses its lead at every step's end
    h.remove()
    with pytest.raises(ConfigError, match="loop='sometimes' is not one of free, synced"):
        engine.offload(meta_net(), budget_mb=0.5, example_inputs=(x,), checkpoint=path, backend="cpu",
                       loop="sometimes")


def test_auto_grouping_keeps_the_grouping_the_simulator_predicts_fastest(checkpoint):
    """grouping="auto" records block and leaf and keeps the faster prediction, its recording
    that grouping's; the forward stays bitwise."""
    path, x, ref = checkpoint
    net = meta_net()
    h = engine.offload(net, budget_mb=0.5, example_inputs=(x,), checkpoint=path, source="mmap", backend="cpu",
                       grouping="auto")
    assert set(h.prediction["groupings_ms"]) == {"block", "leaf"}
    assert h.grouping == h.prediction["grouping"] == min(h.prediction["groupings_ms"],
                                                         key=h.prediction["groupings_ms"].get)
    assert len(h.order.reads) == len(h.trace.records) and h.trace.header["grouping"] == h.grouping
    assert h.setup_s["other_groupings"] > 0
    with torch.no_grad():
        assert torch.equal(net(x), ref)
    h.remove()
    with pytest.raises(ConfigError, match="grouping='auto' is chosen by simulation"):
        engine.offload(meta_net(), budget_mb=0.5, example_inputs=(x,), checkpoint=path, backend="cpu",
                       eviction="lru", grouping="auto")
    with pytest.raises(ConfigError, match="training=True takes one of block, leaf"):
        engine.offload(meta_net(), budget_mb=0.5, example_inputs=(x,), checkpoint=path, backend="cpu",
                       training=True, grouping="auto")


def test_auto_grouping_passes_over_a_grouping_under_its_floor(checkpoint):
    path, x, ref = checkpoint
    floors = {}
    for grouping in ("block", "leaf"):
        with pytest.raises(BelowFloorError) as err:
            engine.offload(meta_net(), budget_mb=0.001, example_inputs=(x,), checkpoint=path, backend="cpu",
                           grouping=grouping)
        floors[grouping] = err.value.floor_bytes
    assert floors["leaf"] < floors["block"]  # a leaf is smaller than its block
    between = (floors["leaf"] + floors["block"]) / 2 / 1e6
    h = engine.offload(meta_net(), budget_mb=between, example_inputs=(x,), checkpoint=path, source="mmap",
                       backend="cpu", grouping="auto")
    assert h.grouping == "leaf" and set(h.prediction["groupings_ms"]) == {"leaf"}
    h.remove()
    with pytest.raises(BelowFloorError) as err:
        engine.offload(meta_net(), budget_mb=0.001, example_inputs=(x,), checkpoint=path, backend="cpu",
                       grouping="auto")
    assert err.value.floor_bytes == floors["leaf"]  # the lowest floor names the budget to give


def test_a_target_that_cannot_be_imported_names_the_extra():
    with pytest.raises(ConfigError, match=r"module 'nosuchpackage' is not installed; pip install "
                                          r"'offload-engine\[models\]'"):
        build_module({"module": {"_target_": "nosuchpackage.Model"}, "dtype": "fp32"})


def test_a_target_may_name_a_classmethod_and_a_bad_attribute_says_so():
    with pytest.raises(ConfigError, match=r"_target_=torch.nn.Linear.nosuch: no such class or function"):
        build_module({"module": {"_target_": "torch.nn.Linear.nosuch"}, "dtype": "fp32"})
    with pytest.raises(ConfigError, match=r"module 'torch.nosuch' is not installed"):
        build_module({"module": {"_target_": "torch.nosuch.sub.Model"}, "dtype": "fp32"})


@pytest.mark.parametrize("library", ["diffusers", "transformers"])
def test_a_module_builds_from_its_checkpoint_directorys_own_config(tmp_path, library):
    """`_target_: Class.from_config` over the directory's config (`${weights.file}`): the
    checkpoint as save_pretrained wrote it streams bitwise against the plain module."""
    from omegaconf import OmegaConf

    lib = pytest.importorskip(library, reason="needs the models extra: pip install 'offload-engine[models]'")
    torch.manual_seed(0)
    if library == "diffusers":
        plain = lib.FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=4, num_single_layers=4,
                                           attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                           pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
        cls = "diffusers.FluxTransformer2DModel"
        module = {"_target_": f"{cls}.from_config",
                  "config": {"_target_": f"{cls}.load_config", "pretrained_model_name_or_path": "${weights.file}"}}
        inputs = dict(hidden_states=torch.randn(1, 16, 8), encoder_hidden_states=torch.randn(1, 4, 32),
                      pooled_projections=torch.randn(1, 16), timestep=torch.tensor([0.5]),
                      img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(4, 3), return_dict=False)
    else:
        plain = lib.LlamaForCausalLM(lib.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                                     num_hidden_layers=6, num_attention_heads=4,
                                                     num_key_value_heads=2))
        module = {"_target_": "transformers.AutoModelForCausalLM.from_config",
                  "config": {"_target_": "transformers.AutoConfig.from_pretrained",
                             "pretrained_model_name_or_path": "${weights.file}"}}
        inputs = dict(input_ids=torch.randint(0, 128, (1, 12)))
    plain.eval().save_pretrained(tmp_path / "ckpt")
    cfg = OmegaConf.create({"weights": {"file": str(tmp_path / "ckpt")},
                            "model": {"dtype": "fp32", "module": module}})
    net = build_module(cfg.model)
    assert type(net) is type(plain) and all(p.is_meta for p in net.parameters())
    with torch.no_grad():
        ref = plain(**inputs)[0]
    h = engine.offload(net, budget_mb=0.5, example_inputs=inputs, checkpoint=tmp_path / "ckpt", source="mmap",
                       backend="cpu", eviction="priority")
    with torch.no_grad():
        assert torch.equal(net(**inputs)[0], ref)
    assert not h.bound and h.telemetry()[-1]["h2d_bytes"] > 0  # under the weights' bytes: streamed
    h.remove()


def test_the_cli_records_then_simulates_a_transformers_model(tmp_path):
    pytest.importorskip("transformers", reason="needs the models extra: pip install 'offload-engine[models]'")
    ckpt = tmp_path / "tl.safetensors"
    common = [sys.executable, "-m", "engine", "model=tiny_llama_hf", "workload=decode",
              "workload.context_tokens=16"]

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*common, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)

    assert run("mode=materialize", f"out={ckpt}").returncode == 0
    rec = run("mode=record", f"weights.file={ckpt}", "weights.backend=cpu", f"hydra.run.dir={tmp_path / 'rec'}")
    assert rec.returncode == 0, rec.stderr
    trace = tmp_path / "rec" / "trace.jsonl"
    assert f"replay it: python -m engine model=tiny_llama_hf trace={trace} budget=MB" in rec.stdout
    sim = run(f"trace={trace}", "budget=0.5", f"hydra.run.dir={tmp_path / 'sim'}")
    assert sim.returncode == 0, sim.stderr
    report = json.loads((tmp_path / "sim" / "report.json").read_text())
    assert report["prediction"]["step_ms"] > 0
    # Without a recording the module is synthesized on the meta device: the same kernels and bytes.
    synthesized = run("budget=0.5", f"hydra.run.dir={tmp_path / 'syn'}")
    assert synthesized.returncode == 0, synthesized.stderr
    syn = json.loads((tmp_path / "syn" / "report.json").read_text())
    assert syn["plan"]["model_bytes"] == report["plan"]["model_bytes"]
    assert syn["prediction"]["h2d_bytes"] == report["prediction"]["h2d_bytes"]
    # A LoRA step too (tests/test_module_train_cli.py compares it with a recording).
    training = subprocess.run([sys.executable, "-m", "engine", "model=tiny_llama_hf", "workload=train_lora",
                               "budget=0.5", f"hydra.run.dir={tmp_path / 'train'}"], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
    assert training.returncode == 0, training.stderr
    leaf = run("mode=record", f"weights.file={ckpt}", "weights.backend=cpu", "model.grouping=leaf",
               f"hydra.run.dir={tmp_path / 'leaf'}")
    assert leaf.returncode == 0, leaf.stderr
    by_block = read_trace(trace)
    by_leaf = read_trace(tmp_path / "leaf" / "trace.jsonl")
    assert [r.name for r in by_block.records] == ["model.embed_tokens", "model.layers.0", "model.layers.1",
                                                  "model.norm", "lm_head"]
    assert len(by_leaf.records) == 2 * 9 + 3  # a layer's 7 linears and 2 norms; embed, norm, lm_head
    assert by_leaf.records[1].name == "model.layers.0.input_layernorm"
    ex = run(f"trace={trace}", "budget=0.35", "mode=execute", f"weights.file={ckpt}", "weights.backend=cpu",
             "weights.eviction=belady", f"hydra.run.dir={tmp_path / 'ex'}")
    assert ex.returncode == 0, ex.stderr
    report = json.loads((tmp_path / "ex" / "report.json").read_text())
    assert report["bitwise"] == [True] * 3  # workload.steps forwards, each against the resident one
    assert report["outcomes"] == {"outcomes": 1, "plain_steps": 3, "spread": 0.0, "unmatched_max_diff": 0.0,
                                  "passed": True}  # the plain module's three steps gave one output
    assert "outputs bitwise equal to the plain module's (loaded from weights.file, every weight resident): True\n" in ex.stdout
    assert report["measurement"]["h2d_bytes"] == report["prediction"]["h2d_bytes"]
    steps = report["measurement"]["steps_ms"]  # every step kept; the ones after the first summed up
    assert len(steps) == 3 and steps_cell(steps[1:]) in ex.stdout
    # The same steps of the plain module, timed beside them, and set against the recording's.
    plain = report["measurement"]["resident_steps_ms"]
    assert len(plain) == 3 and report["measurement"]["resident_step_ms"] == statistics.median(plain[1:])
    assert f"{report['measurement']['resident_step_ms']:.2f} ms" in ex.stdout
    assert pace_note(read_trace(trace), report["measurement"]["resident_step_ms"]) in ex.stdout
    events = json.loads((tmp_path / "ex" / "timeline.json").read_text())["traceEvents"]
    measured = [e["name"] for e in events if e.get("pid") == 2 and e["ph"] == "X" and e["tid"] == 1]
    assert measured == [r.name for r in by_block.records]  # the last step's kernels, beside the prediction
    assert report["measurement"]["h2d_bytes"] > 0  # 0.35 MB streams the 0.43 MB of weights
    # A sweep's row is the measured step, as for a spec model's execute point.
    point = tmp_path / "sweep" / "0"
    point.mkdir(parents=True)
    (point / "report.json").write_text(json.dumps(report))
    row = point_row(point)
    assert row["step_ms"] == report["measurement"]["step_ms"] != row["predicted_step_ms"]




SD3_SMALL = ["model=sd35_large_diffusers", "model.module.num_layers=2", "model.module.num_attention_heads=2",
             "model.module.attention_head_dim=16", "model.module.caption_projection_dim=32",
             "model.module.joint_attention_dim=32", "model.module.pooled_projection_dim=16",
             "model.module.pos_embed_max_size=32", "workload.video_tokens=64", "workload.text_tokens=8"]


def test_the_cli_runs_sd3_from_its_checkpoint_bitwise(tmp_path):
    """The shipped SD3.5 config, small: its checkpoint holds a buffer (the positional
    embedding, random in a materialized file) that differs from the module's as built. Record
    on the CPU backend (it crashed writing into the mapping), then execute inference and a
    LoRA step: bitwise against the plain module loaded from the file (set-up had put the
    built buffer back)."""
    pytest.importorskip("diffusers", reason="needs the models extra: pip install 'offload-engine[models]'")
    ckpt = tmp_path / "sd3.safetensors"

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "engine", *SD3_SMALL, *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)

    assert run("mode=materialize", f"out={ckpt}", f"hydra.run.dir={tmp_path / 'mat'}").returncode == 0
    rec = run("mode=record", f"weights.file={ckpt}", "weights.backend=cpu", f"hydra.run.dir={tmp_path / 'rec'}")
    assert rec.returncode == 0, rec.stderr
    ex = run(f"trace={tmp_path / 'rec' / 'trace.jsonl'}", "budget=0.14", "mode=execute", f"weights.file={ckpt}",
             "weights.backend=cpu", f"hydra.run.dir={tmp_path / 'ex'}")
    assert ex.returncode == 0, ex.stdout + ex.stderr
    report = json.loads((tmp_path / "ex" / "report.json").read_text())
    assert report["bitwise"] == [True] * 3 and report["measurement"]["h2d_bytes"] > 0
    # A LoRA step the same way: its losses and gradients against the plain module's steps.
    train = run("workload=train_lora", "workload.checkpointing=true", "activations=off", "budget=0.14",
                "mode=execute", f"weights.file={ckpt}", "weights.backend=cpu", f"hydra.run.dir={tmp_path / 'tr'}")
    assert train.returncode == 0, train.stdout + train.stderr
    report = json.loads((tmp_path / "tr" / "report.json").read_text())
    assert report["loss_match_reference"] is True and report["grads_match_reference"] is True
    assert report["measurement"]["resident_step_ms"] > 0 and report["measurement"]["h2d_bytes"] > 0


def test_the_cli_chooses_the_grouping_by_simulation(tmp_path):
    """model.grouping=auto: mode=record writes each grouping's trace; mode=execute records both,
    keeps the one predicted faster and runs it bitwise; trace=PATH runs that trace's grouping."""
    pytest.importorskip("transformers", reason="needs the models extra: pip install 'offload-engine[models]'")
    ckpt = tmp_path / "tl.safetensors"
    common = [sys.executable, "-m", "engine", "model=tiny_llama_hf", "workload=decode", "workload.context_tokens=16",
              "weights.backend=cpu", "model.grouping=auto", "sim.timeline=false"]

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*common, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)

    assert run("mode=materialize", f"out={ckpt}").returncode == 0
    rec = run("mode=record", f"weights.file={ckpt}", f"hydra.run.dir={tmp_path / 'rec'}")
    assert rec.returncode == 0, rec.stderr
    traces = {g: read_trace(tmp_path / "rec" / f"trace-{g}.jsonl") for g in ("block", "leaf")}
    assert {g: t.header["grouping"] for g, t in traces.items()} == {"block": "block", "leaf": "leaf"}
    ex = run("budget=0.35", "mode=execute", f"weights.file={ckpt}", f"hydra.run.dir={tmp_path / 'ex'}")
    assert ex.returncode == 0, ex.stderr
    report = json.loads((tmp_path / "ex" / "report.json").read_text())
    pred = report["prediction"]
    assert set(pred["groupings_ms"]) == {"block", "leaf"}
    assert pred["grouping"] == min(pred["groupings_ms"], key=pred["groupings_ms"].get)
    assert report["bitwise"] == [True] * 3 and report["measurement"]["h2d_bytes"] == pred["h2d_bytes"]
    assert f"model.grouping=auto kept {pred['grouping']}" in ex.stdout
    kept_path = tmp_path / "ex" / f"trace-{pred['grouping']}.jsonl"
    assert f"predicted from the recording this run made first ({kept_path}" in ex.stdout
    kept = read_trace(kept_path)
    assert kept.header["grouping"] == pred["grouping"]
    replay = run(f"trace={tmp_path / 'rec' / 'trace-leaf.jsonl'}", "budget=0.35", "mode=execute",
                 f"weights.file={ckpt}", f"hydra.run.dir={tmp_path / 'replay'}")
    assert replay.returncode == 0, replay.stderr
    assert f"predicted from trace={tmp_path / 'rec' / 'trace-leaf.jsonl'}" in replay.stdout
    assert json.loads((tmp_path / "replay" / "report.json").read_text())["bitwise"] == [True] * 3
    mismatch = run(f"trace={tmp_path / 'rec' / 'trace-leaf.jsonl'}", "budget=0.35", "mode=execute",
                   f"weights.file={ckpt}", "model.grouping=block")
    assert mismatch.returncode == 2 and "recorded with grouping leaf and model.grouping is block" in mismatch.stderr
    train = run("workload=train_lora", "workload.lora_rank=4", "mode=record", f"weights.file={ckpt}")
    assert train.returncode == 2 and "workload=train_lora takes one of block, leaf" in train.stderr


def test_the_pipelined_step_decides_which_times_are_scaled():
    """Kernel-by-kernel times against the all-resident step (recorded H100 figures, ms): a
    GPU-bound module scales its compute to the step, even 7% up (Wan 14B's clocks sag), and
    a host summing past the step down to it (FLUX); a decode step three times its kernels'
    time is the host's, whose times are scaled to it either way (Llama-3.1-8B)."""
    from engine.modules.record import fit_to_pipelined

    ms = 1_000_000
    assert fit_to_pipelined(377_700_000, 90_400_000, 404_956_000) == pytest.approx((1.07217, 1.0), abs=1e-5)
    assert fit_to_pipelined(177_600_000, 194_500_000, 186_871_000) == pytest.approx(
        (186_871 / 177_600, 186_871 / 194_500))
    assert fit_to_pipelined(11_800_000, 30_200_000, 34_359_000) == (1.0, pytest.approx(34_359 / 30_200))
    assert fit_to_pipelined(11 * ms, 62 * ms, 33 * ms) == (1.0, pytest.approx(33 / 62))
    # Qwen-Image: a step the hooks' host work lengthens 7% past its kernels (the host 215 ms, the
    # plain module's step 205): the kernels take the plain step, the host the pipelined one.
    assert fit_to_pipelined(201_500_000, 215_470_000, 216_350_000, 205_030_000) == pytest.approx(
        (205_030 / 201_500, 1.0))
    assert fit_to_pipelined(201_500_000, 215_470_000, 216_350_000) == pytest.approx((216_350 / 201_500, 1.0))


RECORDINGS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "real-2026-11-26"


@pytest.mark.parametrize("run, budgets", [("run20-llama/llama8b", (4000, 8000, 12000)),
                                          ("run24-flux/flux", (8000, 12000, 16000))])
def test_the_lookahead_walk_finds_what_trying_every_lookahead_finds(run, budgets):
    """On recordings of the H100: Llama decode (priority at 1, belady at 1 at 12000) and FLUX
    (priority at 1, at 3 at 16000; at 8000 belady is fastest at lookahead 2, priority at 1, so
    every policy near the fastest walks), in fewer simulations than the 4 x 3 candidates."""
    from engine.choice import LOOKAHEADS
    from engine.config import load_hardware
    from engine.errors import BelowFloorError
    from engine.modules.offload import predict

    trace = read_trace(RECORDINGS / f"{run}.trace.jsonl.gz")
    hw = load_hardware("h100_calibrated")
    simulated = [0, 0]  # walked, every
    for budget in budgets:
        walked = predict(trace, hw, budget * 10**6, "auto", "auto")
        every: dict[str, float] = {}
        for la in LOOKAHEADS:
            try:
                every.update(predict(trace, hw, budget * 10**6, la, "auto")["candidates"])
            except BelowFloorError:  # this lookahead's floor is over the budget
                pass
        assert f"{walked['eviction']}/{walked['lookahead']}" == min(every, key=every.get), budget
        simulated[0] += len(walked["candidates"])
        simulated[1] += len(every)
    assert simulated[0] < simulated[1]


class _Tabled(nn.Module):
    """Two blocks and a positional table (a buffer) read before them."""

    def __init__(self, rows: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))
        self.register_buffer("table", torch.arange(rows * 64, dtype=torch.float32).reshape(rows, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.table[: x.shape[0]]
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="measures device memory")])])
def test_set_ups_copies_of_the_buffers_wait_on_the_host_and_go_once_put_back(device):
    """Set-up keeps the buffers' values to put back after its forwards; on the host, not beside
    the module on the device (a 179 MB positional table held twice through recording, and for
    as long as the offloaded module lived), and let go once put back."""
    net = _Tabled(4096).to(device)
    table = net.table.clone()
    before = torch.cuda.memory_allocated() if device == "cuda" else 0
    h = engine.offload(net, budget_mb=0.04, example_inputs=(torch.randn(8, 64, device=device),), backend=device)
    if device == "cuda":  # the streamed weights live in the pool: torch holds the table (and a kept bias or so) only
        assert torch.cuda.memory_allocated() - before < net.table.nbytes // 2
    assert torch.equal(net.table, table)
    h.remove()
    from engine.modules.untouched import untouched

    with untouched(net) as baseline:
        baseline.take_buffers()
        assert [t.device.type for t in baseline.buffers.values()] == ["cpu"]
        net.table.add_(1)
    assert torch.equal(net.table, table) and baseline.buffers == {}


def test_the_buffers_count_in_the_traced_peak():
    """Offload moves every buffer to the device beside the streamed weights: the bytes the
    forward holds at its peak count them, in a recording and on the meta device alike."""
    peaks = {}
    for rows in (8, 4008):
        recorded = engine.record(_Tabled(rows), (torch.randn(8, 64),), backend="cpu")
        with torch.device("meta"):
            shapes = _Tabled(rows)
        synthesized = engine.synthesize(shapes, (torch.randn(8, 64, device="meta"),))
        peaks[rows] = recorded.header["traced_peak_bytes"], synthesized.header["traced_peak_bytes"]
    assert peaks[4008][0] - peaks[8][0] == peaks[4008][1] - peaks[8][1] == 4000 * 64 * 4

