"""mode=calibrate's kernel table: kernel time by op and shape, fitted to recorded traces and
compute probes (engine/kernel_time.py reads it; engine/calibrate.py writes it beside the profile
as NAME.kernels.json).

Every recorded spec kernel with its op and shape, and the probe grids of bare ops (the traces'
header probes, and probe files `python -m engine.measure.compute --out` wrote: `read_probe_file`);
host time per kernel by op and phase, times each trace's host_scale; the memory passes' cost
(`fit_pass_cost`), and matmul kernels' cores (their time less their passes); the mean CUDA
launches per record by op and phase, and saved-tensor hook calls per training forward record by
op. With module recordings (--modules): what a real module's blocks cost beside their cores
(`fit_module_cost`), and from the LoRA steps among them a training step's host per op
(`fit_training_host`).
"""
from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path
from typing import Any, Iterable, Sequence

from engine.compute import (ATTENTION_OPS, BACKWARD, BACKWARD_FLOPS_FACTOR, CORE_FLOOR, GPU_ALONE, MATMUL_OPS,
                            PASSES, TRAINING, AttentionTiling, ModuleCost, PassCost, core_flops, features, host_key,
                            pass_bytes, pflops, work)
from engine.kernel_time import KernelTable, table_from_measurements, tables_dir
from engine.errors import TraceError
from engine.trace import BACKWARD_SUFFIX, KernelRecord, Trace

PROBE_ROWS = {"linear": 4, "attention": 5, "attention_masked": 5, "attention_full_mask": 5, "attention_train": 6,
              "attention_masked_train": 6, "memory": 2, "passes": 5}  # probe row widths
MIN_PASS_BYTES = 1 << 24  # smaller memory kernels wait on the host's launches, not on HBM


def probe_median(values: Iterable[float]) -> float:
    """The median of a probe's samples (none: the trace is to be recorded again)."""
    values = list(values)
    if not values:
        raise TraceError("calibrate: a probe has no samples; re-record the trace")
    return float(statistics.median(values))


def fit_pass_cost(records: Sequence[KernelRecord], add_ns_per_byte: float | None,
                  probed: Sequence[Sequence[Any]] = ()) -> PassCost | None:
    """Each pass kind's ns per byte. From the probe's passes (`probed`: the compute probe's
    "passes" rows [kind, rows, width, declared bytes, ns, ...]) where there are any: the
    median over each kind's rows that move MIN_PASS_BYTES or more. Without them, fitted
    to the forward memory kernels with passes (norms: their passes are all they run) that
    move MIN_PASS_BYTES or more, by non-negative least squares on relative error. A kind
    neither covers costs `add_ns_per_byte` (the probe grid's largest add), or the
    pointwise kind's cost without a grid. None without either."""
    fitted = _probed_rates(probed) if probed else _recorded_rates(records)
    if fitted is None:
        return None
    default = add_ns_per_byte if add_ns_per_byte is not None else fitted.get("pointwise")
    if default is None and len(fitted) < len(PASSES):
        return None
    return PassCost({k: round(fitted.get(k, default), 8) for k in PASSES})


def _probed_rates(probed: Sequence[Sequence[Any]]) -> dict[str, float]:
    """Each probed kind's median ns per byte over its points of MIN_PASS_BYTES or more."""
    by_kind: dict[str, list[float]] = {}
    for kind, _rows, _width, nbytes, ns, *_ in probed:
        if kind in PASSES and nbytes >= MIN_PASS_BYTES and ns > 0:
            by_kind.setdefault(kind, []).append(ns / nbytes)
    return {k: probe_median(v) for k, v in by_kind.items()}


def _recorded_rates(records: Sequence[KernelRecord]) -> dict[str, float] | None:
    """Each kind's ns per byte that the recorded forward memory kernels of MIN_PASS_BYTES or
    more ran at, by non-negative least squares on relative error (the kinds they run)."""
    import numpy as np

    rows = []
    for r in records:
        moved = pass_bytes(r.passes)
        if r.phase == "fwd" and r.op and r.op not in MATMUL_OPS and r.passes and r.compute_ns > 0 \
                and sum(moved.values()) >= MIN_PASS_BYTES:
            rows.append([moved[k] / r.compute_ns for k in PASSES])
    if not rows:
        return None
    a = np.array(rows)
    y = np.ones(len(rows))
    seen = [j for j in range(a.shape[1]) if a[:, j].any()]
    best, best_err = None, float("inf")
    for n in range(1, len(seen) + 1):  # the non-negative optimum is one subset's least squares
        for cols in itertools.combinations(seen, n):
            x, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            err = float(np.sum((a[:, cols] @ x - y) ** 2))
            if (x >= 0).all() and err < best_err:
                best, best_err = {c: float(v) for c, v in zip(cols, x)}, err
    if best is None:
        return None
    return {k: best.get(j, 0.0) for j, k in enumerate(PASSES) if j in seen}


def _rate_records(trace: Trace) -> list:
    """The records of `trace` whose times are kernel rates: all but a training step's forward,
    whose kernels also run their LoRA adapters and save tensors for the backward (an inference
    of the same shape priced from them runs slow); the synthesized training forward takes an
    inference's rates."""
    return [r for r in trace.records if not (is_training(trace) and r.phase == "fwd")]


def is_training(trace: Trace) -> bool:
    """Whether `trace` records a LoRA training step."""
    return (trace.header.get("workload") or {}).get("kind") == "train_lora"


def fit_kernel_table(traces: Sequence[Trace], source: str, probes: Sequence[dict] = (),
                     modules: Sequence[Trace] = ()) -> KernelTable:
    """Kernel rates by op and shape: each recorded spec kernel (records with an op and,
    for matmul ops, a shape; backward records under op + BACKWARD) and the probe grid of
    each trace (header probes "compute": ops "linear", "attention", "attention_masked",
    "memory", and the training attention's forward and backward under op + TRAINING and
    op + TRAINING + BACKWARD) and of each of `probes` (compute probes from probe files, read_probe_file),
    alike; with `modules` (recorded real modules), their ModuleCost (fit_module_cost); the host
    time of each record in the resident step by op and phase (compute.host_key; probes
    "host" "kernel_ns" and, training, "backward_kernel_ns"). With the grid's add and
    the probes' or the records' passes, the pass cost (fit_pass_cost), and each forward matmul
    record's point is its core: its time less its passes, at least CORE_FLOOR of it. A
    training step's forward records give no rates (_rate_records)."""
    grids = [t.header.get("probes", {}).get("compute", {}) for t in traces] + list(probes)
    tiling = attention_tiling(grids)
    host, probed, launches, packs = [], [], [], []
    for grid in grids:
        probed += grid.get("passes", ())
    grid_rows = probe_rows(grids, tiling)
    adds = [(nbytes, ns) for op, _feats, nbytes, ns in grid_rows if op == "memory"]
    largest = max(adds, default=None)
    cost = fit_pass_cost([r for t in traces for r in _rate_records(t)], largest[1] / largest[0] if largest else None,
                         probed)
    rows = list(grid_rows)
    for t in traces:
        probed = t.header.get("probes", {}).get("host", {})
        training = is_training(t)
        tscale = float(t.header.get("host_scale") or 1.0)  # to the pipelined step (timing.host_scale)
        forward = [r for r in t.records if r.phase == "fwd"]
        for phase, kernel_ns in (("fwd", probed.get("kernel_ns", ())), ("bwd", probed.get("backward_kernel_ns", ()))):
            if len(kernel_ns) == len(forward):
                host += [(host_key(r.op, phase, training), round(ns * tscale)) for r, ns in zip(forward, kernel_ns)
                         if r.op]
        for r in t.records:
            if r.op and r.launches:
                launches.append((host_key(r.op, r.phase, training), r.launches))
            if r.op and r.packs:
                packs.append((r.op, r.packs))
        for r in _rate_records(t):
            fwd = r.phase == "fwd"
            feats = features(r.op, r.shape, r.io_bytes, r.passes if fwd else (), tiling) if r.op else None
            if feats is None:
                continue
            ns = float(r.compute_ns)
            if fwd and r.op in MATMUL_OPS and r.passes and cost:
                ns = max(CORE_FLOOR * ns, ns - cost.ns(r.passes))
            rows.append((r.op + ("" if fwd else BACKWARD), feats, work(r.op, r.flops, r.io_bytes, r.shape, tiling), ns))
    table = table_from_measurements(rows, source, host, cost, launches, packs, tiling)
    if modules:
        table.module_cost = fit_module_cost(modules, table)
    return table


def probe_rows(grids: Sequence[dict], tiling: AttentionTiling | None) -> list[tuple[str, tuple[float, ...], int, int]]:
    """(op, features, work, ns) of each timed point of compute probe `grids`; a point of an op
    its grid timed on the GPU alone (listed under GPU_ALONE) replaces those at its op and
    features from grids that timed that op otherwise (small kernels at the host's pace of
    launching them)."""
    rows = [(row, row[0] in grid.get(GPU_ALONE, ())) for grid in grids for row in _grid_rows(grid, tiling)]
    alone = {(row[0], _rounded(row[1])) for row, by_gpu in rows if by_gpu}
    return [row for row, by_gpu in rows if by_gpu or (row[0], _rounded(row[1])) not in alone]


def _rounded(feats: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(round(f, 6) for f in feats)


def _grid_rows(grid: dict, tiling: AttentionTiling | None) -> list[tuple[str, tuple[float, ...], int, int]]:
    rows = [("linear", features("linear", (m, n, k), 0), 2 * m * n * k, ns) for m, n, k, ns in grid.get("linear", ())]
    rows += [(op, features(op, shape, 0, tiling=tiling), work(op, core_flops(op, shape), 0, shape, tiling), ns)
             for op in ATTENTION_OPS for *shape, ns in grid.get(op, ())]
    for op in ATTENTION_OPS:  # a training step's attention: its forward, and its backward's work as traces count it
        for *shape, forward_ns, backward_ns in grid.get(op + TRAINING, ()):
            feats, flops = features(op, shape, 0, tiling=tiling), core_flops(op, shape)
            rows += [(op + TRAINING, feats, work(op, flops, 0, shape, tiling), forward_ns),
                     (op + TRAINING + BACKWARD, feats, work(op, BACKWARD_FLOPS_FACTOR * flops, 0, shape, tiling),
                      backward_ns)]
    return rows + [("memory", features("norm", (), nbytes), nbytes, ns) for nbytes, ns in grid.get("memory", ())]


def attention_tiling(grids: Sequence[dict]) -> AttentionTiling | None:
    """The flash attention tiling (engine/compute.py) of compute probes that timed attention
    off the tile and name their GPU's SM count ("sms"); None where none did (a table probed
    before: plain FLOP rates). Probes of GPUs with different SM counts are refused."""
    sms = {int(g["sms"]) for g in grids if g.get("sms")}
    if len(sms) > 1:
        raise TraceError(f"calibrate: the compute probes come from GPUs of {' and '.join(map(str, sorted(sms)))} "
                         "SMs; calibrate one GPU's recordings and probe files at a time")
    return AttentionTiling(sms.pop()) if sms else None


def fit_module_cost(modules: Sequence[Trace], table: KernelTable) -> ModuleCost:
    """What recorded real modules' blocks cost beside their cores and memory passes, from
    the records' census (engine/modules/census.py), each recording weighted alike (its rows
    by its step), by least squares with each term at least 0:
    - GPU: each record's compute at the held kernels' pace (its time over the header's
      compute_scale), less its cores at `table`'s rates and its passes at `table`'s pass
      cost, as ns_per_op x ops. Decode recordings are left out: the table's one-row matmul
      points come from recorded decode kernels, whose small ops they hold already.
    - host: each record's host time (through the hooks) as host_ns_per_op x dispatches +
      host_ns_per_kernel, decode included.
    - workspace_bytes: the median over the recordings whose header has both (decode aside: its
      traced KV cache counts twice) of the measured `activation_peak_bytes` less the traced
      `traced_peak_bytes` (an inference recording's order forward; benchmarks/restamp_census.py
      writes it into older ones from the meta forward); 0 without any.
    - sustained_slowdown_per_pflops: each recording the GPU paced (`_gpu_paced`) weighted alike,
      its compute_scale less 1 (the pipelined step over its held kernels) as that times the
      PFLOP/s its cores run at over its priced time; 0 without any (the profile's
      compute_sustained_slowdown then prices a synthesized inference's sag).
    - training host: from recorded LoRA steps (`fit_training_host`); 0 without any."""
    if table.pass_cost is None:
        raise TraceError("calibrate --modules: no pass cost to price the modules' memory passes by; pass a compute "
                         "probe of this GPU (python -m engine.measure.compute --out FILE, then --probes FILE)")
    gpu, gpu_w, host, host_w, workspace, paced = [], [], [], [], [], []
    for t in modules:
        records = [r for r in t.records if r.phase == "fwd" and r.dispatches]
        kind = (t.header.get("workload") or {}).get("kind")
        if t.header.get("source") != "recorded" or is_training(t) or not records:
            continue
        host += [(r.host_ns, r.dispatches, 1) for r in records]
        host_w += [1.0 / sum(r.host_ns for r in records)] * len(records)
        if kind == "decode":
            continue
        if not any(r.passes for r in records):
            raise TraceError(f"calibrate --modules: the {t.header.get('model')} recording's census has no memory "
                             "passes (recorded before they were counted); restamp it with "
                             "benchmarks/restamp_census.py, or record it again with mode=record")
        if "activation_peak_bytes" in t.header and "traced_peak_bytes" in t.header:
            workspace.append(t.header["activation_peak_bytes"] - t.header["traced_peak_bytes"])
        scale = float(t.header.get("compute_scale") or 1.0)
        step = sum(r.compute_ns for r in records) / scale
        for r in records:
            cores = sum(table.core_ns(op, shape) or 0.0 for op, shape in r.cores)
            gpu.append((r.compute_ns / scale - cores - table.pass_cost.ns(r.passes), r.ops))
            gpu_w.append(1.0 / step)
        if _gpu_paced(t, records, step):
            paced.append((scale - 1.0, records))
    if not gpu:
        raise TraceError("calibrate --modules: no inference recording of a real module (other than a decode) "
                         "with its op census (records' \"dispatches\"); record one with mode=record, or restamp an "
                         "older one with benchmarks/restamp_census.py")
    per_op = _one_term_nnls(gpu, gpu_w)
    host_op, host_kernel = _two_term_nnls(host, host_w)
    rates = []
    for slowdown, records in paced:
        priced = sum(sum(table.core_ns(op, shape) or 0.0 for op, shape in r.cores) + table.pass_cost.ns(r.passes)
                     + per_op * r.ops for r in records)
        rates.append((slowdown, pflops(sum(core_flops(op, shape) for r in records for op, shape in r.cores), priced)))
    train_op, backward_op = fit_training_host([t for t in modules if t.header.get("source") == "recorded"
                                               and is_training(t)], host_kernel)
    return ModuleCost(round(per_op, 1), round(host_op, 1), round(host_kernel, 1),
                      float(max(0, round(statistics.median(workspace)))) if workspace else 0.0,
                      round(_one_term_nnls(rates, [1.0] * len(rates)), 4), round(train_op, 1), round(backward_op, 1))


def fit_training_host(steps: Sequence[Trace], host_kernel: float) -> tuple[float, float]:
    """A training step's host costs per dispatched op (ModuleCost train_host_ns_per_op,
    backward_host_ns_per_op) from recorded LoRA steps with their op census, each recording
    weighted alike, by least squares at least 0, each block's hooks at `host_kernel`:
    - each forward record's host time as train_host_ns_per_op x its dispatches + host_kernel;
    - each backward record's as backward_host_ns_per_op x its forward's dispatches +
      host_kernel, plus, where the step was checkpointed and the record is a block's,
      checkpointing's recompute of its forward at train_host_ns_per_op.
    (0.0, 0.0) without any such recording."""
    fwd_rows, fwd_w, pairs = [], [], []
    for t in steps:
        forward = {r.name: r for r in t.records if r.phase == "fwd" and r.dispatches}
        if not forward:
            continue
        total = sum(r.host_ns for r in forward.values())
        fwd_rows += [(r.host_ns - host_kernel, r.dispatches) for r in forward.values()]
        fwd_w += [1.0 / total] * len(forward)
        checkpointed = bool((t.header.get("workload") or {}).get("checkpointing"))
        backward = [(r, forward[r.name.removesuffix(BACKWARD_SUFFIX)]) for r in t.records
                    if r.phase == "bwd" and r.name.endswith(BACKWARD_SUFFIX)
                    and r.name.removesuffix(BACKWARD_SUFFIX) in forward]
        pairs.append((backward, checkpointed, sum(r.host_ns for r, _ in backward)))
    if not fwd_rows:
        return 0.0, 0.0
    train_op = _one_term_nnls(fwd_rows, fwd_w)
    bwd_rows, bwd_w = [], []
    for backward, checkpointed, total in pairs:
        for r, f in backward:
            recompute = train_op * f.dispatches if checkpointed and f.layer >= 0 else 0.0
            bwd_rows.append((r.host_ns - host_kernel - recompute, f.dispatches))
            bwd_w.append(1.0 / max(1, total))
    return train_op, _one_term_nnls(bwd_rows, bwd_w)


def _gpu_paced(t: Trace, records: Sequence[KernelRecord], held_ns: float) -> bool:
    """Whether a recorded inference's pipelined step ran at the GPU's pace throughout, so that
    its kernels' scale to it (header "compute_scale") is their slowdown under sustained load:
    the step was timed, and its host work, as the module without hooks launches it, is shorter
    than its kernels held (a host that nearly keeps pace leaves the GPU idle at times)."""
    host = sum(r.host_ns for r in records) * float(t.header.get("plain_host_factor") or 1.0)
    return bool(t.header.get("pipelined_step_ns")) and host < held_ns


def _one_term_nnls(rows: Sequence[Sequence[float]], weights: Sequence[float], i: int = 1) -> float:
    """Weighted least squares of y = a x over rows (y, ..., x at index i, ...) with a >= 0."""
    num = sum(w * w * r[0] * r[i] for r, w in zip(rows, weights))
    den = sum(w * w * r[i] * r[i] for r, w in zip(rows, weights))
    return max(0.0, num / den) if den else 0.0


def _two_term_nnls(rows: Sequence[tuple[float, float, float]], weights: Sequence[float]) -> tuple[float, float]:
    """Weighted least squares of y = a x1 + b x2 over (y, x1, x2) rows with a, b >= 0."""
    s11 = sum(w * w * r[1] * r[1] for r, w in zip(rows, weights))
    s22 = sum(w * w * r[2] * r[2] for r, w in zip(rows, weights))
    s12 = sum(w * w * r[1] * r[2] for r, w in zip(rows, weights))
    s1y = sum(w * w * r[1] * r[0] for r, w in zip(rows, weights))
    s2y = sum(w * w * r[2] * r[0] for r, w in zip(rows, weights))
    det = s11 * s22 - s12 * s12
    if det > 0:
        a, b = (s1y * s22 - s2y * s12) / det, (s2y * s11 - s1y * s12) / det
        if a >= 0 and b >= 0:
            return a, b
    fits = [(_one_term_nnls(rows, weights, 1), 0.0), (0.0, _one_term_nnls(rows, weights, 2))]

    def loss(ab: tuple[float, float]) -> float:
        return sum((w * (r[0] - ab[0] * r[1] - ab[1] * r[2])) ** 2 for r, w in zip(rows, weights))
    return min(fits, key=loss)


def write_kernel_table(profile: dict, traces: Sequence[Trace], target: Path, probes: Sequence[dict] = (),
                       modules: Sequence[Trace] = ()) -> Path | None:
    """Fit the kernel table of `traces`, `probes` (compute probes, read_probe_file) and
    `modules` (recorded real modules), write it beside the profile file `target`
    (NAME.kernels.json) and point the profile at it: by name when it lies in
    conf/hardware/, else by absolute path. Traces without op and shape (recorded before
    the table existed) and without a probe grid give no table: None. Each module recording's
    host times are taken as the simulator replays them on `profile` (sim.simulator.host_fitted)."""
    from engine.config import hardware_of
    from sim.simulator import host_fitted

    hardware = hardware_of(profile)
    table = fit_kernel_table(traces, profile["source"], probes, [host_fitted(t, hardware) for t in modules])
    if not table.points:
        profile["kernel_table"] = None
        return None
    path = target.with_name(target.stem + ".kernels.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table.to_json()) + "\n")
    profile["kernel_table"] = path.name if path.parent.resolve() == tables_dir().resolve() else str(path.resolve())
    return path


def read_probe_file(path: Path) -> dict:
    """The compute probe (probes "compute") of a file `python -m engine.measure.compute --out`
    wrote."""
    hint = "write one on the GPU with python -m engine.measure.compute --out FILE.json"
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise TraceError(f"{path}: no such probe file; {hint}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceError(f"{path}: not a readable JSON probe file ({e}); {hint}") from None
    compute = data.get("probes", {}).get("compute") if isinstance(data, dict) and isinstance(
        data.get("probes"), dict) else None
    if not isinstance(compute, dict):
        raise TraceError(f"{path}: not a compute probe file (no \"probes\": {{\"compute\": ...}}); {hint}")
    for op, width in PROBE_ROWS.items():
        rows = compute.get(op, [])
        bad = next((r for r in rows if not isinstance(r, list) or len(r) < width
                    or not all(isinstance(v, (int, float)) for v in r[width - 4 if op == "passes" else 0:width])),
                   None) if isinstance(rows, list) else rows
        if bad is not None:
            raise TraceError(f"{path}: compute probe {op!r} has a malformed row {str(bad)[:80]}; {hint}")
    sms = compute.get("sms")
    if sms is not None and not (isinstance(sms, int) and not isinstance(sms, bool) and sms > 0):
        raise TraceError(f"{path}: compute probe \"sms\" is {str(sms)[:40]!r}, not the GPU's SM count (an integer "
                         f"above 0); {hint}")
    return compute


def probe_file_device(path: Path) -> str | None:
    """The GPU a probe file (read_probe_file has read it) was written on."""
    return json.loads(Path(path).read_text()).get("device")
