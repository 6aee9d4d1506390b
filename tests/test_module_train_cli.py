"""workload=train_lora on a real module from the CLI, on the CPU: the training step
recorded (forward, backward at each kernel's mirror, what autograd saved), simulated,
and executed with activations spilled, against the same steps of the plain module."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.errors import ConfigError
from engine.modules.checkpoint import module_weights, state_dict_name
from engine.modes.module_setup import STEPS_ROW, pace_note
from engine.report import steps_cell
from engine.trace import BACKWARD_SUFFIX, read_trace

pytest.importorskip("peft", reason="needs the models extra: pip install 'offload-engine[models]'")

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["model=tiny_llama_hf", "workload=train_lora", "workload.lora_rank=4", "workload.text_tokens=64",
         "weights.backend=cpu", "sim.timeline=false"]
# Every saved tensor is a candidate (the default skips those under 1 MB: all of this model's).
SPILL = {"sync": ["activations=sync", "activations.num_offload_layers=1", "activations.min_tensor_bytes=0"],
         "watermark": ["activations=watermark", "activations.high_watermark_mb=0.05",
                       "activations.low_watermark_mb=0.02", "activations.min_tensor_bytes=0"]}
BUDGET = "budget=0.45"  # the two layers' weights fit: bound once, the activations spilled


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, tuple[Path, Path]]:
    """checkpointing -> (the checkpoint, the recorded training trace)."""
    tmp = tmp_path_factory.mktemp("train")
    ckpt = tmp / "tiny.safetensors"
    r = cli("model=tiny_llama_hf", "mode=materialize", f"out={ckpt}", f"hydra.run.dir={tmp / 'mat'}")
    assert r.returncode == 0, r.stderr
    out = {}
    for ckpting in (False, True):
        run = tmp / f"rec-{ckpting}"
        r = cli(*MODEL, "mode=record", f"weights.file={ckpt}", f"workload.checkpointing={ckpting}",
                f"hydra.run.dir={run}")
        assert r.returncode == 0, r.stderr
        out[ckpting] = (ckpt, run / "trace.jsonl")
    return out


def test_the_recorded_training_step_is_the_forward_then_its_mirror(recorded):
    trace = read_trace(recorded[False][1])
    names = [r.name for r in trace.records]
    forward = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
    assert names == forward + [n + BACKWARD_SUFFIX for n in reversed(forward)]
    fwd, bwd = trace.records[:5], trace.records[5:]
    assert [r.weights for r in bwd] == [r.weights for r in reversed(fwd)]
    assert all(r.phase == "bwd" and r.compute_ns >= 0 for r in bwd)
    saved = {r.name: sum(s.nbytes for s in r.saved) for r in fwd}
    assert saved["model.layers.0"] > 0 and saved["model.layers.1"] > 0
    # Every saved tensor is needed once, by a backward record (read_trace checks it is at most once).
    assert sorted(n for r in bwd for n in r.needs) == sorted(s.name for r in fwd for s in r.saved)
    assert trace.header["workload"]["kind"] == "train_lora"
    # Checkpointed blocks save only what the checkpoint keeps outside them.
    ckpt = read_trace(recorded[True][1])
    assert sum(s.nbytes for r in ckpt.records for s in r.saved) < sum(saved.values())


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("policy", sorted(SPILL))
def test_execute_spills_what_the_simulator_predicts_and_trains_bitwise(recorded, tmp_path, policy, checkpointing):
    ckpt, trace = recorded[checkpointing]
    r = cli(*MODEL, *SPILL[policy], BUDGET, "mode=execute", f"trace={trace}", f"weights.file={ckpt}",
            f"workload.checkpointing={checkpointing}", f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    pred, meas = report["prediction"], report["measurement"]
    assert report["loss_match_reference"] is True and report["grads_match_reference"] is True
    assert report["reference_spread"] is None  # the CPU: compared bitwise
    # The recording saw what the offloader sees: the same spills and restores, byte for byte.
    assert meas["d2h_bytes"] == pred["d2h_bytes"]
    assert meas["h2d_bytes"] == pred["h2d_bytes"]
    if not checkpointing:
        assert meas["d2h_bytes"] > 0
    rows = [json.loads(line) for line in (tmp_path / "telemetry.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and {"activations_spilled", "spill_bytes", "weight_h2d_bytes"} <= set(rows[-1])
    # Two layers fit this budget: bound once, no fetch in a step, no wait on weights.
    assert meas["weight_stall_ms"] == 0


def test_execute_streams_a_deeper_model_and_times_its_waits_on_weights(tmp_path):
    """Eight layers at the same budget stream their weights: the report's stall counts the last
    step's waits on them (each fetch stamped, forward and backward; the cpu backend copies inside
    the fetch), beside the activation restores' (none here)."""
    deeper = [*MODEL, "model.module.config.num_hidden_layers=8"]
    ckpt = tmp_path / "tiny8.safetensors"
    assert cli(*deeper, "mode=materialize", f"out={ckpt}", f"hydra.run.dir={tmp_path / 'mat'}").returncode == 0
    r = cli(*deeper, BUDGET, "mode=execute", f"weights.file={ckpt}", "workload.steps=2",
            f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    pred, meas = report["prediction"], report["measurement"]
    assert meas["h2d_bytes"] > 0 and meas["weight_stall_ms"] > 0 and meas["stall_ms"] == meas["weight_stall_ms"]
    row = f"| stall (waits on weights and restores) | {pred['stall_ms']:.2f} ms | {meas['stall_ms']:.2f} ms |"
    assert row in " ".join(r.stdout.split())  # the table's padding collapsed


def test_execute_without_a_trace_records_one_to_replay(recorded, tmp_path):
    ckpt, _ = recorded[False]
    r = cli(*MODEL, BUDGET, "mode=execute", f"weights.file={ckpt}", "workload.steps=2", f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert "losses True, gradients True (bitwise)" in r.stdout
    assert f"predicted from the recording this run made first ({tmp_path / 'trace.jsonl'}" in r.stdout
    trace = read_trace(tmp_path / "trace.jsonl")
    assert len(trace.records) == 10
    # The plain step measured here beside the recording's own all-resident step, in numbers.
    report = json.loads((tmp_path / "report.json").read_text())
    recorded = (trace.header.get("plain_step_ns") or trace.header["pipelined_step_ns"]) / 1e6
    assert pace_note(trace, report["measurement"]["resident_step_ms"]) in r.stdout
    assert f"at {recorded:.2f} ms" in r.stdout
    # Each run's steps kept, and their spread in the table: the streamed steps after the first, the
    # plain module's runs (one on the CPU).
    meas = report["measurement"]
    assert len(meas["steps_ms"]) == 2 and [len(run) for run in meas["resident_steps_ms"]] == [2]
    rows = {line.split("|")[1].strip(): line.split("|")[3].strip() for line in r.stdout.splitlines()
            if line.startswith(f"| {STEPS_ROW}")}
    assert rows == {STEPS_ROW: steps_cell(meas["steps_ms"][1:]),
                    f"{STEPS_ROW}, plain module": steps_cell(meas["resident_steps_ms"][0][1:])}
    assert meas["resident_step_ms"] == statistics.median(meas["resident_steps_ms"][0][1:])
    sim = cli(*MODEL, BUDGET, f"trace={tmp_path / 'trace.jsonl'}", f"hydra.run.dir={tmp_path / 'sim'}")
    assert sim.returncode == 0, sim.stderr


def test_lora_targets_that_match_nothing_are_one_line(recorded):
    ckpt, _ = recorded[False]
    r = cli(*MODEL, "mode=record", f"weights.file={ckpt}", "model.lora_targets=[no_such_proj]")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.lora_targets" in lines[0] and "all-linear" in lines[0], r.stderr


def test_peft_names_map_to_the_base_checkpoint():
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    base = transformers.LlamaForCausalLM(config)
    plain = set(module_weights(base).weights)
    wrapped = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj", "down_proj"]))
    assert set(module_weights(wrapped, frozen_only=True).weights) == plain
    assert state_dict_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.layers.0.self_attn.q_proj.weight"
    assert state_dict_name("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert torch.is_tensor(next(wrapped.parameters()))


def test_the_api_chooses_the_policy_from_a_recorded_training_step(recorded):
    """engine.offload(training=True, eviction="auto", loss_fn=...): one training step recorded,
    every policy simulated with the activations policy; the run spills what was predicted."""
    from omegaconf import OmegaConf

    import engine
    from engine.modules.adapters import TrainingLoss, add_lora
    from engine.modules.build import build_module, example_inputs

    ckpt, _ = recorded[False]
    cfg = OmegaConf.load(ROOT / "conf" / "model" / "tiny_llama_hf.yaml")
    model = add_lora(build_module(cfg), 4, device=torch.device("cpu"))
    workload = OmegaConf.create({"kind": "train_lora", "batch": 1, "text_tokens": 64})
    inputs = example_inputs(cfg, model, workload, torch.device("cpu"))
    loss_fn = TrainingLoss()
    h = engine.offload(model, budget_mb=0.45, example_inputs=inputs, training=True, checkpoint=ckpt,
                       backend="cpu", eviction="auto", loss_fn=loss_fn,
                       activations={"mode": "watermark", "high_watermark_mb": 0.05, "low_watermark_mb": 0.02,
                                    "min_tensor_bytes": 0})
    try:
        # Every policy at every lookahead the budget's floor allows (lookahead=None: chosen too).
        assert {"lru/2", "belady/2", "priority/2"} <= set(h.prediction["candidates"])
        assert {int(c.split("/")[1]) for c in h.prediction["candidates"]} <= {1, 2, 3, 4}
        assert h.executor.policy.eviction == h.prediction["eviction"]
        assert h.executor.policy.lookahead == h.prediction["lookahead"]
        assert h.trace is not None and len(h.trace.records) == 10
        for _ in range(2):
            with h.step():
                loss_fn(model(**inputs)).backward()
        row = h.telemetry()[-1]
        assert row["spill_bytes"] == h.prediction["d2h_bytes"] > 0
        assert row["pool_misses"] == 0  # the pool was sized from the recording: no sizing step
    finally:
        h.remove()
    with pytest.raises(ConfigError, match="lookahead='auto'"):
        engine.offload(model, budget_mb=0.45, example_inputs=inputs, training=True, checkpoint=ckpt,
                       backend="cpu", eviction="priority", lookahead="auto")


def test_leaf_kernels_inside_checkpointed_blocks_are_one_line(recorded):
    """Checkpointing recomputes a block's leaves in forward order, during backward: named, with the fix."""
    ckpt, _ = recorded[False]
    r = cli(*MODEL, "mode=record", f"weights.file={ckpt}", "model.grouping=leaf", "workload.checkpointing=true")
    assert r.returncode == 2
    assert "checkpointing recomputes" in r.stderr and "grouping=block" in r.stderr, r.stderr


def test_saves_count_in_the_layer_the_offloader_is_in():
    from engine.trace import saving_layers

    # Before the first block: layer 0 (the offloader enters it at the first save); after a block,
    # that block's layer until the next one starts.
    assert saving_layers([-1, -1, 0, 1, -1, 2, -1]) == [0, 0, 0, 1, 1, 2, 2]
    assert saving_layers([]) == []


@pytest.mark.parametrize("model", ["ltx2_diffusers", "flux_diffusers", "wan14b_diffusers", "qwen_image_diffusers",
                                   "sd35_large_diffusers", "llama8b_hf", "qwen25_14b_hf", "mochi_diffusers",
                                   "auraflow_diffusers", "mistral7b_hf"])
def test_every_shipped_lora_target_names_a_module_of_its_class(model):
    """peft refuses targets only when none matches; a shipped config's every suffix must."""
    from omegaconf import OmegaConf

    from engine.modules.build import build_module

    cfg = OmegaConf.load(ROOT / "conf" / "model" / f"{model}.yaml")
    names = [n for n, _ in build_module(cfg).named_modules()]
    unmatched = [t for t in cfg.lora_targets if not any(n == t or n.endswith("." + t) for n in names)]
    assert not unmatched


def _synthesized(checkpointing: bool, *overrides: str):
    from hydra import compose, initialize_config_module

    from engine.config import register
    from engine.modules.synthesize import synthesize_module

    register()
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*MODEL, f"workload.checkpointing={checkpointing}",
                                                                  *overrides])
    return synthesize_module(cfg.model, cfg.workload, cfg.hardware)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_synthesized_training_step_saves_what_the_recording_saw(recorded, checkpointing):
    """A LoRA step synthesized on the meta device (no checkpoint, no GPU) runs the recorded
    step's kernels and saves, kernel by kernel, the tensors the recording saw autograd save
    (attention's output and log-sum-exp beside its inputs, the loss's with the last kernel),
    unpacked first by the same backward records."""
    syn, rec = _synthesized(checkpointing), read_trace(recorded[checkpointing][1])
    assert syn.header["source"] == "synthesized"
    assert [r.name for r in syn.records] == [r.name for r in rec.records]
    for a, b in zip(syn.records, rec.records):
        assert sorted(s.nbytes for s in a.saved) == sorted(s.nbytes for s in b.saved), a.name
        assert {s.layer for s in a.saved} == {s.layer for s in b.saved}, a.name
        assert sorted(a.needs) == sorted(b.needs), a.name
    assert sum(s.nbytes for r in syn.records for s in r.saved) > 0


def test_checkpointing_adds_each_block_forward_to_its_backward():
    """A checkpointed block runs its forward again in backward: its backward record is the
    plain one plus its forward (within 5%: the forward's record also holds the glue after the
    block, which the recompute does not run); the kernels outside the blocks are not
    recomputed. The first block's backward is more again: transformers' checkpointing switch
    makes the embeddings' output carry a gradient (for peft), so its linears' gradients by
    their input run there too."""
    plain, ckpt = _synthesized(False), _synthesized(True)
    fwd = {r.name: r.compute_ns for r in ckpt.records if r.phase == "fwd"}
    for a, b in zip(plain.records, ckpt.records):
        if a.phase != "bwd":
            continue
        forward = a.name.removesuffix(BACKWARD_SUFFIX)
        extra = fwd[forward] if a.layer >= 0 else 0
        if a.layer == 0:
            assert b.compute_ns > a.compute_ns + extra, a.name
        else:
            assert b.compute_ns == pytest.approx(a.compute_ns + extra, rel=0.05), a.name
            assert b.launches > a.launches or a.layer < 0, a.name
    # Checkpointed, the blocks save only their inputs.
    assert sum(s.nbytes for r in ckpt.records for s in r.saved) < sum(s.nbytes for r in plain.records for s in r.saved)


def test_a_synthesized_lora_step_sags_as_the_profile_says():
    """A LoRA step slows under sustained load by the profile's compute_sustained_slowdown, not by
    the inference fit's FLOP rate (engine/modules/synthesize.py)."""
    assert "compute_sustained_slowdown" not in _synthesized(True).header


def test_a_training_steps_attention_is_priced_as_the_cli_runs_it():
    """The CLI's training turns cuDNN's attention off: the kernels with an attention core, and
    their backward, take the table's training rates; workload.cudnn_attention=true keeps the
    inference and backward ones. Nothing else moves."""
    off, on = _synthesized(True), _synthesized(True, "workload.cudnn_attention=true")
    attends = {r.name for r in off.records if r.phase == "fwd" and any(op.startswith("attention") for op, _ in r.cores)}
    assert attends
    for a, b in zip(off.records, on.records):
        if a.name.removesuffix(BACKWARD_SUFFIX) in attends:
            assert a.compute_ns > b.compute_ns, a.name
        else:
            assert a.compute_ns == b.compute_ns, a.name


def test_a_training_step_is_predicted_from_the_config_alone(tmp_path):
    """workload=train_lora on a real module without a trace: synthesized, simulated, no GPU."""
    r = cli(*MODEL, BUDGET, f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["prediction"]["step_ms"] > 0
    assert "10 kernels" in r.stdout or "/ 10" in r.stdout  # the forward's 5 and their mirror


def _peft_llama_on_meta() -> tuple:
    """A two-layer Llama on the meta device carrying peft's adapters on q and v, and its inputs."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = peft.get_peft_model(transformers.LlamaForCausalLM(config),
                                    peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    return model, {"input_ids": torch.zeros(1, 32, dtype=torch.long, device="meta"), "use_cache": False}


def test_the_api_synthesizes_a_peft_models_training_step():
    """engine.synthesize(training=True) on a module that carries its own adapters (peft's
    get_peft_model) and checkpointing: the forward, its backward, and each layer's forward again
    (within 5%, as above)."""
    import engine

    model, inputs = _peft_llama_on_meta()
    plain = engine.synthesize(model, inputs, training=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ckpt = engine.synthesize(model, inputs, training=True)
    forward = [r.name for r in plain.records if r.phase == "fwd"]
    assert [r.name for r in plain.records] == forward + [n + BACKWARD_SUFFIX for n in reversed(forward)]
    fwd = {r.name: r.compute_ns for r in ckpt.records if r.phase == "fwd"}
    for a, b in zip(plain.records, ckpt.records):
        if a.phase == "bwd" and ".layers." in a.name:  # the first layer's: test above
            recomputed = a.compute_ns + fwd[a.name.removesuffix(BACKWARD_SUFFIX)]
            assert b.compute_ns > recomputed if a.layer == 0 else b.compute_ns == pytest.approx(recomputed, rel=0.05)
    with pytest.raises(ConfigError, match="no trainable parameters"):
        engine.synthesize(model.base_model.model.requires_grad_(False), inputs, training=True)


def test_a_synthesized_training_steps_host_is_priced_at_the_training_costs(tmp_path, caplog):
    """The default profile's table carries a training step's host costs (fitted to recorded LoRA
    steps): each forward record's host is its dispatches at train_host_ns_per_op and the block's
    hooks, and a checkpointed block's backward adds its forward again at that cost, without the
    hooks. A table fitted without any LoRA step prices them as an inference, and says so."""
    from omegaconf import OmegaConf

    import engine
    from engine.kernel_time import load_table
    from engine.config import load_hardware

    model, inputs = _peft_llama_on_meta()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    hw = load_hardware("h100_pcie5")
    cost = load_table(hw.kernel_table).module_cost
    assert cost.train_host_ns_per_op > cost.host_ns_per_op > 0 and cost.backward_host_ns_per_op > 0
    step = engine.synthesize(model, inputs, hardware=hw, training=True)
    forward = {r.name: r for r in step.records if r.phase == "fwd"}
    for r in forward.values():
        assert r.host_ns == round(r.dispatches * cost.train_host_ns_per_op + cost.host_ns_per_kernel)
    layers = [r for r in step.records if r.phase == "bwd" and ".layers." in r.name]
    assert layers
    for r in layers:
        f = forward[r.name.removesuffix(BACKWARD_SUFFIX)]
        assert r.host_ns == round(f.dispatches * cost.backward_host_ns_per_op + cost.host_ns_per_kernel) \
            + round(f.dispatches * cost.train_host_ns_per_op)
    # Every weight resident the step runs bound: the whole step's host less each record's hooks.
    total = sum(r.host_ns for r in step.records)
    assert step.header["plain_host_factor"] == pytest.approx(
        (total - cost.host_ns_per_kernel * len(step.records)) / total, abs=1e-6)
    data = json.loads((ROOT / "conf" / "hardware" / hw.kernel_table).read_text())
    data["modules"].update(train_host_ns_per_op=0.0, backward_host_ns_per_op=0.0)
    (tmp_path / "inference-only.kernels.json").write_text(json.dumps(data))
    bare = OmegaConf.merge(hw, {"kernel_table": str(tmp_path / "inference-only.kernels.json")})
    with caplog.at_level("WARNING"):
        inference = engine.synthesize(model, inputs, hardware=bare, training=True)
    assert "prices no training step's host" in caplog.text
    assert all(r.host_ns == round(r.dispatches * cost.host_ns_per_op + cost.host_ns_per_kernel)
               for r in inference.records if r.phase == "fwd")

