"""mode=validate: the simulator's prediction against the GPU's measurement, config by config.

The configurations come from the trace (`grid`): inference traces get
budgets (BUDGET_FRACTIONS of the model's bytes, up to where compute bounds the
step) x evictions x lookaheads, weights streamed through the executor, and every
weight resident; training traces get the LoRA step with
its weights resident under each activation policy (off, watermark at two
levels, sync dict with two layer counts), spilled by the ActivationOffloader.
Half of them, in a checkerboard over the grid, are held out of the fit
(`held_out`): calibration may tune on the others only.

The measured side needs the GPU (`measure` for a spec model; a real module's is
engine/modes/module_validate.py) and is written as JSON (format MEASUREMENTS, one
file per trace, beside it: `measurements_path`); the report (`report`) needs only
that JSON, a trace of the model (recorded or synthesized) and a hardware profile,
so it is rebuilt on any CPU from the shipped measurements.

Measured, per configuration (steps after one warm-up: at least TIMED_STEPS, then
until their median is known within 1% or SETTLE_MS or MAX_TIMED_STEPS is reached;
a step the host bounds moves by tens of percent from one to the next):
    step_ms            CUDA events around the step on the compute stream: the median of
                       the timed steps, or where the simulator's steps vary by design
                       (belady's copies cycle) their mean, as the prediction's
                       (engine.measure.spread.typical_step_ms; `report` takes it from
                       steps_ms: the cold first step, then the timed ones). The steps run
                       in batches; the host waits to read a batch's times, so the next
                       batch's first step starts on an idle GPU and is left out, a
                       warm-up again.
    stall_ms           inference: the compute stream waiting on weight copies,
                       timed by events around each fetch's waits (KernelStamps) in
                       STALL_STEPS steps after the timed ones (median);
                       training: the offloader's timed waits on restores/offloads
    peak_device_bytes  inference: the weight pool's used high-water; training: the
                       model's bytes plus the allocator's high-water above what was
                       allocated before the step (saved activations and temporaries);
                       a real module's on a GPU: the pool's and torch's allocator's
                       high-water together (the file's "peak": PEAKS)
    reserve_releases,  inference: the CUDA pool's refusals of a block under the budget in the
    relocations        timed steps (POOL_EVENTS), answered by releasing its reserve or by
                       relocating; the driver places the pool's blocks, so the simulator does
                       not predict them and the report marks the rows
The file also says the backend the rows ran on ("backend"), which the prediction takes.
"""
from __future__ import annotations

import itertools
import json
import math
import statistics
from contextlib import ExitStack, nullcontext
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

from engine.config import ActivationsConfig, HardwareConfig, PoolConfig, WeightsConfig
from engine.errors import ConfigError, TraceError
from engine.measure.spread import enough, typical_step_ms, typical_step_rel_se
from engine.policy.pool_sizing import exact_pool
from engine.policy.eviction import EVICTIONS
from engine.policy.floor import floor
from engine.policy.schedule import step_questions
from engine.trace import Trace
from engine.units import MB

MEASUREMENTS = "offload-engine-measurements"
# What a measurements file's peak device bytes count (its "peak"; "pool" where it says none),
# and the prediction's figure for it: the weight pool and the saved activations (a spec
# model's run), or the weight pool and torch's allocator (a real module's, on a GPU).
PEAKS = {"pool": "peak_device_bytes", "pool_torch": "peak_pool_torch_bytes"}
# What the CUDA pool did in a row's timed steps that the simulator does not predict (the driver
# places its blocks): refusals under the budget answered by releasing its unused reserve (the host
# waits for the copy stream, then the driver maps memory again: the link idles), and relocations.
POOL_EVENTS = ("reserve_releases", "relocations")
BUDGET_FRACTIONS = (0.35, 0.6, 0.85)
LOOKAHEADS = (1, 4)
ALL_RESIDENT = "all resident"
# Standard errors of two measured steps their gap must exceed for the measurement to order them
# (the ranking's ties).
TIE_Z = 2.0
TIMED_STEPS = 5
# Steps after the timed ones, their kernels stamped for the stall: the stamps (two CUDA events
# a kernel) cost host time, which a host-bound step's time would show.
STALL_STEPS = 3
MAX_TIMED_STEPS = 64
SETTLE_MS = 10_000.0
# The first warms the pool; the warm ones after it show a policy whose copies cycle (belady's).
SIM_STEPS = 1 + TIMED_STEPS
NO_CUDA = ("mode=validate needs a CUDA GPU to measure and none is visible; put the measurements beside "
           "the trace (X.measurements.json) to validate without one")
# Training: (name, activations settings); watermarks are fractions of the step's saved bytes.
TRAIN_POLICIES = (
    ("off", {"mode": "off"}),
    ("watermark-0.8", {"mode": "watermark", "high": 0.8, "low": 0.7}),
    ("watermark-0.6", {"mode": "watermark", "high": 0.6, "low": 0.5}),
    ("sync-2", {"mode": "sync", "layers": 2}),
    ("sync-3", {"mode": "sync", "layers": 3}),
)


def measurements_path(trace_path: str | Path) -> Path:
    """Where a trace's measurements live: beside it, X.jsonl[.gz] -> X.measurements.json."""
    p = Path(trace_path)
    stem = p.name.removesuffix(".gz").removesuffix(".jsonl")
    return p.with_name(stem + ".measurements.json")


def training(trace: Trace) -> bool:
    return any(r.phase == "bwd" for r in trace.records)


def saved_bytes(trace: Trace) -> int:
    return sum(s.nbytes for r in trace.records for s in r.saved)


def grid(trace: Trace, min_tensor_bytes: int | None = None) -> list[dict]:
    """The configurations validated for this trace, each marked held out or not; a training
    trace's spill the saved tensors of `min_tensor_bytes` or more (None: the default's)."""
    rows = []
    if training(trace):
        smallest = {} if min_tensor_bytes is None else {"min_tensor_bytes": min_tensor_bytes}
        for i, (name, act) in enumerate(TRAIN_POLICIES):
            rows.append({"id": f"train {name}", "kind": "train_lora", "budget_mb": None, "eviction": "belady",
                         "lookahead": 1, "activations": {**act, **({} if act["mode"] == "off" else smallest)},
                         "held_out": i % 2 == 1})
        return rows
    model_mb = sum(trace.weight_sizes.values()) / MB
    order = trace.access_order()
    floor_mb = max(floor(order, la).bytes for la in LOOKAHEADS) / MB
    unit = _unit(model_mb)
    for (ib, frac), (ie, ev), (il, la) in itertools.product(
            enumerate(BUDGET_FRACTIONS), enumerate(EVICTIONS), enumerate(LOOKAHEADS)):
        # A fraction of the model, but never under the floor (a decode step's lm_head + embedding).
        above_floor = floor_mb - floor_mb % unit + unit + ib * _in(unit, 0.25 * model_mb)
        budget = _in(unit, max(frac * model_mb, above_floor))
        rows.append({"id": f"{ev} budget={budget} lookahead={la}", "kind": "infer", "budget_mb": budget,
                     "eviction": ev, "lookahead": la, "activations": {"mode": "off"},
                     "held_out": (ib + ie + il) % 2 == 1})
    rows.append({"id": ALL_RESIDENT, "kind": "infer", "budget_mb": None, "eviction": "priority", "lookahead": 1,
                 "activations": {"mode": "off"}, "held_out": True})
    return rows


def _unit(total_mb: float) -> float:
    """The grid's MB are whole MB, a small model's kB (a test's model is under a MB)."""
    return 1.0 if total_mb >= 100 else 0.001


def _in(unit: float, mb: float) -> float:
    return round(mb) if unit == 1.0 else round(round(mb / unit) * unit, 3)


def activations_config(act: dict, trace: Trace) -> ActivationsConfig | None:
    """The activation policy's config for a grid row (None: no offload)."""
    if act["mode"] == "off":
        return None
    smallest = {"min_tensor_bytes": act["min_tensor_bytes"]} if "min_tensor_bytes" in act else {}
    if act["mode"] == "watermark":
        total = saved_bytes(trace) / MB
        unit = _unit(total)
        cfg = ActivationsConfig(mode="watermark", high_watermark_mb=_in(unit, act["high"] * total),
                                low_watermark_mb=_in(unit, act["low"] * total), **smallest)
    elif act["mode"] == "sync":
        cfg = ActivationsConfig(mode="sync", num_offload_layers=act["layers"], **smallest)
    else:
        raise ConfigError(f"validation row with activations mode {act['mode']!r}; use off, watermark or sync")
    # The pool the CLI's default (activations/pool=exact) gives: every spill pinned.
    questions = step_questions(trace.records, cfg.min_tensor_bytes)
    return replace(cfg, pool=PoolConfig(**exact_pool(cfg, questions, trace.num_layers)))


# ------------------------------------------------------------------ predicted


def predict(trace: Trace, row: dict, hardware: Any, source: str, backend: str = "cuda") -> dict:
    """The simulator's figures for a grid row; step_ms is its warm steps' mean, as `execute`
    holds a measurement to (`steps_vary`: whether they differ by design, which decides the
    measured step it is held against)."""
    from sim import simulate
    from sim.prediction import steps_vary

    budget = None if row["budget_mb"] is None else int(row["budget_mb"] * MB)
    weights = WeightsConfig(eviction=row["eviction"], lookahead=row["lookahead"], source=source, backend=backend)
    act = activations_config(row["activations"], trace)
    # The loop `measure` runs: a training row synchronizes before each step (its peak is the
    # step's own), an inference row's steps run free.
    loop = "synced" if row["kind"] == "train_lora" else "free"
    pred = simulate(trace, weights, act, hardware, budget, SIM_STEPS, allow_below_floor=False, loop=loop).prediction
    return {**{k: pred[k] for k in ("stall_ms", "compute_ms", "h2d_bytes", *PEAKS.values())},
            "step_ms": pred["mean_step_ms"], "steps_vary": steps_vary(pred)}


def hardware_of(profile: Any) -> HardwareConfig:
    """A hardware profile (DictConfig, dict or dataclass) as the schema's dataclass."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(profile):
        profile = OmegaConf.to_container(profile, resolve=True)
    if not isinstance(profile, dict):
        profile = asdict(profile)
    return HardwareConfig(**profile)


def _rel(pred: float, meas: float) -> float | None:
    return None if not meas else (pred - meas) / meas


def _ranking(rows: list[dict]) -> list[dict]:
    """Per group of rows that differ only in the eviction policy: is the order by step time kept?
    A pair the prediction orders one way and the measurement the other is a tie, not a miss,
    where the measured gap is within TIE_Z standard errors of the two measured steps (the
    measurement does not order them); `ties` names those pairs. A pair predicted alike (the
    same step: every weight fits either way) is not ordered by the prediction."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["kind"] == "infer" and r["budget_mb"] is not None:
            groups.setdefault((r["budget_mb"], r["lookahead"]), []).append(r)
    out = []
    for (budget, la), rs in sorted(groups.items()):
        by_prediction = sorted(rs, key=lambda r: r["predicted"]["step_ms"])
        measured = [r["eviction"] for r in sorted(rs, key=lambda r: r["measured"]["step_ms"])]
        times = sorted(r["measured"]["step_ms"] for r in rs)
        closest = min((b - a) / a for a, b in zip(times, times[1:])) if len(times) > 1 else None
        ties, missed = [], False
        for i, faster in enumerate(by_prediction):
            for slower in by_prediction[i + 1:]:
                a, b = faster["measured"], slower["measured"]
                gap = (a["step_ms"] - b["step_ms"]) / b["step_ms"]
                if gap <= 0 or faster["predicted"]["step_ms"] == slower["predicted"]["step_ms"]:
                    continue
                resolvable = TIE_Z * math.hypot(a["step_rel_se"], b["step_rel_se"])
                if gap <= resolvable:
                    ties.append({"pair": [faster["eviction"], slower["eviction"]], "gap": gap,
                                 "resolvable": resolvable})
                else:
                    missed = True
        out.append({"budget_mb": budget, "lookahead": la, "measured": measured,
                    "predicted": [r["eviction"] for r in by_prediction],
                    "predicted_ms": [r["predicted"]["step_ms"] for r in by_prediction], "preserved": not missed,
                    "ties": ties, "closest_measured_gap": closest})
    return out


def _summary(rows: list[dict]) -> dict:
    def stats(key: str, over: list[dict] = rows) -> dict:
        errs = [abs(r["error"][key]) for r in over if r["error"][key] is not None]
        return {"mean": statistics.fmean(errs) if errs else None, "max": max(errs) if errs else None, "n": len(errs)}
    return {"configs": len(rows), "step_ms": stats("step_ms"), "peak_device_bytes": stats("peak_device_bytes"),
            "step_ms_without_pool_events": stats("step_ms", [r for r in rows if not r["pool_events"]]),
            "stall_abs_ms": {"mean": statistics.fmean(abs(r["predicted"]["stall_ms"] - r["measured"]["stall_ms"])
                                                      for r in rows) if rows else None}}


def report(trace: Trace, measurements: dict, hardware: Any) -> dict:
    """Predicted beside measured for every measured configuration, errors, ranking."""
    if measurements.get("format") != MEASUREMENTS:
        raise TraceError(f'measurements: not an offload-engine measurements file (format must be "{MEASUREMENTS}")')
    hw = hardware_of(hardware)
    source = measurements.get("source", "mmap_registered")
    backend = measurements.get("backend", "cuda")
    peak = PEAKS[measurements.get("peak", "pool")]
    rows = []
    for m in measurements["rows"]:
        pred = predict(trace, m, hw, source, backend)
        pred["peak_device_bytes"] = pred[peak]
        meas = dict(m["measured"])
        meas["step_rel_se"] = 0.0  # a file without its steps: every gap counts
        if "steps_ms" in meas:  # the step the prediction's stands for, and its standard error
            args = (meas["steps_ms"], len(meas["steps_ms"]), pred["steps_vary"])
            meas["step_ms"], meas["step_rel_se"] = typical_step_ms(*args), typical_step_rel_se(*args)
        rows.append({**{k: m[k] for k in ("id", "kind", "budget_mb", "eviction", "lookahead", "activations",
                                           "held_out")},
                     "predicted": pred, "measured": meas,
                     "pool_events": {k: meas[k] for k in POOL_EVENTS if meas.get(k)},
                     "error": {"step_ms": _rel(pred["step_ms"], meas["step_ms"]),
                               "stall_ms": _rel(pred["stall_ms"], meas["stall_ms"]) if meas["stall_ms"] >= 1 else None,
                               "peak_device_bytes": _rel(pred["peak_device_bytes"], meas["peak_device_bytes"])}})
    fit = [r for r in rows if not r["held_out"]]
    held = [r for r in rows if r["held_out"]]
    ranking = _ranking(rows)
    return {"hardware": hw.name, "trace_model": trace.header.get("model"), "trace_source": trace.header.get("source"),
            "peak": measurements.get("peak", "pool"), "backend": backend, "skipped": measurements.get("skipped", []),
            "link": measurements.get("link"), "profile_link": {"h2d_gbps": hw.h2d_gbps, "d2h_gbps": hw.d2h_gbps},
            "measured_on": measurements.get("device"), "measured_date": measurements.get("date"),
            "rows": rows, "fit": _summary(fit), "held_out": _summary(held), "ranking": ranking,
            "ranking_preserved": all(g["preserved"] for g in ranking) if ranking else None}


def report_md(rep: dict) -> str:
    from engine.report import table

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:+.1%}"

    body = [[r["id"] + (" (held out)" if r["held_out"] else "") + (" *" if r["predicted"].get("steps_vary") else "")
             + (" †" if r["pool_events"] else ""),
             f"{r['predicted']['step_ms']:.2f}", f"{r['measured']['step_ms']:.2f}", pct(r["error"]["step_ms"]),
             f"{r['predicted']['stall_ms']:.2f}", f"{r['measured']['stall_ms']:.2f}",
             f"{r['predicted']['peak_device_bytes'] / 1e9:.3f}", f"{r['measured']['peak_device_bytes'] / 1e9:.3f}",
             pct(r["error"]["peak_device_bytes"])] for r in rep["rows"]]
    md = [f"## Calibration report: {rep['trace_model']} on {rep['hardware']} "
          f"(measured on {rep['measured_on']}, {rep['measured_date']})", "",
          table(["config", "pred ms", "meas ms", "step err", "pred stall", "meas stall", "pred peak GB",
                 "meas peak GB", "peak err"], body), ""]
    if rep["trace_source"] != "recorded":
        md += ["- predicted from the config alone (a synthesized trace), as the main command predicts: no recording "
               "of this model", ""]
    if rep["backend"] != "cuda":
        md += [f"- measured and predicted on the {rep['backend']} backend (weights.backend={rep['backend']})", ""]
    if rep["peak"] == "pool_torch":
        md += ["- peak: the weight pool's and torch's allocator's high-water beside each other (the process less "
               "the CUDA context)", ""]
    if rep.get("link"):
        here, profile = rep["link"]["h2d_gbps"], rep["profile_link"]["h2d_gbps"]
        md += [f"- the link: H2D {here:.2f} GB/s where measured, {profile:.2f} in the profile "
               f"({_rel(profile, here):+.1%}); a row the link bounds is off by about as much", ""]
    if rep["skipped"]:
        md += [f"- not measured (they would not fit the device beside a run): {', '.join(rep['skipped'])}", ""]
    if any(r["predicted"].get("steps_vary") for r in rep["rows"]):
        md += ["\\* the policy's steps vary by design (its copies cycle): measured is the warm steps' mean, as "
               "predicted; elsewhere the median of the timed steps", ""]
    marked = [r for r in rep["rows"] if r["pool_events"]]
    if marked:
        counts = ", ".join(f"{r['id']}: " + ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in r["pool_events"].items())
                           for r in marked)
        md += ["† the CUDA pool refused a block under the budget in the timed steps (its free space split: the "
               "driver places the blocks, which the simulator does not predict) and released its reserve, the host "
               "waiting for the copy stream to drain and the driver mapping memory again while the link idled, or "
               f"relocated ({counts}); weights.backend=vmm never does either", ""]
    for name in ("fit", "held_out"):
        s = rep[name]
        if not s["configs"]:
            continue
        st, pk = s["step_ms"], s["peak_device_bytes"]
        clean = s["step_ms_without_pool_events"]
        md.append(f"- {name.replace('_', '-')} ({s['configs']} configs): step time error mean {st['mean']:.1%}, "
                  f"max {st['max']:.1%}"
                  + (f" (without the † rows: mean {clean['mean']:.1%}, max {clean['max']:.1%})"
                     if clean["n"] < st["n"] and clean["n"] else "")
                  + f"; peak device bytes error max {pk['max']:.1%}; "
                  f"stall |pred - meas| mean {s['stall_abs_ms']['mean']:.2f} ms")
    for g in rep["ranking"]:
        ties = "; ".join(f"{' and '.join(t['pair'])} tie within the measurements' spread ({t['gap']:.1%} apart, "
                         f"{t['resolvable']:.1%} would order them)" for t in g.get("ties", ()))
        predicted = g["predicted"][0] + "".join(
            f" {'=' if ms == before else '<'} {name}"
            for name, ms, before in zip(g["predicted"][1:], g["predicted_ms"][1:], g["predicted_ms"]))
        md.append(f"- ranking at budget {g['budget_mb']} MB, lookahead {g['lookahead']}: measured "
                  f"{' < '.join(g['measured'])}, predicted {predicted}: "
                  f"{'preserved' if g['preserved'] else 'NOT preserved'}"
                  + (f": {ties}" if ties else "")
                  + (f" (closest measured gap {g['closest_measured_gap']:.1%})"
                     if g["closest_measured_gap"] is not None else ""))
    return "\n".join(md)


def read_measurements(path: str | Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise TraceError(f"{path}: no measurements; run mode=validate on a GPU to measure them") from None
    except json.JSONDecodeError as e:
        raise TraceError(f"{path}: not JSON ({e.msg}); re-measure with mode=validate on a GPU") from None
    if not isinstance(data, dict) or data.get("format") != MEASUREMENTS or not isinstance(data.get("rows"), list):
        raise TraceError(f'{path}: not an offload-engine measurements file (format "{MEASUREMENTS}" with rows)')
    if data.get("peak", "pool") not in PEAKS:
        raise TraceError(f"{path}: peak {str(data.get('peak'))[:40]!r} is not one of {', '.join(PEAKS)}; "
                         "re-measure with mode=validate on a GPU")
    return data


# ------------------------------------------------------------------ measured


def measure(cfg: Any, spec: Any, trace: Trace, rows: Sequence[dict]) -> dict:
    """Run every configuration that fits the device (`row_bytes`) on the GPU; the
    measurements JSON (module docstring), the others listed under "skipped"."""
    from engine.executor.setup import compute_device, open_weight_file, shared_host_weights
    from engine.models import make_inputs
    from engine.measure.clocks import clock_for

    device = compute_device(cfg.weights.backend, no_cuda=NO_CUDA, replica=True)
    clock = clock_for(device)
    rows, skipped = fitting(rows, trace, device)
    out = []
    with ExitStack() as stack:
        wf = open_weight_file(cfg, spec, stack)
        inputs = make_inputs(spec, cfg.workload, device, seed=cfg.seed)
        host = None  # registered for DMA once, not once a row (seconds for a whole model)
        if any(row["kind"] == "infer" for row in rows):
            host = shared_host_weights(stack, wf, cfg.weights.source, cfg.weights.backend)
        for row in rows:
            if row["kind"] == "infer":
                meas = _measure_streamed(spec, trace, wf, host, inputs, row, cfg.weights, clock)
            else:
                meas = _measure_training(spec, trace, wf, inputs, row, cfg, device, clock)
            out.append(measured_row(row, meas))
    return {**measurements_header(spec.name, spec.num_layers, trace, device, cfg.weights, "pool"),
            "rows": out, "skipped": skipped}


def fitting(rows: Sequence[dict], trace: Trace, device: Any) -> tuple[list[dict], list[str]]:
    """The grid's rows that fit the device beside a run (`row_bytes`), and the ids of those
    that do not (each said on stdout); none fitting is a ConfigError."""
    from engine.executor.setup import fits_resident

    model_bytes = sum(trace.weight_sizes.values())
    saved = saved_bytes(trace)
    held = {row["id"]: row_bytes(row, model_bytes, saved) for row in rows}
    skipped = [row["id"] for row in rows if not fits_resident(held[row["id"]], device)]
    if len(skipped) == len(rows):
        raise ConfigError(f"mode=validate: no configuration of the grid fits this device (the smallest holds "
                          f"{min(held.values()) / 1e9:.2f} GB); validate on a device with more memory")
    for row_id in skipped:
        print(f"  skipped {row_id}: {held[row_id] / 1e9:.2f} GB on the device would leave no room for a run",
              flush=True)
    return [row for row in rows if row["id"] not in skipped], skipped


def measured_row(row: dict, meas: dict) -> dict:
    """A grid row with its measurement, said on stdout as it lands."""
    print(f"  measured {row['id']}: step {meas['step_ms']:.2f} ms, stall {meas['stall_ms']:.2f} ms, "
          f"peak {meas['peak_device_bytes'] / 1e9:.3f} GB", flush=True)
    return {**row, "measured": meas}


def measurements_header(model: str, num_layers: int | None, trace: Trace, device: Any, weights: Any,
                        peak: str) -> dict:
    """A measurements file's keys but its rows: what was measured, where and how, and the
    link's rates there (`link_rates`)."""
    import torch

    from engine.executor.setup import device_name

    return {"format": MEASUREMENTS, "version": 1, "model": model, "num_layers": num_layers,
            "workload": trace.header.get("workload"), "device": device_name(device), "torch": torch.__version__,
            "cuda": torch.version.cuda if device.type == "cuda" else None, "source": weights.source,
            "backend": weights.backend, "peak": peak,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "min_timed_steps": TIMED_STEPS,
            "link": link_rates(device)}


def link_rates(device: Any) -> dict | None:
    """The link's pinned copy rates on `device` now, GB/s each way (the largest probe copy's,
    as calibrate fits h2d_gbps): a profile's rates come from another lease, and link-bound
    rows move with the difference. None off a GPU."""
    if device.type != "cuda":
        return None
    from engine.calibrate import copy_rates
    from engine.measure.probes import probe_copies

    copies, _ = probe_copies(device)
    rates = {d: copy_rates([copies], d) for d in ("h2d", "d2h")}
    return {f"{d}_gbps": round(r[max(r)], 3) for d, r in rates.items()}


def row_bytes(row: dict, model_bytes: int, saved: int) -> int:
    """The device bytes a grid row holds before its step's own: its budget (streamed), the
    model (every weight resident), the model and its saved activations (training)."""
    if row["kind"] == "train_lora":
        return model_bytes + saved
    return model_bytes if row["budget_mb"] is None else int(row["budget_mb"] * MB)


def timed_enough(times_ms: Sequence[float]) -> bool:
    """Whether the timed steps (after the warm-up) are enough: the module docstring's rule."""
    return enough(times_ms, min_steps=TIMED_STEPS, max_steps=MAX_TIMED_STEPS, max_total=SETTLE_MS)


def _measure_streamed(spec: Any, trace: Trace, wf: Any, host: Any, inputs: dict, row: dict, weights_cfg: Any,
                      clock: Any) -> dict:
    from engine.executor.setup import streamed_executor
    from engine.models import forward

    budget = None if row["budget_mb"] is None else int(row["budget_mb"] * MB)
    with ExitStack() as stack:
        executor = streamed_executor(stack, wf, trace.access_order(), backend=weights_cfg.backend,
                                     source=weights_cfg.source, budget_bytes=budget, eviction=row["eviction"],
                                     lookahead=row["lookahead"], keep_steps=None, shared=host)

        def step(source: Any) -> None:
            with executor.step():
                forward(spec, source, inputs)
        steps, stalls = time_inference_row(step, executor, clock)
    return inference_measurement(steps, stalls, max(t["peak_device_bytes"] for t in steps))


def time_inference_row(step: Callable[[Any], None], executor: Any, clock: Any) -> tuple[list[dict], list[float]]:
    """An inference row's steps by the module docstring's rule, `step(source)` running one
    forward whose kernels fetch from `source` (`executor`, or KernelStamps around it in the
    STALL_STEPS stamped steps after the timed ones): the telemetry of the cold first step and
    of the timed ones, and the stamped steps' stalls (ms)."""
    import torch

    from engine.executor.setup import end_of_step
    from engine.measure.timing import KernelStamps

    stalls: list[float] = []
    done = itertools.count()

    def run(steps: int, stamped: bool = False) -> list[dict]:
        """`steps` more steps, free-running; their telemetry (which waits for them)."""
        stamps = []
        with torch.no_grad():
            for _ in range(steps):
                source = KernelStamps(executor, clock) if stamped else executor
                step(source)
                if stamped:
                    source.close()
                    stamps.append(source)
                end_of_step("free", clock.device, next(done))
        rows = executor.telemetry()[-steps:]
        stalls.extend(sum(s.stall_ns()) / 1e6 for s in stamps)  # read once the steps ended
        return rows

    cold, *timed = run(1 + TIMED_STEPS)
    while not timed_enough([t["step_ms"] for t in timed]):
        # The host waited to read the times: the next step starts on an idle GPU, a warm-up again.
        timed += run(1 + TIMED_STEPS)[1:]
    run(STALL_STEPS, stamped=True)
    return [cold, *timed], stalls


def inference_measurement(steps: Sequence[dict], stalls: Sequence[float], peak_bytes: int) -> dict:
    """A measured inference row from `time_inference_row`'s steps and stalls, and its peak."""
    cold, *timed = steps
    return {"step_ms": statistics.median(t["step_ms"] for t in timed), "first_step_ms": cold["step_ms"],
            "stall_ms": statistics.median(stalls), "peak_device_bytes": peak_bytes,
            "h2d_bytes": timed[-1]["h2d_bytes"], "steps_ms": [t["step_ms"] for t in steps],
            **{k: sum(t[k] for t in timed) for k in POOL_EVENTS}}


def _measure_training(spec: Any, trace: Trace, wf: Any, inputs: dict, row: dict, cfg: Any, device: Any,
                      clock: Any) -> dict:
    import torch

    from engine.executor.model_hooks import ResidentWeights
    from engine.executor.offloader import ActivationOffloader
    from engine.executor.training import HOOK_FIELDS, lora_step
    from engine.models.lora import init_lora
    from engine.models.run import DictSource
    from engine.policy.activations import build_activation_policy

    weights = {n: t.to(device, copy=True) for n, t in wf.tensors().items()}
    lora = init_lora(spec, cfg.workload.lora_rank, device=device, seed=cfg.seed + 1)
    act = activations_config(row["activations"], trace)
    offloader = None
    if act is not None:
        offloader = ActivationOffloader(build_activation_policy(act, spec.num_layers), act, device,
                                        weights=ResidentWeights(weights), keep_steps=None)
    times, peaks = [], []
    try:
        while len(times) < 1 + TIMED_STEPS or not timed_enough(times[1:]):
            for t in lora.values():
                t.grad = None
            clock.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            start = clock.stamp()
            with offloader.step() if offloader is not None else nullcontext():
                lora_step(spec, DictSource(spec, weights), inputs, lora, offloader)
            end = clock.stamp()
            clock.synchronize()
            times.append(clock.ns(start, end) / 1e6)
            peaks.append(spec.model_bytes + torch.cuda.max_memory_allocated(device) - before)
        rows = offloader.telemetry()[1:] if offloader is not None else []
        stall = [t["stall_time_ms"] for t in rows] or [0.0]
        # The offloader's hooks, host us a call: what the profile's offload_kernel_us,
        # pack_hook_us and unpack_hook_us are taken from.
        hooks = {k: statistics.median(t[k] for t in rows) for k in HOOK_FIELDS} if rows else {}
    finally:
        if offloader is not None:
            offloader.close()
        del weights
        torch.cuda.empty_cache()
    return {"step_ms": statistics.median(times[1:]), "first_step_ms": times[0],
            "stall_ms": statistics.median(stall), "peak_device_bytes": max(peaks[1:]), "steps_ms": times, **hooks}


def write_measurements(path: str | Path, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
