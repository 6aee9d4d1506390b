"""What a finished sweep says: each point's row (from its report.json or error.json), the
answer to the sweep's question (engine/sweep.py's docstring), and the files that hold it:
summary.csv, summary.md and pareto.png beside the points."""
from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from engine.report import table

COLUMNS = ("job", "overrides", "model", "trace", "workload", "mode", "budget_mb", "eviction", "lookahead",
           "activations", "floor_mb", "model_mb", "step_ms", "predicted_step_ms", "stall_ms", "overlap",
           "bound_by", "h2d_gb_per_step",
           "peak_device_mb", "node", "gpus", "node_steps_per_s", "passed", "failures", "error")
SEARCH = "search.json"


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """Every finished point's row, in job order."""
    rows = [point_row(p) for p in sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()),
                                         key=lambda p: int(p.name))]
    return [r for r in rows if r is not None]


def point_row(job_dir: Path) -> dict[str, Any] | None:
    """One point's figures from its report.json (or its error.json); None while it runs."""
    overrides = _overrides(job_dir)
    report, error = job_dir / "report.json", job_dir / "error.json"
    if error.is_file():
        return {"job": int(job_dir.name), "overrides": overrides,
                "error": json.loads(error.read_text())["error"]}
    if not report.is_file():
        return None
    r = json.loads(report.read_text())
    c, pred, check = r.get("config", {}), r.get("prediction") or {}, r.get("check") or {}
    # mode=execute: the step the GPU measured is the point's step; the prediction stays beside it
    measured = (r.get("measurement") or {}).get("step_ms")
    return {
        "job": int(job_dir.name), "overrides": overrides,
        "model": c.get("model_option", c.get("model")), "trace": c.get("trace"),
        "workload": c.get("workload"), "mode": c.get("mode"),
        "budget_mb": c.get("budget_mb"), "eviction": c.get("eviction"),
        "lookahead": c.get("lookahead"), "activations": c.get("activations"),
        "floor_mb": r["floor_bytes"] / 1e6, "model_mb": r["model_bytes"] / 1e6,
        "step_ms": pred.get("step_ms") if measured is None else measured,
        "predicted_step_ms": pred.get("step_ms"),
        # the simulator's stall and overlap: an execute point measures neither
        "stall_ms": pred.get("stall_ms") if measured is None else None,
        "overlap": pred.get("overlap") if measured is None else None,
        "bound_by": pred.get("bound_by"),  # the prediction's: compute, copies or host
        "h2d_gb_per_step": None if "h2d_bytes" not in pred else pred["h2d_bytes"] / 1e9,
        "peak_device_mb": None if "peak_device_bytes" not in pred else pred["peak_device_bytes"] / 1e6,
        "node": (r.get("node") or {}).get("node"), "gpus": (r.get("node") or {}).get("gpus", 1),
        "node_steps_per_s": (r.get("node") or {}).get("steps_per_s"),
        "passed": check.get("passed"), "failures": list(check.get("failures", [])),
        "error": None,
    }


def _overrides(job_dir: Path) -> str:
    path = job_dir / ".hydra" / "overrides.yaml"
    return " ".join(OmegaConf.load(path)) if path.is_file() else ""


def budget_of(row: dict[str, Any]) -> float:
    """The budget a row ran at; everything resident (budget=null) counts as the model's size."""
    return row["budget_mb"] if row.get("budget_mb") is not None else row["model_mb"]


def budget_text(row: dict[str, Any]) -> str:
    """The budget a row ran at, in words."""
    return "everything resident" if row.get("budget_mb") is None else f"budget {row['budget_mb']:g} MB"


def policy_text(row: dict[str, Any]) -> str:
    """The policies that ran: eviction and lookahead when weights stream, activations when they spill."""
    parts = [] if row.get("budget_mb") is None else [f"{row['eviction']} lookahead {row['lookahead']}"]
    if row.get("activations") not in (None, "off"):
        parts.append(f"activations {row['activations']}")
    return ", ".join(parts) or "-"


def pareto_front(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The points no other point beats on both budget and step time, by budget.
    A point is dominated when another has a budget no larger and a step no slower,
    one of them strictly."""
    pts = sorted((r for r in rows if r.get("step_ms") is not None and r.get("error") is None),
                 key=lambda r: (budget_of(r), r["step_ms"]))
    front: list[dict[str, Any]] = []
    for r in pts:  # within a budget the fastest comes first, so the rest are dominated
        if not front or r["step_ms"] < front[-1]["step_ms"]:
            front.append(r)
    return front


@dataclass
class Answer:
    """The sweep's answer: lines for the terminal and summary.md, the point it names, the exit code."""

    lines: list[str] = field(default_factory=list)
    best: dict[str, Any] | None = None
    exit_code: int = 0


def _point(r: dict[str, Any]) -> str:
    policy = policy_text(r)
    return (f"job {r['job']} ({budget_text(r)}{'' if policy == '-' else ', ' + policy}): "
            f"{r['step_ms']:.2f} ms per step")


def answer(rows: list[dict[str, Any]], search: dict[str, Any] | None, slo: str | None) -> Answer:
    """What the sweep asked, answered from its rows (and its search.json, for a search)."""
    ran = [r for r in rows if r.get("error") is None and r.get("step_ms") is not None]
    errors = [r for r in rows if r.get("error")]
    out = Answer()
    if errors:
        out.lines.append(f"{len(errors)} of {len(rows)} points failed to run (error column, and each point's line).")
    checked = [r for r in ran if r.get("passed") is not None]
    if not checked:
        if not ran and rows and not errors:  # every point ran a mode that predicts no step (plan, record)
            modes = ", ".join(sorted({str(r.get("mode")) for r in rows}))
            out.lines.insert(0, f"Every point ran (mode={modes}); none predicts a step time, so none is ranked.")
            return out
        if not ran:
            out.lines.insert(0, "No point ran.")
            out.exit_code = 1
            return out
        out.best = min(ran, key=lambda r: (r["step_ms"], budget_of(r)))
        out.lines.insert(0, f"Fastest: {_point(out.best)}.")
        if len({r.get("gpus", 1) for r in ran}) > 1:  # a sweep over node shapes: what the node gets done

            def rate(r: dict[str, Any]) -> float:
                return r.get("node_steps_per_s") or 1000 / r["step_ms"]
            top = max(ran, key=rate)
            out.lines.insert(1, f"Most steps a second: {_point(top)} with {top.get('gpus', 1)} replica(s) on "
                             f"{top.get('node') or 'one GPU'}: {rate(top):.2f} steps/s.")
        if len({budget_of(r) for r in ran}) > 1:
            front = pareto_front(ran)
            out.lines.insert(1, "Pareto front (no point is both smaller and faster): " + ", ".join(
                f"{budget_text(r)} {r['step_ms']:.2f} ms ({r['eviction']})" for r in front) + ".")
        return out
    passing = [r for r in checked if r["passed"]]
    kind = (search or {}).get("search")
    if not passing:
        closest = min(checked, key=lambda r: (len(r["failures"]), r["step_ms"]))
        lead = (f"No budget meets slo={slo}, not even everything resident" if kind == "min_budget"
                else f"No point meets slo={slo}")
        out.lines.insert(0, f"{lead}. Closest: {_point(closest)}; fails: {'; '.join(closest['failures'])}.")
        out.best, out.exit_code = closest, 1
        return out
    fastest = min(passing, key=lambda r: (r["step_ms"], budget_of(r)))
    smallest = min(passing, key=lambda r: (budget_of(r), r["step_ms"]))
    if kind == "min_budget":
        res, mb = search["resolution_mb"], search["answer_mb"]
        if mb is None:
            out.best = next(r for r in passing if r.get("budget_mb") is None)
            text = f"Only everything resident meets slo={slo} ({_point(out.best)})"
        else:
            out.best = next(r for r in passing if r.get("budget_mb") == mb)
            below = [r for r in checked if not r["passed"] and r.get("budget_mb") is not None
                     and math.isclose(r["budget_mb"], mb - res)]
            text = (f"Smallest budget that meets slo={slo}: {mb:g} MB, to {res:g} MB ({_point(out.best)}); "
                    + (f"{mb - res:g} MB fails: {'; '.join(below[0]['failures'])}" if below
                       else f"{mb - res:g} MB is under the floor"))
        out.lines.insert(0, text + f". Bisection: {len(rows)} simulations, exact to {res:g} MB "
                                   "(pass/fail is monotone in the budget); another resolution: "
                                   "hydra.sweeper.resolution_mb=MB.")
    elif kind == "fastest_policy" or len({budget_of(r) for r in checked}) == 1:
        out.best = fastest
        out.lines.insert(0, f"Fastest within slo={slo}: {_point(fastest)}; {len(passing)} of {len(checked)} points pass.")
        if search and search.get("sampled"):
            out.lines.insert(1, f"Optuna (TPE) sampled {len(rows)} of the {search['space']} points of the space: "
                                "the answer is the best point seen, not a proven optimum.")
    else:
        out.best = smallest
        out.lines.insert(0, f"Smallest budget that passes slo={slo}: {_point(smallest)}; "
                            f"fastest that passes: {_point(fastest)}; {len(passing)} of {len(checked)} points pass.")
    return out


def slo_text(slo: Any) -> str:
    """The SLO by name and the limits it sets, e.g. `interactive (step <= 500 ms, overlap >= 0.8)`."""
    limits = [f"{what} {op} {slo[key]:g}{unit}" for key, what, op, unit in (
        ("max_step_ms", "step", "<=", " ms"), ("min_overlap", "overlap", ">=", ""),
        ("max_stall_ms", "stall", "<=", " ms")) if slo.get(key) is not None]
    return slo.name + (f" ({', '.join(limits)})" if limits else "")


def write_summary(sweep_dir: Path, rows: list[dict[str, Any]], result: Answer, slo_step_ms: float | None) -> None:
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: "; ".join(r[k]) if k == "failures" and r.get(k) else r.get(k) for k in COLUMNS})
    # the trace only where the sweep replays more than one (recordings of one model's groupings, say)
    shown = [c for c in COLUMNS if c not in ("overrides", "model_mb")
             and any(r.get(c) not in (None, "", []) for r in rows)
             and (c != "trace" or len({r.get("trace") for r in rows if r.get("trace")}) > 1)]
    md = [f"# Sweep summary: {len(rows)} points", "", *result.lines, "",
          table(shown, [[_cell(c, r.get(c)) for c in shown] for r in rows])]
    if result.best is not None:
        md += ["", f"Point named above: `{result.best['overrides']}` (its report: {result.best['job']}/report.md)."]
    (sweep_dir / "summary.md").write_text("\n".join(md) + "\n")
    if len({budget_of(r) for r in rows if r.get("step_ms") is not None}) > 1:
        plot_pareto(rows, sweep_dir / "pareto.png", slo_step_ms)


def _cell(column: str, v: Any) -> str:
    if v is None:
        return "-"
    if column == "passed":
        return "PASS" if v else "FAIL"
    if column == "failures":
        return "; ".join(v) or "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def plot_pareto(rows: list[dict[str, Any]], path: Path, slo_step_ms: float | None) -> None:
    """Predicted step time against budget: every point, the Pareto front joined, the floor
    and the SLO's step time marked. A check sweep's front is drawn through passing points."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, Agg renders savefig

    ran = [r for r in rows if r.get("step_ms") is not None and r.get("error") is None]
    checked = any(r.get("passed") is not None for r in ran)
    eligible = [r for r in ran if r.get("passed") is not False]
    front = pareto_front(eligible)
    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.subplots()
    policies = sorted({r["eviction"] for r in ran})
    markers = dict(zip(policies, "os^Dv<>"))
    for policy in policies:
        mine = [r for r in ran if r["eviction"] == policy]
        ok = [r for r in mine if r.get("passed") is not False]
        bad = [r for r in mine if r.get("passed") is False]
        ax.scatter([budget_of(r) for r in ok], [r["step_ms"] for r in ok], marker=markers[policy],
                   s=28, color="0.55", label=policy, zorder=2)
        if bad:
            ax.scatter([budget_of(r) for r in bad], [r["step_ms"] for r in bad], marker=markers[policy],
                       s=28, facecolors="none", edgecolors="0.65", zorder=2)
    if front:
        xs, ys = [budget_of(r) for r in front], [r["step_ms"] for r in front]
        ax.step(xs, ys, where="post", color="tab:blue", lw=1.5, zorder=3)
        ax.scatter(xs, ys, color="tab:blue", s=40, zorder=4,
                   label="Pareto front" + (" (passing points)" if checked else ""))
        for r in front:
            ax.annotate(f"{r['step_ms']:.0f} ms\n{r['eviction']}", (budget_of(r), r["step_ms"]),
                        textcoords="offset points", xytext=(4, 4), fontsize=7, color="tab:blue")
    if checked and any(r.get("passed") is False for r in ran):
        ax.scatter([], [], marker="o", facecolors="none", edgecolors="0.65", label="fails the SLO")
    for i, f in enumerate(sorted({round(r["floor_mb"], 1) for r in ran})):
        ax.axvline(f, color="tab:red", ls="--", lw=1, label=f"floor {f:g} MB" if i == 0 else None)
    if slo_step_ms is not None:
        ax.axhline(slo_step_ms, color="tab:orange", ls=":", lw=1.5, label=f"SLO {slo_step_ms:g} ms")
    resident = sorted({r["model_mb"] for r in ran if r.get("budget_mb") is None})
    for x in resident:
        ax.annotate("everything\nresident", (x, ax.get_ylim()[0]), fontsize=7, ha="center", va="bottom")
    ax.set_xlabel("budget (MB of GPU memory for weights)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title("Step time against budget: lower left is better")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
