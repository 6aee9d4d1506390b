"""Kernel time from its op and shape: the compute model of synthesized traces.

Two models, one interface (`ExecutionTimePredictor.kernel_ns`):

- **Roofline** (a profile without a kernel table): matmul-bound ops run at the
  profile's `matmul_tflops` but never faster than their bytes move through HBM;
  memory-bound ops run at `hbm_gbps`. Right for big matmuls, optimistic for
  attention, norms and small kernels.
- **Kernel table** (`hardware.kernel_table`, written by `mode=calibrate` beside the profile): kernel
  times measured on the device, by op ("linear", "attention", "norm", ...; a
  backward kernel's op gets BACKWARD) and log2 shape (`features`). A kernel
  whose features match measured points takes their median rate; otherwise the
  rates of its nearest points (log2 distance over the features) are averaged in
  log space, weighted by inverse squared distance. The table holds the recorded
  spec kernels themselves (which include what runs around the core op: bias,
  norms, residual adds) and the probe grid of bare ops (engine/measure/compute.py)
  for shapes no recording covers. An op the table lacks falls back to the bare
  op's grid ("linear", "attention", "memory"), then to the roofline (`rate_keys`).
  Attention in a training step is keyed op + TRAINING (and + BACKWARD for its
  backward): probed as the CLI's training runs it, autograd on and cuDNN's
  kernels off, where masked attention takes the memory-efficient kernel; a table
  probed before that prices it at the inference and backward rates.

Memory passes. A spec kernel also lists the memory-bound passes it runs around
its core op (`Kernel.passes`: a norm, the modulation, the gate, a residual add,
a GELU, a copy), each by kind (PASSES: what sets its cost per byte) and bytes
moved. A pass of kind k moving b bytes takes `b x ns_per_byte[k]` (`PassCost`);
mode=calibrate takes the rates from the probed passes, else fits them to the
recorded memory kernels. With a pass cost, a matmul kernel is its
core (the table's points: recorded kernels less their passes) plus its passes,
and a memory kernel whose passes match no recorded kernel is the sum of its
passes: a model nobody recorded gets its epilogues and norms from what such
passes cost elsewhere. A real module's census makes each of its memory-bound ops such a pass
(engine/modules/census.py), priced alike.

A rate is work over time: FLOP/ns for linear and attention, bytes/ns for the
memory-bound ops; interpolating rates, not times, keeps a kernel twice as long
taking twice the time.

Attention tiles. Flash attention (cuDNN's in inference, FlashAttention's in training) splits
its work into query tiles of TILE rows per head, run in waves over the GPU's SMs, each
looping over the keys in tiles of TILE. A table calibrated from a probe that knows the SM
count (`AttentionTiling`) counts such a kernel's work in the tiles it runs, the last wave's
idle SMs and the padded tiles included, and gives a length off the tile a feature of its own:
such a length takes a slower code path throughout, not only in its last tile
(benchmarks/results/attention-tiles-*). Interpolated over heads and lengths, these rates follow the
step a head count or a length makes where it spills into another wave, which plain FLOP
rates smear. Masked attention keeps plain FLOP rates: with a mask of keys, broadcast along
the queries ("attention_masked", a padded text's), and with one that varies along them
("attention_full_mask": a causal or sliding-window mask, a padded batch's), which every head's
tiles read beside their keys and a probe of its own times. Causal
attention without a mask runs the flash kernel over the tiles on and below the diagonal alone
(`causal_share`), priced at flash attention's rates: in a tiled table on the waves those tiles
run in, longest first, each wave as long as its longest (`AttentionTiling.causal_ratio`: under a
wave of them a causal kernel takes as long as the full one); a table without the tiling, whose
waves are unknown, prices it as the full attention.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from engine.errors import ConfigError, TraceError

MATMUL_OPS = ("linear", "attention", "attention_masked", "attention_causal", "attention_full_mask")
ATTENTION_OPS = ("attention", "attention_masked", "attention_causal", "attention_full_mask")
CORE_DIMS = {"linear": 3, "attention": 4, "attention_masked": 4, "attention_causal": 4,
             "attention_full_mask": 4}  # a matmul op's shape: (m, n, k), (bh, lq, lk, d)
# Causal attention (is_causal, no mask) runs the flash kernel over the tiles on and below the
# diagonal only: priced at flash attention's rates (RUNS_AS) on the work of those tiles, in a
# tiled table as the waves they run in (AttentionTiling.causal_ratio), CAUSAL_CTAS_PER_SM query
# tiles resident on each SM at once (what the timed causal kernels' waves fit).
CAUSAL = "attention_causal"
CAUSAL_CTAS_PER_SM = 2
# The op whose rates an attention op falls back to where the table has none of its own: a causal
# attention runs the flash kernel; one whose mask varies along the queries (a causal or
# sliding-window mask, a padded batch's), the masked kernel, which reads that mask too.
RUNS_AS = {CAUSAL: "attention", "attention_full_mask": "attention_masked"}
MEMORY_OPS = ("norm", "elementwise", "embed")
BACKWARD = "_bwd"
# A backward kernel's FLOPs and bytes, as traces count them: twice its forward's (the kernel
# table's backward rates are work over time on this count).
BACKWARD_FLOPS_FACTOR = 2
BACKWARD_OPS = 2  # ops a real module's backward launches per op of its forward
# A real module's host phases (ModuleCost.host_ns_per_dispatch): an inference forward, a
# training forward (autograd records its graph), a backward.
HOST_PHASES = ("infer", "train", "bwd")
# The kernel table's key of a training forward's kernel: its host time (host_key), and an
# attention op's rate as a training step runs it (probed: engine/measure/compute.py).
TRAINING = "_train"
# The probe grid an op falls back to where the table has no point of its own (a table probed
# before masked attention prices it as unmasked: ExecutionTimePredictor.lacks).
GRID_OPS = {"linear": "linear", "attention": "attention", "attention_masked": "attention", "norm": "memory",
            "elementwise": "memory", "embed": "memory"}
# Memory-bound passes a spec kernel may run around its core op (Kernel.passes), by what
# sets their cost per byte (engine/models/builder.py).
PASSES = ("rms_norm", "head_rms_norm", "layer_norm", "pointwise", "broadcast", "head_copy", "transposed",
          "transposed_copy")
CORE_FLOOR = 0.25  # a recorded matmul kernel's core keeps at least this share of its time
NEIGHBOURS = 6
SAME = 1e-5  # features this close are one point (the table keeps them to 6 decimals)
BLOCKED = 10  # a kernel's host time over BLOCKED x the median: the host sat on a full launch queue
TABLE_FORMAT = "offload-engine-kernel-table"
GPU_ALONE = "gpu_alone"  # a compute probe grid's list of the ops it timed on the GPU alone
TILE = 128  # rows of a flash attention kernel's query and key tiles
RAGGED = 0.5  # feature distance between a length off TILE and one on it
TILED_OPS = ("attention", "attention_causal")  # the flash kernels (masked attention runs another one)


@dataclass(frozen=True)
class AttentionTiling:
    """How a GPU runs flash attention's tiles (module docstring): TILE-row query tiles of
    each head in waves of `sms`, each over the keys TILE at a time."""

    sms: int

    def work(self, shape: Sequence[int]) -> int:
        """FLOPs of the tiles an attention of (bh, lq, lk, d) runs: every SM's share of every
        wave, each query tile over the padded keys."""
        bh, lq, lk, d = shape
        waves = math.ceil(bh * math.ceil(lq / TILE) / self.sms)
        return 4 * waves * self.sms * TILE * math.ceil(lk / TILE) * TILE * d

    def causal_ratio(self, shape: Sequence[int]) -> float:
        """A causal attention's time over the full one's (CAUSAL): its query tiles, the
        longest first, run in waves of CAUSAL_CTAS_PER_SM x sms, each wave as long as its
        longest tile; the full kernel's waves all as long as the keys."""
        bh, lq, lk, _d = shape
        nq, nk = math.ceil(lq / TILE), math.ceil(lk / TILE)
        slots = CAUSAL_CTAS_PER_SM * self.sms
        waves = math.ceil(bh * nq / slots)
        return sum(min(nk, nq - w * slots // bh) for w in range(waves)) / (waves * nk)

    @staticmethod
    def flags(shape: Sequence[int]) -> tuple[float, float]:
        """The features of query and key lengths off the tile."""
        _bh, lq, lk, _d = shape
        return RAGGED * (lq % TILE != 0), RAGGED * (lk % TILE != 0)


def core_op(op: str) -> str:
    """A table key's bare op: without BACKWARD and TRAINING."""
    return op.removesuffix(BACKWARD).removesuffix(TRAINING)


def is_tiled(op: str, tiling: AttentionTiling | None) -> bool:
    """Whether `op`'s rates count tile work (AttentionTiling): a flash attention op, in any
    phase, in a table that knows its tiling."""
    return tiling is not None and core_op(op) in TILED_OPS


def features(op: str, shape: Sequence[int], io_bytes: int, passes: Sequence[tuple[str, int]] = (),
             tiling: AttentionTiling | None = None) -> tuple[float, ...] | None:
    """The log2 features a kernel's rate is interpolated over, or None when its
    shape does not say (a module kernel, or a spec kernel without a shape). A
    forward memory kernel with passes is keyed by its bytes of each pass kind; a tiled
    attention (is_tiled) adds its lengths' flags (AttentionTiling.flags)."""
    base, core = op.removesuffix(BACKWARD), core_op(op)
    if core in MATMUL_OPS:
        if len(shape) != CORE_DIMS[core]:
            return None
        logs = tuple(math.log2(d) for d in shape)
        return logs + AttentionTiling.flags(shape) if is_tiled(op, tiling) else logs
    if passes and op == base:
        moved = pass_bytes(passes)
        return tuple(math.log2(1 + moved[kind]) for kind in PASSES)
    return (math.log2(max(1, io_bytes)),)


def pass_bytes(passes: Sequence[tuple[str, int]]) -> dict[str, int]:
    """Bytes moved by each kind of PASSES; an unknown kind is a spec bug."""
    moved = dict.fromkeys(PASSES, 0)
    for kind, nbytes in passes:
        if kind not in moved:
            raise TraceError(f"memory pass kind {kind!r} is not one of {', '.join(PASSES)}")
        moved[kind] += nbytes
    return moved


def rate_keys(op: str) -> tuple[str, ...]:
    """The table keys `op`'s rate is looked up under, first found first: its own; for a
    training attention key, the same without TRAINING (a table probed before training
    attention); a backward's forward; the bare op's probe grid (GRID_OPS); for an attention op
    of RUNS_AS, then the keys of the op it falls back to, in the same phase."""
    base, core = op.removesuffix(BACKWARD), core_op(op)
    keys = [op, core + op[len(base):], base, core]
    keys += rate_keys(RUNS_AS[core] + op[len(core):]) if core in RUNS_AS else [GRID_OPS.get(core, "")]
    return tuple(dict.fromkeys(k for k in keys if k))


def causal_share(shape: Sequence[int]) -> float:
    """The share of a causal attention's (query tile, key tile) pairs the kernel runs: those on
    and below the diagonal, queries and keys aligned at their first token as torch aligns them."""
    _bh, lq, lk, _d = shape
    nq, nk = math.ceil(lq / TILE), math.ceil(lk / TILE)
    return sum(min(nk, i + 1) for i in range(nq)) / (nq * nk)


def host_key(op: str, phase: str, training: bool) -> str:
    """The kernel table's host-time key of a kernel: its op in an inference forward, op +
    TRAINING in a training forward (adapters, autograd's graph, saved-tensor hooks),
    op + BACKWARD in the backward."""
    return op + (BACKWARD if phase == "bwd" else TRAINING if training else "")


def core_flops(op: str, shape: Sequence[int]) -> int:
    """FLOPs of a matmul-bound op: 2mnk for a linear (m, n, k), 4 x bh x lq x lk x d for attention,
    a causal one's over the tiles it runs (causal_share)."""
    flops = (2 if op == "linear" else 4) * math.prod(shape)
    return round(flops * causal_share(shape)) if op == CAUSAL else flops


def core_io_bytes(op: str, shape: Sequence[int], itemsize: int = 2) -> int:
    """Bytes a matmul-bound op moves in device memory at `itemsize` bytes an element: a linear's
    input, weight and output; attention's query, key, value and output."""
    if op == "linear":
        m, n, k = shape
        return itemsize * (m * k + n * k + m * n)
    bh, lq, lk, d = shape
    return itemsize * bh * d * 2 * (lq + lk)


def work(op: str, flops: int, io_bytes: int, shape: Sequence[int] = (),
         tiling: AttentionTiling | None = None) -> int:
    """What a kernel's rate counts: FLOPs for a matmul-bound op (a tiled attention's tile
    work, a causal one's in its waves, times flops over its own FLOPs: a backward's count; a
    causal one's without the tiling, the full attention's), bytes for a memory-bound one."""
    core = core_op(op)
    if is_tiled(op, tiling) and len(shape) == CORE_DIMS["attention"]:
        tiles = tiling.work(shape) * (tiling.causal_ratio(shape) if core == CAUSAL else 1.0)
        return round(flops / core_flops(core, shape) * tiles)
    if core == CAUSAL and len(shape) == CORE_DIMS[core]:
        return round(flops / causal_share(shape))  # its waves unknown: the full attention's work
    return flops if core in MATMUL_OPS else io_bytes


@dataclass(frozen=True)
class PassCost:
    """Time of memory passes: bytes moved x ns_per_byte[kind]."""

    ns_per_byte: Mapping[str, float]

    def ns(self, passes: Sequence[tuple[str, int]]) -> float:
        return sum(self.ns_per_byte[k] * n for k, n in pass_bytes(passes).items() if n)

    def to_json(self) -> dict:
        return {"ns_per_byte": dict(self.ns_per_byte)}


@dataclass(frozen=True)
class ModuleCost:
    """What a real module's block costs besides its cores and its memory passes
    (engine/modules/census.py; the passes at the table's PassCost): `ns_per_op` of GPU time
    for each op it launches (the gap and tail of a small kernel); on the host
    `host_ns_per_op` for each op torch dispatches, views included (dispatch, the Python
    around it, the launch) and `host_ns_per_kernel` for each block (the offload hooks and
    the fetch, which a module whose weights all fit runs without); and `workspace_bytes`
    torch's allocator holds at a forward's peak beyond the tensors its ops make (library
    workspaces); `sustained_slowdown_per_pflops`, how much slower than held an inference runs
    under sustained load at a duty of 1 for each PFLOP/s its cores run at over the step (the
    GPU's clocks drop under its power limit, which the tensor cores' work draws on; 0 where no
    recording fitted it, and the profile's compute_sustained_slowdown applies); in a training
    step, `train_host_ns_per_op` for each op a forward dispatches while autograd records its
    graph (the forward, and checkpointing's recompute of it) and `backward_host_ns_per_op` for
    each op of the forward whose backward runs (0 where no training recording fitted them: the
    inference's host_ns_per_op, BACKWARD_OPS of it for a backward), fitted to recorded modules."""

    ns_per_op: float
    host_ns_per_op: float
    host_ns_per_kernel: float
    workspace_bytes: float
    sustained_slowdown_per_pflops: float
    train_host_ns_per_op: float
    backward_host_ns_per_op: float

    def to_json(self) -> dict:
        return {"ns_per_op": self.ns_per_op, "host_ns_per_op": self.host_ns_per_op,
                "host_ns_per_kernel": self.host_ns_per_kernel, "workspace_bytes": self.workspace_bytes,
                "sustained_slowdown_per_pflops": self.sustained_slowdown_per_pflops,
                "train_host_ns_per_op": self.train_host_ns_per_op,
                "backward_host_ns_per_op": self.backward_host_ns_per_op}

    def host_ns_per_dispatch(self, phase: str) -> float:
        """The host's time per dispatched op in `phase` (HOST_PHASES): an inference's
        forward, a training forward (autograd recording), or a backward (per op of its forward)."""
        if phase == "train":
            return self.train_host_ns_per_op or self.host_ns_per_op
        if phase == "bwd":
            return self.backward_host_ns_per_op or BACKWARD_OPS * self.host_ns_per_op
        return self.host_ns_per_op

    def sustained_slowdown(self, flops: float, compute_ns: float) -> float:
        """An inference's slowdown under sustained load at a duty of 1 (the simulator's), its
        cores' `flops` run in `compute_ns`."""
        return self.sustained_slowdown_per_pflops * pflops(flops, compute_ns)


def pflops(flops: float, ns: float) -> float:
    """PFLOP/s of `flops` in `ns`."""
    return flops / ns / 1e6 if ns > 0 else 0.0


@dataclass(frozen=True)
class Point:
    features: tuple[float, ...]
    rate: float  # work per ns


class KernelTable:
    """Measured rates by op: `rate(op, features)` interpolates them (module docstring);
    `host_ns[host_key(...)]` is the median host time of launching one kernel of that op
    and phase, measured in resident recorded steps (its torch calls and the fetch);
    `launches[host_key(...)]` the mean CUDA launches a record of it makes, and
    `packs[op]` the mean tensors a training forward record of it hands the saved-tensor
    hooks (recorded traces' "launches" and "packs"); `module_cost` prices a real module's
    blocks beside their cores; with `tiling`, flash attention's points are tile work and carry
    their lengths' flags (AttentionTiling)."""

    def __init__(self, points: Mapping[str, Sequence[Point]], source: str = "",
                 host_ns: Mapping[str, int] | None = None, pass_cost: PassCost | None = None,
                 launches: Mapping[str, float] | None = None, packs: Mapping[str, float] | None = None,
                 module_cost: ModuleCost | None = None, tiling: AttentionTiling | None = None):
        self.points = {op: tuple(ps) for op, ps in points.items() if ps}
        self.source = source
        self.host_ns = dict(host_ns or {})
        self.pass_cost = pass_cost
        self.launches = dict(launches or {})
        self.packs = dict(packs or {})
        self.module_cost = module_cost
        self.tiling = tiling
        self._rates: dict[tuple[str, tuple[float, ...]], float | None] = {}  # a model repeats its shapes

    def exact_rate(self, op: str, feats: tuple[float, ...]) -> float | None:
        """The median rate of `op`'s points at `feats` (to the table's rounding), or None."""
        rates = [p.rate for p in self.points.get(op, ())
                 if len(p.features) == len(feats) and math.dist(p.features, feats) < SAME]
        return statistics.median(rates) if rates else None

    def core_ns(self, op: str, shape: Sequence[int]) -> float | None:
        """ns of a matmul-bound op (linear, attention) of `shape` at its rate here; None where
        the table has no point for it."""
        rate = self.rate(op, features(op, shape, 0, tiling=self.tiling))
        return work(op, core_flops(op, shape), 0, shape, self.tiling) / rate if rate else None

    def rate(self, op: str, feats: tuple[float, ...]) -> float | None:
        key = (op, feats)
        if key not in self._rates:
            self._rates[key] = self._rate(op, feats)
        return self._rates[key]

    def _rate(self, op: str, feats: tuple[float, ...]) -> float | None:
        for key in rate_keys(op):
            points = [p for p in self.points.get(key, ()) if len(p.features) == len(feats)]
            if points:
                return _interpolate(points, feats)
        return None

    def to_json(self) -> dict:
        return {"format": TABLE_FORMAT, "source": self.source, "host_ns": dict(sorted(self.host_ns.items())),
                "launches": dict(sorted(self.launches.items())), "packs": dict(sorted(self.packs.items())),
                "passes": self.pass_cost.to_json() if self.pass_cost else None,
                "modules": self.module_cost.to_json() if self.module_cost else None,
                "attention_tiling": {"tile": TILE, "sms": self.tiling.sms} if self.tiling else None,
                "ops": {op: [[*p.features, p.rate] for p in ps] for op, ps in sorted(self.points.items())}}


def _interpolate(points: Sequence[Point], feats: tuple[float, ...]) -> float:
    dist = sorted((math.dist(p.features, feats), p.rate) for p in points)
    exact = [rate for d, rate in dist if d < SAME]
    if exact:
        return statistics.median(exact)
    near = dist[:NEIGHBOURS]
    weights = [1.0 / (d * d) for d, _ in near]
    return math.exp(sum(w * math.log(r) for w, (_, r) in zip(weights, near)) / sum(weights))


def table_from_measurements(rows: Iterable[tuple[str, tuple[float, ...], int, float]], source: str,
                            host: Iterable[tuple[str, int]] = (),
                            pass_cost: PassCost | None = None, launches: Iterable[tuple[str, int]] = (),
                            packs: Iterable[tuple[str, int]] = (),
                            tiling: AttentionTiling | None = None) -> KernelTable:
    """A table from (op, features, work, ns) rows: rows of one op and features become
    one point at their median rate; from (op, host ns) rows, the median per op; from
    (key, count) rows of launches and packs, the mean per key. `tiling`: the rows' flash
    attention features and work are its (features, work)."""
    grouped: dict[tuple[str, tuple[float, ...]], list[float]] = {}
    for op, feats, amount, ns in rows:
        if ns > 0 and amount > 0:
            grouped.setdefault((op, tuple(round(f, 6) for f in feats)), []).append(amount / ns)
    points: dict[str, list[Point]] = {}
    for (op, feats), rates in sorted(grouped.items()):
        points.setdefault(op, []).append(Point(feats, statistics.median(rates)))
    return KernelTable(points, source, medians_by_op(host), pass_cost, means_by_key(launches), means_by_key(packs),
                       tiling=tiling)


def means_by_key(rows: Iterable[tuple[str, int]]) -> dict[str, float]:
    """The mean of each key's counts from (key, count) rows."""
    grouped: dict[str, list[int]] = {}
    for key, n in rows:
        grouped.setdefault(key, []).append(n)
    return {k: round(statistics.fmean(v), 3) for k, v in sorted(grouped.items())}


def slowdown_under_copy(alone_ns: float, with_copy_ns: float) -> float:
    """How much longer a step runs beside a stream of H2D copies than alone; 0 where it
    did not run longer (the hardware profile's compute_slowdown_under_copy, or a
    recording's own)."""
    return max(0.0, with_copy_ns / alone_ns - 1)


def sustained_slowdown(held_ns: float, pipelined_ns: float) -> float:
    """How much longer a GPU-bound step runs back to back (the pipelined step, the clocks
    under sustained load) than held alone (its kernels' recorded pace); 0 where not longer
    (a recording's header "compute_sustained_slowdown", the profile's fit)."""
    return max(0.0, pipelined_ns / held_ns - 1)


def unblocked_sum(host_ns: Sequence[int]) -> int:
    """The host's own work in `host_ns` (one time per kernel): each time over BLOCKED x
    the median, where the host sat blocked on a full launch queue, counted as the median."""
    if not host_ns:
        return 0
    median = statistics.median(host_ns)
    return round(sum(ns if ns <= BLOCKED * median else median for ns in host_ns))


def medians_by_op(rows: Iterable[tuple[str, int]]) -> dict[str, int]:
    """The median of each op's values from (op, value) rows."""
    by_op: dict[str, list[int]] = {}
    for op, value in rows:
        by_op.setdefault(op, []).append(value)
    return {op: round(statistics.median(v)) for op, v in by_op.items()}


def tables_dir() -> Path:
    """conf/hardware/, where the shipped profiles and their kernel tables lie."""
    from importlib.resources import files

    return Path(str(files("conf").joinpath("hardware")))


def table_path(name: str) -> Path:
    """`hardware.kernel_table`: a file name in conf/hardware/, or a path."""
    path = Path(name).expanduser()
    return path if path.is_absolute() else tables_dir() / path


@lru_cache(maxsize=8)
def load_table(name: str) -> KernelTable:
    path = table_path(name)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"hardware.kernel_table={name}: no file {path}; write one with mode=calibrate, "
                          "or set hardware.kernel_table=null for the roofline") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"hardware.kernel_table={name}: {path} is not JSON ({e.msg}); write it again "
                          "with mode=calibrate") from None
    if not isinstance(data, dict) or data.get("format") != TABLE_FORMAT or not isinstance(data.get("ops"), dict):
        raise ConfigError(f"hardware.kernel_table={name}: {path} is not a kernel table "
                          f"(format {TABLE_FORMAT!r}); write it with mode=calibrate")
    points = {op: [Point(tuple(row[:-1]), float(row[-1])) for row in rows] for op, rows in data["ops"].items()}
    host = data.get("host_ns", {})
    counts = {key: {str(k): float(v) for k, v in data.get(key, {}).items()} for key in ("launches", "packs")}
    cost = data.get("passes")
    cost = PassCost({str(k): float(v) for k, v in cost["ns_per_byte"].items()}) if cost else None
    missing = [k for k in PASSES if cost is not None and k not in cost.ns_per_byte]
    if missing:
        raise ConfigError(f"hardware.kernel_table={name}: {path} has no cost for the memory pass kind "
                          f"{missing[0]!r} (fitted before it existed); write it again with mode=calibrate")
    modules = data.get("modules")
    module_fields = [f.name for f in fields(ModuleCost)]
    if modules and "ns_per_element" in modules:
        raise ConfigError(f"hardware.kernel_table={name}: {path} prices real modules' memory-bound ops by their "
                          "elements (fitted before they were priced as memory passes); write it again with "
                          "mode=calibrate")
    if modules and any(k not in modules for k in module_fields):
        raise ConfigError(f"hardware.kernel_table={name}: {path} prices real modules without "
                          f"{', '.join(k for k in module_fields if k not in modules)} (fitted before it existed); "
                          "write it again with mode=calibrate")
    module_cost = ModuleCost(**{k: float(modules[k]) for k in module_fields}) if modules else None
    tiles = data.get("attention_tiling")
    if tiles and tiles.get("tile") != TILE:
        raise ConfigError(f"hardware.kernel_table={name}: {path} counts attention in tiles of {tiles.get('tile')} "
                          f"rows, this engine in tiles of {TILE}; write it again with mode=calibrate")
    return KernelTable(points, str(data.get("source", "")), {str(op): int(ns) for op, ns in host.items()}, cost,
                       counts["launches"], counts["packs"], module_cost,
                       AttentionTiling(int(tiles["sms"])) if tiles else None)


class ExecutionTimePredictor:
    """A kernel's run time from its op, FLOPs, device-memory traffic and shape."""

    def __init__(self, hardware: Any):
        self.flops_per_ns = float(hardware.matmul_tflops) * 1e3  # 1e12 FLOP/s = 1e3 FLOP/ns
        self.hbm_bytes_per_ns = float(hardware.hbm_gbps)  # 1e9 B/s = 1 B/ns
        self.launch_ns = float(getattr(hardware, "kernel_launch_us", 0.0)) * 1e3
        name = getattr(hardware, "kernel_table", None)
        self.table = load_table(name) if name else None
        t = self.table
        per_launch = [] if t is None else [t.host_ns[op] / t.launches[op] for op in t.host_ns
                                           if op in MATMUL_OPS + MEMORY_OPS and t.launches.get(op, 0) > 0]
        self._launch_host_ns = statistics.median(per_launch) if per_launch else self.launch_ns

    @property
    def module_cost(self) -> ModuleCost | None:
        return self.table.module_cost if self.table is not None else None

    def module_kernel_ns(self, cores: Sequence[tuple[str, Sequence[int]]], passes: Sequence[tuple[str, int]],
                         ops: int, backward: bool = False, trained: Sequence[Sequence[int]] = (),
                         training: bool = False) -> int:
        """A real module's block from its census (engine/modules/census.py): each core by op
        and shape, its memory passes (`passes_ns`) and each op's launch gap at the table's
        ModuleCost (none without one). `backward`: the block's backward (`backward_core_ns`
        for each core, and for each of the `trained` linears, (m, n, k), the weight's
        gradient: the matmul (n, k, m)), its ops launched BACKWARD_OPS times.
        `training`: its attention at a training step's rates (TRAINING)."""
        if backward:
            cores_ns = sum(self.backward_core_ns(op, shape, training) for op, shape in cores)
            cores_ns += sum(self.core_ns("linear", (n, k, m)) for m, n, k in trained)
        else:
            cores_ns = sum(self.core_ns(op, shape, training) for op, shape in cores)
        ops = ops * BACKWARD_OPS if backward else ops
        gaps = ops * self.module_cost.ns_per_op if self.module_cost is not None else 0.0
        return max(1, round(cores_ns + self.passes_ns(passes) + gaps))

    def passes_ns(self, passes: Sequence[tuple[str, int]]) -> float:
        """Memory passes ((kind, amount) each: Kernel.passes, a census's) at the table's
        PassCost; without one, their amounts through HBM at hbm_gbps."""
        if self.table is not None and self.table.pass_cost is not None:
            return self.table.pass_cost.ns(passes)
        return sum(n for _, n in passes) / self.hbm_bytes_per_ns

    def core_ns(self, op: str, shape: Sequence[int], training: bool = False) -> int:
        """A census core (engine/modules/census.py) by op and shape; `training`: attention
        at a training step's rate (TRAINING)."""
        return self.kernel_ns(op, core_flops(op, shape), core_io_bytes(op, shape), shape, training=training)

    def backward_core_ns(self, op: str, shape: Sequence[int], training: bool = False) -> int:
        """A core's backward with its weight frozen: a linear's gradient by its input is the
        same matmul with n and k swapped, at the forward's rate; attention's at the table's
        backward rate (`training`: a training step's, TRAINING), its work counted
        BACKWARD_FLOPS_FACTOR times as traces count it."""
        if op == "linear":
            m, n, k = shape
            return self.core_ns(op, (m, k, n))
        f = BACKWARD_FLOPS_FACTOR
        return self.kernel_ns(op, f * core_flops(op, shape), f * core_io_bytes(op, shape), shape, backward=True,
                              training=training)

    def module_host_ns(self, ops: int, dispatches: int, hooked: bool = True, phase: str = "infer") -> int:
        """Host time of a real module's block that launches `ops` ops of `dispatches` in its
        forward, run in `phase` (HOST_PHASES: "bwd" is that forward's backward), through
        offload's hooks or (`hooked` False) without: the table's ModuleCost, else each op at
        the host time of one CUDA launch (launch_host_ns), BACKWARD_OPS of them in a backward."""
        if phase not in HOST_PHASES:
            raise ValueError(f"module_host_ns: phase {phase!r} is not one of {', '.join(HOST_PHASES)}")
        cost = self.module_cost
        if cost is None:
            return round(ops * (BACKWARD_OPS if phase == "bwd" else 1) * self.launch_host_ns())
        return round(dispatches * cost.host_ns_per_dispatch(phase) + (cost.host_ns_per_kernel if hooked else 0.0))

    def launch_host_ns(self) -> float:
        """The host time of one CUDA launch: the median over the table's inference ops of
        their host time over their launches, where it has both; else kernel_launch_us. (A
        calibrated profile's kernel_launch_us is a whole spec kernel's host time, several
        launches with the model's Python around them, not one launch's.) Fixed at construction."""
        return self._launch_host_ns

    def kernel_ns(self, op: str, flops: int, io_bytes: int, shape: Sequence[int] = (),
                  backward: bool = False, passes: Sequence[tuple[str, int]] = (), training: bool = False) -> int:
        """`passes` are the forward kernel's memory passes (Kernel.passes); on the
        roofline they add to a matmul's time and are a memory op's traffic. `training`: an
        attention op at a training step's rate (TRAINING)."""
        if op not in MATMUL_OPS + MEMORY_OPS:
            raise TraceError(
                f"no time predictor for op {op!r}; use one of {', '.join(MATMUL_OPS + MEMORY_OPS)} in the spec")
        passes = () if backward else passes
        if self.table is not None:
            ns = _table_ns(self.table, op, flops, io_bytes, shape, backward, passes, training)
            if ns is not None:
                # Never under its bytes' time through HBM: a skinny matmul (a LoRA adapter's,
                # rank 32 against thousands of features) lies far from the points it is
                # interpolated between, which run at compute-bound rates.
                return max(1, round(max(ns, io_bytes / self.hbm_bytes_per_ns)))
        memory_ns = io_bytes / self.hbm_bytes_per_ns
        passes_ns = sum(pass_bytes(passes).values()) / self.hbm_bytes_per_ns
        if op in MATMUL_OPS:
            ns = max(flops / self.flops_per_ns, memory_ns) + passes_ns
        else:
            ns = passes_ns or memory_ns
        # Integer nanoseconds, at least 1: a launched kernel always takes time.
        return max(1, round(ns))

    def untiled_note(self, cores: Iterable[tuple[str, Sequence[int]]]) -> str | None:
        """A line saying that flash attention (TILED_OPS) in `cores` ((op, shape) pairs) runs at a
        length off the tile this profile prices as on it (a table without AttentionTiling, or none); None
        where no such attention is priced."""
        if self.table is not None and self.table.tiling is not None:
            return None
        ragged = next((shape for op, shape in cores if op in TILED_OPS and len(shape) == CORE_DIMS[op]
                       and any(AttentionTiling.flags(shape))), None)
        if ragged is None:
            return None
        _bh, lq, lk, _d = ragged
        table = "this profile's kernel table was probed without attention's tiles" if self.table is not None \
            else "this profile has no kernel table"
        return (f"attention over {lq} x {lk} tokens is off the {TILE}-token tile, where it runs slower per FLOP, and "
                f"{table}: it is priced fast; probe the tiles on this GPU (python -m "
                "engine.measure.compute --only attention_tiles --out FILE) and calibrate with --probes FILE, as "
                "hardware=h200 is")

    def host_ns(self, op: str, phase: str = "fwd", training: bool = False) -> int:
        """Host time to launch one kernel of `op` in `phase`, from the table; 0 (the
        profile's kernel_launch_us applies) where the table has none."""
        return self.table.host_ns.get(host_key(op, phase, training), 0) if self.table is not None else 0

    def launches(self, op: str, phase: str = "fwd", training: bool = False) -> int:
        """CUDA launches one kernel of `op` in `phase` makes, from the table; 0 (not
        counted: the simulator takes one) where the table has none."""
        n = self.table.launches.get(host_key(op, phase, training), 0.0) if self.table is not None else 0.0
        return max(1, round(n)) if n else 0

    def packs(self, op: str, saved: int) -> int:
        """Tensors a training forward kernel of `op` that saves `saved` activations hands the
        saved-tensor hooks: the table's mean for the op, at least `saved`."""
        n = self.table.packs.get(op, 0.0) if self.table is not None else 0.0
        return max(saved, round(n))


def _table_ns(table: KernelTable, op: str, flops: int, io_bytes: int, shape: Sequence[int], backward: bool,
              passes: Sequence[tuple[str, int]], training: bool = False) -> float | None:
    feats = features(op, shape, io_bytes, passes, table.tiling)
    if feats is None:
        return None
    amount = work(op, flops, io_bytes, shape, table.tiling)
    if backward or not passes:
        key = op + (TRAINING if training and op in ATTENTION_OPS else "") + (BACKWARD if backward else "")
        rate = table.rate(key, feats)
        return amount / rate if rate else None
    # No pass cost: a table fitted before passes, whose points hold them.
    extra = table.pass_cost.ns(passes) if table.pass_cost else None
    if op in MATMUL_OPS:
        rate = table.rate(op, feats)
        return None if rate is None else amount / rate + (extra or 0.0)
    rate = table.exact_rate(op, feats)
    if rate:
        return amount / rate
    if extra is not None:
        return extra
    rate = table.rate(op, features(op, shape, io_bytes))
    return amount / rate if rate else None
