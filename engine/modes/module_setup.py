"""What the real-module modes share (engine/modes/module.py, engine/modes/module_train.py):
the module and its inputs built for the device, its checkpoint, its kernels' grouping, its
recording and the prediction from it, and the report's lines on where a prediction came from.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf, open_dict

from engine.config import ActivationsConfig
from engine.errors import ConfigError
from engine.executor.setup import compute_device
from engine.job import Job, plan_keys
from engine.modes.simulate import timeline_files
from engine.modules.adapters import ALL_LINEAR, TrainingLoss, add_lora, enable_checkpointing
from engine.modules.build import build_module, example_inputs
from engine.modules.kernels import GROUPINGS
from engine.modules.offload import predict, record
from engine.modules.training import sized_for
from engine.plan import make_plan
from engine.trace import Trace

log = logging.getLogger(__name__)

STEPS_ROW = "measured steps after the first"
NO_CHECKPOINT = ("model {name} is a real module and weights.file is not set: point it at a .safetensors file "
                 "or a model directory, or write random weights with mode=materialize out=PATH")


def checkpoint_path(job: Job) -> Path:
    if job.cfg.weights.file is None:
        raise ConfigError(NO_CHECKPOINT.format(name=job.cfg.model.name))
    return Path(job.cfg.weights.file).expanduser()


def is_training(cfg: Any) -> bool:
    return cfg.workload.kind == "train_lora"


def setup_module(job: Job) -> tuple[Any, dict, torch.device]:
    cfg = job.cfg
    device = compute_device(cfg.weights.backend, no_cuda=(
        f"mode={cfg.mode} runs model {cfg.model.name} on a CUDA GPU and none is visible; simulate it here "
        "with mode=simulate (from its config, or trace=PATH recorded on a GPU machine), or run it on the CPU "
        "with weights.backend=cpu (timings not a GPU's)"), replica=True)
    if is_training(cfg) and device.type == "cuda" and not cfg.workload.cudnn_attention:
        # cuDNN's attention backward makes illegal memory accesses on some models (diffusers
        # FLUX.1-dev under torch 2.11, plain or streamed): this process's steps take the others.
        torch.backends.cuda.enable_cudnn_sdp(False)
        log.info("attention runs without cuDNN's kernels in this training run (workload.cudnn_attention=true "
                 "allows them)")
    module = built_module(cfg, device)
    return module, example_inputs(cfg.model, module, cfg.workload, device, seed=cfg.seed), device


def built_module(cfg: Any, device: torch.device) -> Any:
    """The config's module on the meta device; for a LoRA step with its adapters (on `device`)
    and, where the workload says so, per-block activation checkpointing."""
    module = build_module(cfg.model)
    if is_training(cfg):
        targets = cfg.model.get("lora_targets", ALL_LINEAR)
        add_lora(module, cfg.workload.lora_rank, targets if isinstance(targets, str) else list(targets),
                 device=device, seed=cfg.seed + 1)
        if cfg.workload.checkpointing:
            enable_checkpointing(module)
    return module


def training_loss(cfg: Any) -> TrainingLoss | None:
    return TrainingLoss(seed=cfg.seed + 2) if is_training(cfg) else None


def kernel_options(cfg: Any) -> dict:
    """The model config's kernel grouping: `grouping` (block | leaf) and `blocks` (names)."""
    blocks = cfg.model.get("blocks")
    return {"grouping": cfg.model.get("grouping", "block"),
            "blocks": None if blocks is None else list(blocks)}


def groupings_to_record(cfg: Any) -> tuple[str, ...]:
    """The groupings a module mode records: the model config's, or each of GROUPINGS for
    `grouping: auto` (inference: execute keeps the one the simulator predicts fastest)."""
    grouping = kernel_options(cfg)["grouping"]
    if grouping != "auto":
        return (grouping,)
    if is_training(cfg):
        raise ConfigError("model.grouping=auto chooses by simulating inference steps; workload=train_lora takes "
                          f"one of {', '.join(GROUPINGS)}")
    return GROUPINGS


def record_trace(job: Job, module: Any, inputs: dict, grouping: str) -> Trace:
    cfg = job.cfg
    return record(module, inputs, backend=cfg.weights.backend, checkpoint=checkpoint_path(job),
                  source=cfg.weights.source, name=cfg.model.name, workload=_workload(cfg), loss_fn=training_loss(cfg),
                  **{**kernel_options(cfg), "grouping": grouping})


def trace_file(grouping: str, recorded: int) -> str:
    """Where a module mode writes its recording: trace.jsonl, or one per grouping."""
    return "trace.jsonl" if recorded == 1 else f"trace-{grouping}.jsonl"


def predicted_from(job: Job, recorded: int = 1) -> str:
    """The report's line on what the prediction replays: trace=PATH, or the recording this run
    made first, of `recorded` groupings (the host's pace while it recorded is in it)."""
    if job.trace is not None:
        return f"predicted from trace={job.cfg.trace}"
    path = job.out_dir / trace_file(job.cfg.model.grouping, recorded)
    return f"predicted from the recording this run made first ({path}; replay it with trace=PATH)"


def pace_note(trace: Trace, resident_ms: float | None) -> str | None:
    """The report's line setting the plain step measured here beside the all-resident step
    the recording measured (header "plain_step_ns" where the host bounded it, else
    "pipelined_step_ns", through the hooks; none in a synthesized trace): a step the host
    bounds moves with the host's pace, and a lent host's pace moves between a recording and
    a run (benchmarks/results/host-pace-h200-2026-11-29.md)."""
    h = trace.header
    key = "plain_step_ns" if h.get("plain_step_ns") else "pipelined_step_ns"
    if resident_ms is None or not h.get(key):
        return None
    ms, what = h[key] / 1e6, "the plain step" if key == "plain_step_ns" else "the step through the hooks"
    return (f"every weight resident, the plain module's step ran {resident_ms:.2f} ms here; the recording "
            f"measured {what} at {ms:.2f} ms ({resident_ms / ms - 1:+.1%}): where the host bounds the step, "
            "the prediction from that recording moves with the host's pace as it was then")


def keep_grouping(cfg: Any, grouping: str) -> None:
    """Write the grouping an "auto" came to into the config, so the offloads and the report see it."""
    with open_dict(cfg.model):
        cfg.model.grouping = grouping


def _workload(cfg: Any) -> dict:
    return OmegaConf.to_container(cfg.workload, resolve=True)


def activations_config(cfg: Any, trace: Trace) -> Any:
    """The run's activations config: off for inference; for training the configured one,
    its pool sized from the trace when activations.pool.exact (as the job does for trace=)."""
    if not is_training(cfg):
        return OmegaConf.structured(ActivationsConfig)
    return sized_for(cfg.activations, trace)


def write_timeline(job: Job, trace: Trace, budget: int | None, pred: dict, measured: list) -> None:
    """The chosen policy simulated on the recorded trace, with the measured last step beside it."""
    from sim import simulate

    cfg = job.cfg
    weights = OmegaConf.merge(cfg.weights, {"eviction": pred["eviction"], "lookahead": pred["lookahead"]})
    result = simulate(trace, weights, activations_config(cfg, trace), cfg.hardware, budget,
                      cfg.workload.steps, allow_below_floor=False, loop=cfg.workload.loop)
    timeline_files(job, result, measured)


def predict_run(cfg: Any, trace: Trace, budget: int | None) -> dict:
    return predict(trace, cfg.hardware, budget, cfg.weights.lookahead, cfg.weights.eviction, cfg.weights.source,
                   cfg.weights.backend, activations_config(cfg, trace), cfg.workload.loop)


def report_plan(job: Job, trace: Trace) -> dict:
    """The plan's keys a report (and a sweep's summary) carries: the job's, or the trace's just recorded."""
    from sim.simulator import backend_granule

    cfg = job.cfg
    plan = job.plan or make_plan(
        model=cfg.model.name, workload=cfg.workload.name,
        param_count=trace.header.get("params") or sum(trace.weight_sizes.values()) // 2,
        order=trace.access_order(), budget_mb=cfg.budget, lookahead=cfg.weights.lookahead,
        granule=backend_granule(cfg.weights, cfg.hardware))
    return plan_keys(plan.as_dict())

