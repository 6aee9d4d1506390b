"""mode=validate's measurements file (format MEASUREMENTS) and its report: each measured
configuration predicted by the simulator beside what was measured, the errors of the fit and
held-out halves, the policies' ranking per budget and lookahead. Needs no GPU: a report is
rebuilt on any CPU from the shipped measurements and any trace of the model."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from engine.config import WeightsConfig, hardware_of
from engine.errors import TraceError
from engine.measure.spread import typical_step_ms, typical_step_rel_se
from engine.trace import Trace
from engine.units import MB
from engine.validation.grid import SIM_STEPS, activations_config

MEASUREMENTS = "offload-engine-measurements"
# What a measurements file's peak device bytes count (its "peak"; "pool" where it says none),
# and the prediction's figure for it: the weight pool and the saved activations (a spec
# model's run), or the weight pool and torch's allocator (a real module's, on a GPU).
PEAKS = {"pool": "peak_device_bytes", "pool_torch": "peak_pool_torch_bytes"}
# What the CUDA pool did in a row's timed steps that the simulator does not predict (the driver
# places its blocks): refusals under the budget answered by releasing its unused reserve (the host
# waits for the copy stream, then the driver maps memory again: the link idles), and relocations.
POOL_EVENTS = ("reserve_releases", "relocations")
# Standard errors of two measured steps their gap must exceed for the measurement to order them
# (the ranking's ties).
TIE_Z = 2.0
# Predicted steps this share apart or closer are predicted alike: the prediction does not order
# them (its best rows' error is several times this).
PREDICTED_TIE = 0.001


def measurements_path(trace_path: str | Path) -> Path:
    """Where a trace's measurements live: beside it, X.jsonl[.gz] -> X.measurements.json."""
    p = Path(trace_path)
    stem = p.name.removesuffix(".gz").removesuffix(".jsonl")
    return p.with_name(stem + ".measurements.json")


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


def _rel(pred: float, meas: float) -> float | None:
    return None if not meas else (pred - meas) / meas


def _ranking(rows: list[dict]) -> list[dict]:
    """Per group of rows that differ only in the eviction policy: is the order by step time kept?
    A pair the prediction orders one way and the measurement the other is a tie, not a miss,
    where the measured gap is within TIE_Z standard errors of the two measured steps (the
    measurement does not order them); `ties` names those pairs. A pair predicted alike
    (`predicted_alike`: every weight fits either way, or steps within PREDICTED_TIE) is not
    ordered by the prediction."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["budget_mb"] is not None:
            groups.setdefault((r["kind"], r["budget_mb"], r["lookahead"]), []).append(r)
    out = []
    for (kind, budget, la), rs in sorted(groups.items()):
        by_prediction = sorted(rs, key=lambda r: r["predicted"]["step_ms"])
        measured = [r["eviction"] for r in sorted(rs, key=lambda r: r["measured"]["step_ms"])]
        times = sorted(r["measured"]["step_ms"] for r in rs)
        closest = min((b - a) / a for a, b in zip(times, times[1:])) if len(times) > 1 else None
        ties, missed = [], False
        for i, faster in enumerate(by_prediction):
            for slower in by_prediction[i + 1:]:
                a, b = faster["measured"], slower["measured"]
                gap = (a["step_ms"] - b["step_ms"]) / b["step_ms"]
                if gap <= 0 or predicted_alike(faster["predicted"]["step_ms"], slower["predicted"]["step_ms"]):
                    continue
                resolvable = TIE_Z * math.hypot(a["step_rel_se"], b["step_rel_se"])
                if gap <= resolvable:
                    ties.append({"pair": [faster["eviction"], slower["eviction"]], "gap": gap,
                                 "resolvable": resolvable})
                else:
                    missed = True
        out.append({"kind": kind, "budget_mb": budget, "lookahead": la, "measured": measured,
                    "predicted": [r["eviction"] for r in by_prediction],
                    "predicted_ms": [r["predicted"]["step_ms"] for r in by_prediction], "preserved": not missed,
                    "ties": ties, "closest_measured_gap": closest})
    return out


def predicted_alike(a_ms: float, b_ms: float) -> bool:
    """Whether two predicted steps are within PREDICTED_TIE of each other (the ranking's tie)."""
    return abs(a_ms - b_ms) <= PREDICTED_TIE * min(a_ms, b_ms)


def _summary(rows: list[dict]) -> dict:
    stalls = [abs(r["predicted"]["stall_ms"] - r["measured"]["stall_ms"]) for r in rows
              if r["measured"]["stall_ms"] is not None]

    def stats(key: str, over: list[dict] = rows) -> dict:
        errs = [abs(r["error"][key]) for r in over if r["error"][key] is not None]
        return {"mean": statistics.fmean(errs) if errs else None, "max": max(errs) if errs else None, "n": len(errs)}
    return {"configs": len(rows), "step_ms": stats("step_ms"), "peak_device_bytes": stats("peak_device_bytes"),
            "step_ms_without_pool_events": stats("step_ms", [r for r in rows if not r["pool_events"]]),
            "stall_abs_ms": {"mean": statistics.fmean(stalls) if stalls else None}}


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
        stalled = meas["stall_ms"] is not None and meas["stall_ms"] >= 1
        meas["step_rel_se"] = 0.0  # a file without its steps: every gap counts
        if "steps_ms" in meas:  # the step the prediction's stands for, and its standard error
            args = (meas["steps_ms"], len(meas["steps_ms"]), pred["steps_vary"])
            meas["step_ms"], meas["step_rel_se"] = typical_step_ms(*args), typical_step_rel_se(*args)
        rows.append({**{k: m[k] for k in ("id", "kind", "budget_mb", "eviction", "lookahead", "activations",
                                           "held_out")},
                     "predicted": pred, "measured": meas,
                     "pool_events": {k: meas[k] for k in POOL_EVENTS if meas.get(k)},
                     "error": {"step_ms": _rel(pred["step_ms"], meas["step_ms"]),
                               "stall_ms": _rel(pred["stall_ms"], meas["stall_ms"]) if stalled else None,
                               "peak_device_bytes": _rel(pred["peak_device_bytes"], meas["peak_device_bytes"])}})
    fit = [r for r in rows if not r["held_out"]]
    held = [r for r in rows if r["held_out"]]
    ranking = _ranking(rows)
    return {"hardware": hw.name, "trace_model": trace.header.get("model"), "trace_source": trace.header.get("source"),
            "model_mb": sum(trace.weight_sizes.values()) / MB,
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
             f"{r['predicted']['stall_ms']:.2f}",
             "-" if r["measured"]["stall_ms"] is None else f"{r['measured']['stall_ms']:.2f}",
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
    if any(r["measured"]["stall_ms"] is None for r in rep["rows"]):
        md += ["- meas stall -: measured before a training step's waits on its streamed weights were timed", ""]
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
                  + f"; peak device bytes error max {pk['max']:.1%}"
                  + ("" if s["stall_abs_ms"]["mean"] is None
                     else f"; stall |pred - meas| mean {s['stall_abs_ms']['mean']:.2f} ms"))
    for g in rep["ranking"]:
        ties = "; ".join(f"{' and '.join(t['pair'])} tie within the measurements' spread ({t['gap']:.1%} apart, "
                         f"{t['resolvable']:.1%} would order them)" for t in g.get("ties", ()))
        predicted = g["predicted"][0] + "".join(
            f" {'=' if predicted_alike(ms, before) else '<'} {name}"
            for name, ms, before in zip(g["predicted"][1:], g["predicted_ms"][1:], g["predicted_ms"]))
        steps = "of training steps " if g.get("kind") == "train_lora" else ""
        md.append(f"- ranking {steps}at budget {g['budget_mb']} MB, lookahead {g['lookahead']}: measured "
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


def write_measurements(path: str | Path, data: dict) -> None:
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
