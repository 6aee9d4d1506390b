"""Typed schema for every config group, registered in Hydra's ConfigStore.

Each group (hardware, workload, weights, activations, slo, model) has a
dataclass here, so a wrong type or an unknown key fails when Hydra composes
the config, before any work starts. Cross-field rules that a type cannot
express (low watermark above high, overlapping size classes) live in
`check_config()`, which every job runs first.
"""
from __future__ import annotations

import logging

import math
import os
from pathlib import Path
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from engine.errors import ConfigError
from engine.modes import MODES
from engine.policy import LOOPS
from engine.policy.eviction import EVICTIONS

log = logging.getLogger(__name__)

ACTIVATION_MODES = ("off", "watermark", "sync")
WORKLOAD_KINDS = ("infer", "train_lora", "decode")
WEIGHT_SOURCES = ("pinned", "mmap_registered", "mmap", "pageable")
BACKENDS = ("cuda", "vmm", "cpu")


@dataclass
class HardwareConfig:
    """A GPU and its host link. Bandwidths in GB/s (1e9 bytes/s)."""

    name: str = MISSING
    source: str = MISSING  # where the numbers come from: measured, datasheet, calibrated
    # The GPU the figures were measured on, as CUDA names it (mode=calibrate fills it in);
    # mode=execute and mode=validate say so of another. null: not said (datasheet profiles).
    device: Optional[str] = None
    device_memory_mb: int = MISSING  # what CUDA reports as the device's total, in MB
    h2d_gbps: float = MISSING  # pinned, large copies
    d2h_gbps: float = MISSING
    duplex_gbps: float = MISSING  # both directions at once, in total
    pageable_gbps: float = MISSING
    mmap_gbps: float = MISSING  # memory-mapped file, not registered
    mmap_registered_gbps: float = MISSING
    # Small copies run below the large-copy rate: bandwidth at these copy sizes
    # (MiB), interpolated in between, h2d_gbps above the largest.
    small_copy_mib: List[float] = field(default_factory=list)
    small_copy_gbps: List[float] = field(default_factory=list)
    matmul_tflops: float = MISSING  # achieved dense bf16
    hbm_gbps: float = MISSING  # achieved device-memory bandwidth, read + write
    # Kernel times measured by op and shape (engine/kernel_time.py), written by mode=calibrate:
    # a file name in conf/hardware/ or a path; null: the roofline of the two above.
    kernel_table: Optional[str] = None
    kernel_launch_us: float = 5.0  # host cost to issue one kernel
    fetch_host_us: float = 10.0  # host cost of one weight fetch (policy + alloc + copy issue)
    alloc_us: float = 2.0  # pool allocation latency
    launch_queue_depth: int = 1024  # CUDA launches (kernels, copies, memsets) queued ahead of the GPU
    # Host cost of the activation offloader's hooks (engine/executor/offloader.py), under an
    # activation policy: per forward kernel, per tensor autograd saves, per unpack of one.
    offload_kernel_us: float = 0.0
    pack_hook_us: float = 0.0
    unpack_hook_us: float = 0.0
    compute_slowdown_under_copy: float = 0.0  # fraction compute slows while copies run
    # Fraction compute runs slower than its recorded kernels under sustained load (the clocks
    # under the power limit), at a duty of 1; the duty is the busy share over sustained_window_ms.
    compute_sustained_slowdown: float = 0.0
    sustained_window_ms: float = 500.0
    # Device memory a process holds outside its tensors: the CUDA context, library handles
    # and workspaces (benchmarks/context_memory.py measures it).
    context_mb: float = 0.0
    # weights.backend=vmm: the allocation granularity, and the host cost of one map
    # call (a chunk, with its access call), unmap, create and release (mode=record's probes).
    vmm_granule_bytes: int = 2097152
    vmm_map_us: float = 0.0
    vmm_unmap_us: float = 0.0
    vmm_create_us: float = 0.0
    vmm_release_us: float = 0.0


def hardware_of(profile: Any) -> HardwareConfig:
    """A hardware profile (DictConfig, dict or dataclass) as the schema's dataclass."""
    if OmegaConf.is_config(profile):
        profile = OmegaConf.to_container(profile, resolve=True)
    if not isinstance(profile, dict):
        profile = asdict(profile)
    return HardwareConfig(**profile)


@dataclass
class WorkloadConfig:
    name: str = MISSING
    kind: str = "infer"  # infer | train_lora | decode
    batch: int = 1
    video_tokens: int = 0
    audio_tokens: int = 0
    text_tokens: int = 0
    context_tokens: int = 0  # decode: KV-cache length
    lora_rank: int = 0
    checkpointing: bool = False  # train_lora on a real module: per-block activation checkpointing
    # train_lora on a real module on CUDA: whether attention may run cuDNN's kernels; off, torch's
    # flash and memory-efficient ones (cuDNN's backward faults on diffusers FLUX under torch 2.11)
    cudnn_attention: bool = False
    steps: int = 3  # steps simulated / executed; the first warms the pool
    loop: str = "free"  # free | synced: whether the host waits for each step's end (engine.policy.LOOPS)


@dataclass
class WeightsConfig:
    eviction: str = "priority"  # lru | belady | priority | auto (the fastest in the simulator)
    # Kernels ahead the copy stream prefetches, or auto (the fastest in the simulator, 1 to 4;
    # engine/choice.py): an int or "auto", checked by check_config since a schema type cannot say so.
    lookahead: Any = 2
    source: str = "mmap_registered"  # pinned | mmap_registered | mmap | pageable
    file: Optional[str] = None  # .ptd (safetensors) weight file for execute
    backend: str = "cuda"  # cuda (capped pool) | vmm (mapped chunks) | cpu (the test backend)


@dataclass
class PoolConfig:
    class_sizes_mb: List[float] = field(default_factory=list)
    slabs_per_class: List[int] = field(default_factory=list)
    exact: bool = False  # size the classes from the step's saved tensors (engine/policy/pool_sizing.py)
    max_mb: Optional[float] = None  # pinned MB the pool may hold (a replica's share of node.pinned_budget_mb)


@dataclass
class ActivationsConfig:
    mode: str = "off"  # off | watermark | sync
    high_watermark_mb: float = 0.0
    low_watermark_mb: float = 0.0
    pool: PoolConfig = field(default_factory=PoolConfig)
    max_inflight_d2h: int = 64  # copies in flight before the host waits for the oldest
    max_inflight_h2d: int = 64
    restore_lookahead: int = 8  # saved tensors restored ahead of backward's need
    restore_within_low_watermark: bool = True  # watermark: also restore ahead while under the low watermark
    min_tensor_bytes: int = 1048576  # smaller tensors always stay on the device
    sync_dict: Optional[Dict[int, List[int]]] = None
    num_offload_layers: int = 0
    debug_checksums: bool = False


@dataclass
class SloConfig:
    name: str = MISSING
    max_step_ms: Optional[float] = None
    min_overlap: Optional[float] = None
    max_stall_ms: Optional[float] = None
    require_fits_device: bool = True  # peak device bytes under the device's memory
    require_above_floor: bool = True


@dataclass
class NodeConfig:
    """The GPUs of one host that run replicas of the job, and what they share."""

    name: str = MISSING
    source: str = MISSING  # where the numbers come from
    gpus: int = 1  # replicas, one per GPU, each with the job's budget
    # Host-to-device bytes the node's shared path carries for all GPUs at once (the host's
    # memory, a PCIe switch's uplink), GB/s; null: each GPU's link is its own.
    shared_h2d_gbps: Optional[float] = None
    shared_d2h_gbps: Optional[float] = None
    host_ram_mb: Optional[float] = None  # the host's RAM: the page-cached weights once plus every replica's pinned memory
    pinned_budget_mb: Optional[float] = None  # pinned host memory all replicas together may hold


@dataclass
class SimConfig:
    allow_below_floor: bool = False  # run below the floor and report hazards
    # timeline.json / timeline.png; null = written for single runs, skipped in
    # sweeps (a plot per point would dominate a 100-point sweep's time).
    timeline: Optional[bool] = None


@dataclass
class Config:
    model: Any = MISSING
    hardware: HardwareConfig = MISSING
    workload: WorkloadConfig = MISSING
    weights: WeightsConfig = MISSING
    activations: ActivationsConfig = MISSING
    slo: SloConfig = MISSING
    node: NodeConfig = MISSING
    sim: SimConfig = field(default_factory=SimConfig)
    budget: Optional[float] = None  # MB of GPU memory for streamed weights; null = all resident
    mode: str = "simulate"
    trace: Optional[str] = None
    seed: int = 0
    out: Optional[str] = None  # mode=materialize: the weight file to write
    measurements: Optional[str] = None  # mode=validate: measurements to report instead of measuring


def register() -> None:
    """Put every schema in the ConfigStore; conf/*.yaml files extend them."""
    from engine.models import MODEL_SCHEMAS

    # Outside the groups (a group file extends one with `- /NAME_schema@_here_`), so
    # --help and tab completion offer only the options a user can pick.
    if not OmegaConf.has_resolver("replica"):
        # hydra.run.dir's suffix under torchrun: one directory a replica, /rank<RANK>
        OmegaConf.register_new_resolver("replica", lambda: f"/rank{os.environ['RANK']}" if "RANK" in os.environ else "")
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    cs.store(name="hardware_schema", node=HardwareConfig)
    cs.store(name="workload_schema", node=WorkloadConfig)
    cs.store(name="weights_schema", node=WeightsConfig)
    cs.store(name="activations_schema", node=ActivationsConfig)
    cs.store(name="pool_schema", node=PoolConfig)
    cs.store(name="slo_schema", node=SloConfig)
    cs.store(name="node_schema", node=NodeConfig)
    for family, schema in MODEL_SCHEMAS.items():
        cs.store(name=f"{family}_schema", node=schema)


def available_models() -> list[str]:
    """Model names shipped in conf/model (works from a checkout or an install)."""
    from importlib.resources import files

    return sorted(p.name[:-5] for p in files("conf").joinpath("model").iterdir()
                  if p.name.endswith(".yaml"))


def _one_of(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}; pick one of those")


def _check_finite(node: Any, key: str) -> None:
    """Every number in the config is finite (nan, inf and 1e400 are refused)."""
    if isinstance(node, dict):
        for k, v in node.items():
            _check_finite(v, f"{key}.{k}" if key else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _check_finite(v, f"{key}[{i}]")
    elif isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(f"{key}={node} is not a finite number; give a finite value")


def profiles_of(gpu: str) -> list[str]:
    """The shipped hardware profiles (conf/hardware) that describe `gpu`, as CUDA names it."""
    from importlib.resources import files

    import yaml

    paths = sorted(p for p in files("conf").joinpath("hardware").iterdir() if p.name.endswith(".yaml"))
    return [p.name[:-5] for p in paths if (yaml.safe_load(p.read_text()) or {}).get("device") == gpu]


def profile_mismatch(hardware: Any, gpu: str | None, measured: str = "this GPU is") -> str | None:
    """A line saying the hardware profile describes another GPU than `gpu` (as CUDA names it),
    and which shipped profile describes `gpu`; None where either is not said, or they agree."""
    described = getattr(hardware, "device", None)
    if not gpu or not described or described == gpu or gpu.startswith("cpu"):
        return None
    ours = profiles_of(gpu)
    fix = (f"hardware={ours[0]} describes it" if ours else "record and calibrate a profile for it (README, "
           "'Where the predicted compute comes from')")
    return f"hardware={hardware.name} describes an {described}, and {measured} an {gpu}: {fix}"


# Hardware profile fields that divide or scale time: each must be > 0.
_POSITIVE_HARDWARE = ("device_memory_mb", "h2d_gbps", "d2h_gbps", "duplex_gbps", "pageable_gbps", "mmap_gbps",
                      "mmap_registered_gbps", "matmul_tflops", "hbm_gbps", "launch_queue_depth",
                      "sustained_window_ms")
# A launch queue shallower than this is a depth in records (profiles before launches were counted).
FEW_LAUNCHES = 128
_NON_NEGATIVE_HARDWARE = ("kernel_launch_us", "fetch_host_us", "alloc_us", "context_mb", "offload_kernel_us",
                          "pack_hook_us", "unpack_hook_us")


def check_hardware(hw: DictConfig) -> None:
    """Every hardware profile field present and in range; raises ConfigError naming it."""
    name = hw.get("name", "?")
    for f in fields(HardwareConfig):
        if OmegaConf.is_missing(hw, f.name):
            raise ConfigError(f"hardware profile {name}: hardware.{f.name} is missing; add it to the profile "
                              "(conf/hardware/h100_pcie5.yaml lists every field)")
    for key in _POSITIVE_HARDWARE:
        if not hw[key] > 0:
            raise ConfigError(f"hardware.{key}={hw[key]} must be positive; fix the profile {name}")
    for key in _NON_NEGATIVE_HARDWARE:
        if hw[key] < 0:
            raise ConfigError(f"hardware.{key}={hw[key]} is negative; fix the profile {name}")
    for key in ("compute_slowdown_under_copy", "compute_sustained_slowdown"):
        if not 0 <= hw[key] < 1:
            raise ConfigError(f"hardware.{key}={hw[key]} must be in [0, 1); fix the profile {name}")
    mib, gbps = list(hw.small_copy_mib), list(hw.small_copy_gbps)
    if len(mib) != len(gbps):
        raise ConfigError(f"hardware.small_copy_mib has {len(mib)} sizes and small_copy_gbps {len(gbps)} rates; "
                          f"give one rate per size in the profile {name}")
    if any(a >= b for a, b in zip(mib, mib[1:])) or any(v <= 0 for v in mib + gbps):
        raise ConfigError(f"hardware.small_copy_mib must be positive and increasing, and small_copy_gbps "
                          f"positive; fix the profile {name}")
    if hw.launch_queue_depth < FEW_LAUNCHES:
        log.warning("hardware.launch_queue_depth=%d in the profile %s: it counts CUDA launches (about 1,024 on "
                    "an H100); profiles written before it did held 64 records. Set 1024 unless you measured less",
                    hw.launch_queue_depth, name)


def check_config(cfg: Any) -> None:
    """Rules across fields; raises ConfigError with a one-line message and its fix."""
    if OmegaConf.is_missing(cfg, "model") or cfg.model is None:
        raise ConfigError(
            "no model given; add model=NAME, one of: " + ", ".join(available_models()))
    _check_finite(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False), "")
    check_hardware(cfg.hardware)
    _one_of("mode", cfg.mode, tuple(MODES))
    _one_of("weights.eviction", cfg.weights.eviction, (*EVICTIONS, "auto"))
    _one_of("weights.source", cfg.weights.source, WEIGHT_SOURCES)
    _one_of("weights.backend", cfg.weights.backend, BACKENDS)
    _one_of("activations.mode", cfg.activations.mode, ACTIVATION_MODES)
    _one_of("workload.kind", cfg.workload.kind, WORKLOAD_KINDS)
    _one_of("workload.loop", cfg.workload.loop, LOOPS)
    if cfg.budget is not None and cfg.budget < 0:
        raise ConfigError(f"budget={cfg.budget} is negative; give MB of GPU memory (>= 0) or budget=null")
    lookahead = cfg.weights.lookahead
    if lookahead != "auto" and (isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0):
        raise ConfigError(f"weights.lookahead={lookahead!r} is not a number of kernels; give an integer >= 0 "
                          "or auto (the simulator picks it)")
    if cfg.workload.steps < 1:
        raise ConfigError(f"workload.steps={cfg.workload.steps} must be at least 1")
    for key in ("batch", "video_tokens", "audio_tokens", "text_tokens", "context_tokens", "lora_rank"):
        if cfg.workload[key] < 0:
            raise ConfigError(f"workload.{key}={cfg.workload[key]} is negative; use 0 or more")
    if cfg.workload.kind == "train_lora" and cfg.workload.lora_rank < 1:
        raise ConfigError(f"workload.lora_rank={cfg.workload.lora_rank}: LoRA training needs a rank of 1 or more")
    if "module" in cfg.model:
        if cfg.mode == "calibrate" and (cfg.trace is None or not Path(cfg.trace).is_dir()):
            raise ConfigError(f"mode=calibrate for model {cfg.model.name} reads a directory (trace=DIR) of its "
                              "recordings beside a spec model's recorded on the same GPU: the spec recording gives "
                              "the link, host and kernel rates, the module's their op census prices its blocks")
    elif cfg.workload.kind == "decode" and cfg.model.family != "llama":
        raise ConfigError(f"workload=decode runs one token of a language model; model {cfg.model.name} is a "
                          f"{cfg.model.family} model: use workload=infer or train_lora")
    if cfg.node.gpus < 1:
        raise ConfigError(f"node.gpus={cfg.node.gpus}: a node runs at least one replica; use 1 or more")
    for key in ("shared_h2d_gbps", "shared_d2h_gbps", "host_ram_mb", "pinned_budget_mb"):
        if cfg.node[key] is not None and cfg.node[key] <= 0:
            raise ConfigError(f"node.{key}={cfg.node[key]} must be positive; give a figure > 0 or null (not shared)")
    for key in ("max_step_ms", "min_overlap", "max_stall_ms"):
        if cfg.slo[key] is not None and cfg.slo[key] < 0:
            raise ConfigError(f"slo.{key}={cfg.slo[key]} is negative; give a threshold >= 0 or null")
    if cfg.trace is not None:
        trace = Path(cfg.trace)
        if trace.is_dir():
            if cfg.mode != "calibrate":
                raise ConfigError(f"trace={cfg.trace} is a directory; mode={cfg.mode} replays one trace file "
                                  "(a directory of traces is for mode=calibrate)")
        elif not trace.is_file():
            raise ConfigError(f"trace={cfg.trace} does not exist; record one with mode=record or drop trace=")
    if cfg.measurements is not None:
        if cfg.mode != "validate":
            raise ConfigError(f"measurements={cfg.measurements} is read by mode=validate; add mode=validate or "
                              "drop measurements=")
        if not Path(cfg.measurements).is_file():
            raise ConfigError(f"measurements={cfg.measurements} does not exist; give a measurements file "
                              "mode=validate wrote, or drop measurements= to measure on the GPU")
    act = cfg.activations
    if act.mode != "off" and cfg.workload.kind != "train_lora":
        raise ConfigError(
            f"activations={act.mode} needs a training workload; add workload=train_lora or activations=off")
    if act.mode != "off":
        from engine.policy.activations import validate_watermarks
        from engine.policy.saved import validate_pool

        validate_pool(act.pool)
        if act.mode == "watermark":
            validate_watermarks(act)
    if act.mode == "sync" and act.sync_dict is None and act.num_offload_layers <= 0:
        raise ConfigError(
            "activations=sync needs activations.num_offload_layers > 0 or an activations.sync_dict")


def load_hardware(name_or_path: str | Any) -> DictConfig:
    """A hardware profile outside Hydra: conf/hardware/NAME.yaml (or a yaml path, or a
    mapping of the fields), typed and checked."""
    from importlib.resources import files

    if isinstance(name_or_path, str):
        path = Path(name_or_path)
        if not path.suffix:
            path = Path(str(files("conf").joinpath("hardware", f"{name_or_path}.yaml")))
        if not path.is_file():
            names = sorted(p.name[:-5] for p in files("conf").joinpath("hardware").iterdir()
                           if p.name.endswith(".yaml"))
            raise ConfigError(f"hardware={name_or_path!r}: no such profile; use one of {', '.join(names)} "
                              "or a yaml path")
        node = OmegaConf.load(path)
    else:
        node = OmegaConf.create(dict(name_or_path))
    node = OmegaConf.masked_copy(node, [k for k in node.keys() if k != "defaults"])
    try:
        hw = OmegaConf.merge(OmegaConf.structured(HardwareConfig), node)
    except Exception as err:  # omegaconf's validation errors: one line naming the key
        raise ConfigError(f"hardware profile {name_or_path!r}: {str(err).splitlines()[0]}; fix that key") from None
    check_hardware(hw)
    return hw
