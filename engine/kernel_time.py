"""Kernel time from its op and shape: the compute model of synthesized traces (its
vocabulary, ops, features, work and memory passes: engine/compute.py).

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
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from engine.compute import (ATTENTION_OPS, BACKWARD, BACKWARD_FLOPS_FACTOR, BACKWARD_OPS, CORE_DIMS, HOST_PHASES,
                            MATMUL_OPS, MEMORY_OPS, PASSES, TILE, TILED_OPS, TRAINING, AttentionTiling, ModuleCost,
                            PassCost, core_flops, core_io_bytes, core_op, features, host_key, pass_bytes, rate_keys,
                            work)
from engine.errors import ConfigError, TraceError

NEIGHBOURS = 6
SAME = 1e-5  # features this close are one point (the table keeps them to 6 decimals)
TABLE_FORMAT = "offload-engine-kernel-table"

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
                         ops: int, training: bool = False,
                         backward_cores: Sequence[tuple[str, Sequence[int]]] = ()) -> int:
        """A real module's block from its census (engine/modules/census.py): each core by op
        and shape, each of its `backward_cores` (attention's backward, a backward's census) at
        `backward_core_ns`, its memory passes (`passes_ns`) and each op's launch gap at the
        table's ModuleCost (none without one). `training`: its attention at a training step's
        rates (TRAINING)."""
        cores_ns = sum(self.core_ns(op, shape, training) for op, shape in cores)
        cores_ns += sum(self.backward_core_ns(op, shape, training) for op, shape in backward_cores)
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

    def table_notes(self, cores: Iterable[tuple[str, Sequence[int]]]) -> list[str]:
        """The lines saying where this profile prices `cores` ((op, shape) pairs) from points
        that do not cover them (untiled_note, head_width_note)."""
        cores = list(cores)
        return [n for n in (self.untiled_note(cores), self.head_width_note(cores)) if n]

    def head_width_note(self, cores: Iterable[tuple[str, Sequence[int]]]) -> str | None:
        """A line saying that attention in `cores` has heads wider or narrower than any the
        kernel table's attention points hold, priced from the nearest width, where the kernels
        change with the width (the memory-efficient backward past 128); None where the table
        covers them, or has no attention points."""
        if self.table is None:
            return None
        widths = {round(2 ** p.features[3]) for op, points in self.table.points.items()
                  if core_op(op) in ATTENTION_OPS for p in points}
        outside = sorted({shape[3] for op, shape in cores if op in ATTENTION_OPS and len(shape) == CORE_DIMS[op]
                          and widths and not min(widths) <= shape[3] <= max(widths)})
        if not outside:
            return None
        dims = ",".join(map(str, outside))
        return (f"attention with heads {dims} wide: this profile's kernel table holds attention at widths "
                f"{', '.join(map(str, sorted(widths)))} only, so it is priced from the nearest, and kernels change "
                f"with the width; probe it on this GPU (python -m engine.measure.compute --head-dims {dims} --out "
                "FILE) and calibrate with --probes FILE, as hardware=h200 is at 256")

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
