"""Kernels' ops and the work they do: the vocabulary of the compute model (its
kernel times: engine/kernel_time.py).

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

import math
import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

from engine.errors import TraceError

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
BLOCKED = 10  # a kernel's host time over BLOCKED x the median: the host sat on a full launch queue
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
    attention); a backward's forward; the bare op's probe grid (GRID_OPS). An attention op of
    RUNS_AS takes the op it runs as in each of those phases right after its own: a training
    step's full mask runs the masked kernel's training rates, not the kernel inference picks
    for it (cuDNN's, whose full-mask points the table holds)."""
    base, core = op.removesuffix(BACKWARD), core_op(op)
    phases = [op, core + op[len(base):], base, core]
    if core not in RUNS_AS:
        return tuple(dict.fromkeys(k for k in phases + [GRID_OPS.get(core, "")] if k))
    runs_as = rate_keys(RUNS_AS[core] + op[len(core):])
    keys = [k for own in phases for k in (own, RUNS_AS[core] + own[len(core):])]
    return tuple(dict.fromkeys(keys + list(runs_as)))


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
