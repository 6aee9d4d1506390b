"""Traces: one step's kernels in launch order, what each reads, how long it runs.

A trace is what the simulator replays and what the executor records. It is
either *synthesized* from a model spec and a hardware profile (engine/models/synthesize.py;
a real module's from its meta-device run, engine/modules/synthesize.py) or *recorded* from a
real run.

File format ("offload-engine-trace", version 1)
------------------------------------------------
JSON lines, UTF-8; a name ending in ``.gz`` is gzip-compressed.

Line 1, the header, one JSON object:

    format        "offload-engine-trace"
    version       1
    records       number of record lines that follow (a shorter file is truncated)
    weight_sizes  {weight name: bytes} for every weight any record reads
    source        "synthesized" | "recorded"
    model, workload, hardware, torch, cuda, date   provenance (free-form)
    probes        recorded traces: copy, allocation, host and compute-under-copy
                  measurements that mode=calibrate fits (engine/measure/probes.py PROBES_DOC);
                  other extra header keys are provenance and kept as they are
    host_syncs    optional: record positions the step's host reaches only once every
                  kernel launched before has run (a recorded module that synchronizes;
                  the simulator's host waits there)
    block_records optional: true where each record is a block of many launches (a
                  recorded module); its GPU work starts with its first launch
    compute_slowdown_under_copy  optional: the recorded step's own slowdown beside
                  H2D copies (engine/compute.py slowdown_under_copy); the simulator
                  takes it over the hardware profile's

Lines 2.., one JSON object per kernel, in launch order:

    name        str    kernel name (backward kernels: forward name + ".bwd")
    layer       int    block index, -1 outside the blocks
    phase       str    "fwd" | "bwd"
    weights     [str]  weights the kernel reads, each a key of weight_sizes
    compute_ns  int    time the kernel runs on the compute stream
    flops       int
    io_bytes    int    bytes the kernel reads and writes in device memory
    saved       [{"name": str, "nbytes": int, "layer": int}]
                       tensors autograd saves for backward (forward records);
                       names unique across the trace
    needs       [str]  saved-tensor names this backward record unpacks first: saved by
                       its forward mirror, or by an earlier forward record when a later
                       kernel saved that storage again (backward meets the last saver
                       first); each name at most once in the trace
    copies      [{...}] optional: copies observed around the kernel (recorded
                       traces: {dir, nbytes, ns} of each weight copy its fetch issued
                       in a streamed forward; the simulator ignores them)
    host_ns     int    optional: host time to launch the kernel's work, measured
                       (recorded module traces, where a kernel is a whole block;
                       recorded spec traces, the median of its op and phase) or from
                       the kernel table (synthesized); absent or 0: the hardware
                       profile's kernel_launch_us
    op          str    optional: the spec kernel's op ("linear", "attention", "norm",
                       "elementwise", "embed"); absent for module kernels
    shape       [int]  optional: the spec kernel's shape (engine/models/spec.py Kernel),
                       what mode=calibrate fits kernel time against
    passes      [[str, int]]  optional: the kernel's memory passes, (kind, bytes moved)
                       each (engine/compute.py PASSES): a spec kernel's (Kernel.passes),
                       or a module record's other ops, by kind (engine/modules/census.py)
    launches    int    optional: the CUDA launches (kernels, copies, memsets) the record's
                       host work makes, counted by the recorder (engine/measure/launches.py)
                       or from the kernel table (synthesized); absent or 0: not counted,
                       and the simulator takes one launch a record
    packs       int    optional, forward records: the tensors autograd hands the saved-tensor
                       hooks while the record runs (weights and duplicates among them, so at
                       least len(saved)); absent or 0: len(saved)
    cores       [[str, int...]]  optional, module records: the matmul-bound ops the block runs,
                       [op, *shape] each ("linear" m, n, k; "attention", "attention_masked",
                       "attention_full_mask" or "attention_causal" bh, lq, lk, d), counted op by
                       op (engine/modules/census.py)
    ops         int    optional, module records: the ops it runs that make a tensor, views aside
    dispatches  int    optional, module records: every op torch dispatches for it, views included

A record's "memory_elements" (module records written before their census had passes) is
read and dropped: nothing prices by it now.

Order: all forward records first; a training trace then has one backward
record per forward record, in reverse order. `read_trace` checks all of this
and raises `TraceError` naming the line.
"""
from __future__ import annotations

import gzip
import json
import zlib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import IO, Any, Iterator, Mapping, Sequence

from engine.compute import CORE_DIMS, PASSES
from engine.errors import TraceError
from engine.policy import AccessOrder
from engine.models.spec import SavedTensor


FORMAT = "offload-engine-trace"
VERSION = 1
PHASES = ("fwd", "bwd")
BACKWARD_SUFFIX = ".bwd"


@dataclass(frozen=True)
class KernelRecord:
    """One kernel of the trace (see the module docstring for each field)."""

    name: str
    layer: int
    phase: str
    weights: tuple[str, ...]
    compute_ns: int
    flops: int
    io_bytes: int
    saved: tuple[SavedTensor, ...] = ()
    needs: tuple[str, ...] = ()
    copies: tuple[dict, ...] = ()
    host_ns: int = 0
    op: str = ""
    shape: tuple[int, ...] = ()
    passes: tuple[tuple[str, int], ...] = ()
    launches: int = 0
    packs: int = 0
    cores: tuple[tuple[str, tuple[int, ...]], ...] = ()
    ops: int = 0
    dispatches: int = 0


@dataclass(frozen=True)
class Trace:
    header: dict
    weight_sizes: dict[str, int]
    records: tuple[KernelRecord, ...]

    def access_order(self) -> AccessOrder:
        """The order the weight policy plans over: one step, forward then backward."""
        return AccessOrder(
            kernels=tuple(r.name for r in self.records),
            reads=tuple(r.weights for r in self.records),
            sizes=dict(self.weight_sizes),
        )

    @property
    def num_layers(self) -> int:
        return max((r.layer for r in self.records), default=-1) + 1


# ---------------------------------------------------------------- file format

def _open(path: Path, mode: str) -> IO[str]:
    if path.name.endswith(".gz"):
        return gzip.open(path, mode + "t", encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def _record_json(r: KernelRecord) -> dict:
    out = {
        "name": r.name, "layer": r.layer, "phase": r.phase, "weights": list(r.weights),
        "compute_ns": r.compute_ns, "flops": r.flops, "io_bytes": r.io_bytes,
        "saved": [{"name": s.name, "nbytes": s.nbytes, "layer": s.layer} for s in r.saved],
        "needs": list(r.needs),
    }
    if r.copies:
        out["copies"] = list(r.copies)
    if r.host_ns:
        out["host_ns"] = r.host_ns
    if r.op:
        out["op"] = r.op
    if r.shape:
        out["shape"] = list(r.shape)
    if r.passes:
        out["passes"] = [list(p) for p in r.passes]
    if r.launches:
        out["launches"] = r.launches
    if r.packs:
        out["packs"] = r.packs
    if r.cores:
        out["cores"] = [[op, *shape] for op, shape in r.cores]
    if r.ops:
        out["ops"] = r.ops
    if r.dispatches:
        out["dispatches"] = r.dispatches
    return out


def write_trace(path: str | Path, trace: Trace) -> None:
    path = Path(path)
    header = {**trace.header, "format": FORMAT, "version": VERSION, "records": len(trace.records),
              "weight_sizes": trace.weight_sizes}
    with _open(path, "w") as f:
        f.write(json.dumps(header) + "\n")
        for r in trace.records:
            f.write(json.dumps(_record_json(r)) + "\n")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


_FIELD_CHECKS = {
    "name": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "layer": (lambda v: _is_int(v) and v >= -1, "an integer >= -1"),
    "phase": (lambda v: v in PHASES, '"fwd" or "bwd"'),
    "weights": (_is_str_list, "a list of weight names"),
    "compute_ns": (lambda v: _is_int(v) and v >= 0, "an integer >= 0 (nanoseconds)"),
    "flops": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "io_bytes": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "saved": (lambda v: isinstance(v, list), "a list of {name, nbytes, layer}"),
    "needs": (_is_str_list, "a list of saved-tensor names"),
}
_OPTIONAL = {"copies": (lambda v: isinstance(v, list) and all(isinstance(c, dict) for c in v),
                        "a list of objects"),
             "host_ns": (lambda v: _is_int(v) and v >= 0, "an integer >= 0 (nanoseconds)"),
             "op": (lambda v: isinstance(v, str), "a string"),
             "shape": (lambda v: isinstance(v, list) and all(_is_int(d) and d > 0 for d in v),
                       "a list of integers > 0"),
             "passes": (lambda v: isinstance(v, list) and all(
                 isinstance(p, list) and len(p) == 2 and p[0] in PASSES and _is_int(p[1]) and p[1] >= 0
                 for p in v), f"a list of [kind, bytes] pairs, kind one of {', '.join(PASSES)}"),
             "launches": (lambda v: _is_int(v) and v >= 0, "an integer >= 0 (CUDA launches)"),
             "packs": (lambda v: _is_int(v) and v >= 0, "an integer >= 0 (saved-tensor hook calls)"),
             "cores": (lambda v: isinstance(v, list) and all(
                 isinstance(c, list) and len(c) == 1 + CORE_DIMS.get(c[0] if c else None, -1)
                 and all(_is_int(d) and d > 0 for d in c[1:]) for c in v),
                 'a list of [op, *shape]: ["linear", m, n, k] or ["attention" | "attention_masked" | '
                 '"attention_full_mask" | "attention_causal", bh, lq, lk, d]'),
             "ops": (lambda v: _is_int(v) and v >= 0, "an integer >= 0 (ops)"),
             "dispatches": (lambda v: _is_int(v) and v >= 0, "an integer >= 0 (ops dispatched)")}
_RECORD_FIELDS = tuple(f.name for f in fields(KernelRecord))
_DROPPED = {"memory_elements"}  # module docstring


def _parse_saved(raw: list, where: str) -> tuple[SavedTensor, ...]:
    out = []
    for s in raw:
        if not (isinstance(s, dict) and isinstance(s.get("name"), str) and _is_int(s.get("nbytes"))
                and s["nbytes"] >= 0 and _is_int(s.get("layer"))):
            raise TraceError(f"{where}: each saved tensor must be {{name: str, nbytes: int >= 0, layer: int}}, "
                             f"got {s!r}")
        out.append(SavedTensor(s["name"], s["nbytes"], s["layer"]))
    return tuple(out)


def _parse_record(obj: Any, where: str) -> KernelRecord:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: a record must be a JSON object, got {type(obj).__name__}")
    for key, (ok, what) in _FIELD_CHECKS.items():
        if key not in obj:
            raise TraceError(f"{where}: record is missing field {key!r}; every record needs "
                             f"{', '.join(_FIELD_CHECKS)}")
        if not ok(obj[key]):
            raise TraceError(f"{where}: field {key!r} must be {what}, got {obj[key]!r}")
    for key, (ok, what) in _OPTIONAL.items():
        if key in obj and not ok(obj[key]):
            raise TraceError(f"{where}: field {key!r} must be {what}, got {obj[key]!r}")
    unknown = set(obj) - set(_RECORD_FIELDS) - _DROPPED
    if unknown:
        raise TraceError(f"{where}: unknown record field(s) {', '.join(sorted(unknown))}; "
                         f"version {VERSION} records have {', '.join(_RECORD_FIELDS)}")
    return KernelRecord(
        name=obj["name"], layer=obj["layer"], phase=obj["phase"], weights=tuple(obj["weights"]),
        compute_ns=obj["compute_ns"], flops=obj["flops"], io_bytes=obj["io_bytes"],
        saved=_parse_saved(obj["saved"], where), needs=tuple(obj["needs"]),
        copies=tuple(obj.get("copies", ())), host_ns=obj.get("host_ns", 0), op=obj.get("op", ""),
        shape=tuple(obj.get("shape", ())), passes=tuple((p[0], p[1]) for p in obj.get("passes", ())),
        launches=obj.get("launches", 0), packs=obj.get("packs", 0),
        cores=tuple((c[0], tuple(c[1:])) for c in obj.get("cores", ())),
        ops=obj.get("ops", 0), dispatches=obj.get("dispatches", 0))


def _parse_header(line: str) -> dict:
    try:
        header = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"line 1: header is not JSON ({e.msg}); is this an offload-engine trace?") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise TraceError(f'line 1: not an offload-engine trace (header "format" must be "{FORMAT}")')
    if header.get("version") != VERSION:
        raise TraceError(f"line 1: trace version {header.get('version')!r} is not supported; this reader "
                         f"reads version {VERSION}: re-record or re-synthesize the trace")
    if not (_is_int(header.get("records")) and header["records"] >= 0):
        raise TraceError('line 1: header needs "records", the number of records (an integer >= 0)')
    sizes = header.get("weight_sizes")
    if not (isinstance(sizes, dict) and all(_is_int(v) and v >= 0 for v in sizes.values())):
        raise TraceError('line 1: header needs "weight_sizes", {weight name: bytes}')
    return header


def _lines(path: Path) -> Iterator[str]:
    try:
        with _open(path, "r") as f:
            yield from f
    except FileNotFoundError:
        raise TraceError(f"{path}: no such trace file") from None
    except UnicodeDecodeError:
        raise TraceError(f"{path}: not UTF-8 text; a trace is JSON lines (.jsonl, or .jsonl.gz)") from None
    except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as e:
        raise TraceError(f"{path}: cannot read ({e}); the file is truncated or corrupt: record it again") from None


def read_trace(path: str | Path) -> Trace:
    """Read and check a trace file; raises TraceError naming the bad line."""
    path = Path(path)
    header: dict | None = None
    records: list[KernelRecord] = []
    lineno = 0
    for lineno, line in enumerate(_lines(path), start=1):
        if lineno == 1:
            header = _parse_header(line)
            continue
        if not line.strip():
            raise TraceError(f"line {lineno}: empty line inside the trace; records are one JSON object a line")
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"line {lineno}: not JSON ({e.msg}); the file may be truncated") from None
        records.append(_parse_record(obj, f"line {lineno}"))
    if header is None:
        raise TraceError(f"line 1: {path} is empty, not a trace")
    if not records:
        raise TraceError(f"{path}: the trace has a header but no kernel records; record it again with mode=record")
    if len(records) != header["records"]:
        raise TraceError(f"line {lineno + 1 if len(records) < header['records'] else lineno}: "
                         f"header says {header['records']} records, file has {len(records)}; "
                         "the file is truncated or was appended to")
    sizes = header.pop("weight_sizes")
    trace = Trace(header=header, weight_sizes=dict(sizes), records=tuple(records))
    check_trace(trace)
    return trace


def check_trace(trace: Trace) -> None:
    """Cross-record rules; messages name the record's line in the file (record i is line i+2)."""
    sizes: Mapping[str, int] = trace.weight_sizes
    forward: list[KernelRecord] = []
    backward = 0
    saved_names: set[str] = set()
    saver: dict[str, int] = {}  # saved name -> index of its forward record
    needed: set[str] = set()
    for key in ("compute_slowdown_under_copy", "compute_sustained_slowdown"):
        slowdown = trace.header.get(key, 0.0)
        if isinstance(slowdown, bool) or not isinstance(slowdown, (int, float)) or not 0 <= slowdown < 10:
            raise TraceError(f'line 1: header "{key}" must be a number from 0 (no slowdown) '
                             "to under 10; fix it or remove the key")
    syncs = trace.header.get("host_syncs", [])
    if not (isinstance(syncs, list) and all(_is_int(p) and 0 <= p < len(trace.records) for p in syncs)):
        raise TraceError('line 1: header "host_syncs" must list record positions (integers from 0 to '
                         f'{len(trace.records) - 1}); fix it or remove the key')
    for i, r in enumerate(trace.records):
        where = f"line {i + 2} ({r.name})"
        for w in r.weights:
            if w not in sizes:
                raise TraceError(f"{where}: weight {w!r} is not in the header's weight_sizes; "
                                 "add its size or fix the name")
        for s in r.saved:
            if s.name in saved_names:
                raise TraceError(f"{where}: saved tensor {s.name!r} is saved twice; saved names must be "
                                 "unique (prefix the kernel name)")
            saved_names.add(s.name)
            saver[s.name] = len(forward)
        if r.phase == "fwd":
            if backward:
                raise TraceError(f"{where}: forward record after a backward one; forward records come first")
            if r.needs:
                raise TraceError(f"{where}: a forward record cannot unpack saved tensors (needs must be empty)")
            forward.append(r)
            continue
        if r.saved:
            raise TraceError(f"{where}: a backward record cannot save tensors (saved must be empty)")
        if backward >= len(forward):
            raise TraceError(f"{where}: more backward records than forward ones")
        at = len(forward) - 1 - backward
        mirror = forward[at]
        if r.name != mirror.name + BACKWARD_SUFFIX:
            raise TraceError(f"{where}: backward must run the forward in reverse; expected "
                             f"{mirror.name + BACKWARD_SUFFIX!r} here")
        for n in r.needs:
            if saver.get(n, at + 1) > at:
                raise TraceError(f"{where}: needs {n!r}, which neither {mirror.name} nor an earlier forward "
                                 "record saves")
            if n in needed:
                raise TraceError(f"{where}: needs {n!r} a second time; a saved tensor is unpacked first once")
            needed.add(n)
        backward += 1
    if backward and backward != len(forward):
        raise TraceError(f"line {len(trace.records) + 1}: backward stops after {backward} of "
                         f"{len(forward)} records; the backward must mirror the whole forward")


def saving_layers(layers: Sequence[int]) -> list[int]:
    """The layer each kernel's saved tensors belong to, as the activation offloader counts
    them: the block entered last (its layer hooks enter blocks only), layer 0 before the
    first. A checkpointed block's input is saved before its hooks run, so it counts with
    the block before it, in both."""
    out, current = [], 0
    for layer in layers:
        current = layer if layer >= 0 else current
        out.append(current)
    return out


def saved_tensors(kernels: Sequence[str], layers: Sequence[int], saved: Mapping[int, Sequence[int]],
                  last_saver: Mapping[tuple[int, int], int]) -> tuple[list[tuple[SavedTensor, ...]], dict[int, list[str]]]:
    """A module's training forward as the activation offloader sees it: each position's saved
    tensors (bytes of each new storage in `saved`, named KERNEL/tK, in the layer
    `saving_layers` counts from the kernels' `layers`), and by position the names its
    backward mirror unpacks first: a tensor saved again by a later kernel (`last_saver`) is
    needed at that kernel's mirror."""
    layers = saving_layers(layers)
    out = [tuple(SavedTensor(f"{kernels[i]}/t{k}", nbytes, layers[i]) for k, nbytes in enumerate(saved.get(i, ())))
           for i in range(len(kernels))]
    needs: dict[int, list[str]] = {}
    for i, tensors in enumerate(out):
        for k, s in enumerate(tensors):
            needs.setdefault(last_saver.get((i, k), i), []).append(s.name)
    return out, needs


# A pipelined step this far over its kernels' own time (the held GPU step) is the host's: under it,
# the GPU's clocks, sagging under sustained load, account for the difference.
HOST_BOUND_STEP = 1.10


def host_bound(kernels_ns: int, pipelined_ns: int) -> bool:
    """Whether the host, not the GPU, sets a pipelined step's length: the step runs past its
    kernels' own time by more than the GPU's clocks sag under sustained load."""
    return pipelined_ns > HOST_BOUND_STEP * kernels_ns


def recorded_host_bound(header: Mapping[str, Any]) -> bool:
    """Whether a recording's all-resident step was the host's (`host_bound` of its held
    kernels, "step_ns", against its pipelined step, or the plain module's where that is
    shorter, as the recorders decide it)."""
    held, pipelined = header.get("step_ns"), header.get("pipelined_step_ns")
    if not held or not pipelined:
        return False
    return host_bound(held, min(pipelined, header.get("plain_step_ns") or pipelined))


# The workload fields that change what a step runs: a trace recorded with other
# values times other kernels.
WORKLOAD_SHAPE = ("kind", "batch", "video_tokens", "audio_tokens", "text_tokens", "context_tokens", "lora_rank",
                  "checkpointing")


def check_matches(trace: Trace, model: str, num_layers: int, workload: Mapping[str, Any]) -> None:
    """A replayed trace must be of the configured model and workload; raises TraceError
    naming the first field that differs and the fix."""
    h = trace.header
    theirs = [("model", h.get("model"), model), ("model.num_layers", h.get("num_layers"), num_layers)]
    recorded = h.get("workload") or {}
    theirs += [(f"workload.{k}", recorded.get(k), workload.get(k)) for k in WORKLOAD_SHAPE if k in recorded]
    for key, was, now in theirs:
        if was is not None and was != now:
            raise TraceError(f"the trace was recorded with {key}={was}, the config has {now}; set {key}={was} "
                             "to replay it, or record this config with mode=record")
