"""Multirun that summarizes itself: progress while it runs, a summary after.

Hydra's `on_multirun_end` receives no job results, so the summary scans the
sweep directory for each job's report.json (or error.json) and writes
summary.csv, summary.md and pareto.png beside them. Progress is counted the
same way, so it works for any launcher whose jobs share the filesystem
(basic, joblib, Ray on one machine).
"""
from __future__ import annotations

import csv
import itertools
import json
import math
import time
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from engine.report import table

COLUMNS = ("job", "overrides", "model", "workload", "mode", "budget_mb", "eviction", "lookahead",
           "activations", "floor_mb", "step_ms", "stall_ms", "overlap", "h2d_gb_per_step",
           "peak_device_mb", "passed", "failures", "objective", "error")


def sweep_size(task_overrides: list[str]) -> int:
    """Points in a grid sweep: the product of each sweep override's choices."""
    parsed = OverridesParser.create().parse_overrides(list(task_overrides))
    sizes = [len(list(o.sweep_iterator())) for o in parsed if o.is_sweep_override()]
    return math.prod(sizes) if sizes else 1


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for job_dir in sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()),
                          key=lambda p: int(p.name)):
        rows.append(_row(job_dir))
    return [r for r in rows if r is not None]


def _row(job_dir: Path) -> dict[str, Any] | None:
    overrides = _overrides(job_dir)
    report, error = job_dir / "report.json", job_dir / "error.json"
    if error.is_file():
        return {"job": int(job_dir.name), "overrides": overrides,
                "error": json.loads(error.read_text())["error"]}
    if not report.is_file():
        return None
    r = json.loads(report.read_text())
    c, pred, check = r.get("config", {}), r.get("prediction") or {}, r.get("check") or {}
    return {
        "job": int(job_dir.name), "overrides": overrides,
        "model": c.get("model"), "workload": c.get("workload"), "mode": c.get("mode"),
        "budget_mb": c.get("budget_mb"), "eviction": c.get("eviction"),
        "lookahead": c.get("lookahead"), "activations": c.get("activations"),
        "floor_mb": r["floor_bytes"] / 1e6,
        "step_ms": pred.get("step_ms"), "stall_ms": pred.get("stall_ms"),
        "overlap": pred.get("overlap"),
        "h2d_gb_per_step": None if "h2d_bytes" not in pred else pred["h2d_bytes"] / 1e9,
        "peak_device_mb": None if "peak_device_bytes" not in pred else pred["peak_device_bytes"] / 1e6,
        "passed": check.get("passed"), "failures": "; ".join(check.get("failures", [])),
        "objective": r.get("objective_value"), "error": None,
    }


def _overrides(job_dir: Path) -> str:
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return ""
    from omegaconf import OmegaConf

    return " ".join(OmegaConf.load(path))


def winner(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The point with the smallest objective that met its SLO (or had none)."""
    ok = [r for r in rows if isinstance(r.get("objective"), (int, float))
          and math.isfinite(r["objective"]) and r.get("passed") is not False]
    return min(ok, key=lambda r: (r["objective"], r.get("budget_mb") or math.inf), default=None)


def write_summary(sweep_dir: Path, rows: list[dict[str, Any]]) -> None:
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in COLUMNS})
    shown = [c for c in COLUMNS if c != "overrides" and any(r.get(c) not in (None, "") for r in rows)]
    md = [f"# Sweep summary: {len(rows)} points", "",
          table(shown, [[_cell(r.get(c)) for c in shown] for r in rows])]
    best = winner(rows)
    if best is not None:
        md += ["", f"**Winner** (smallest objective): job {best['job']} ({best['overrides']}): "
                   f"objective {best['objective']:.3f}, {best['step_ms']:.2f} ms predicted per step."]
    failed = [r for r in rows if r.get("error")]
    if failed:
        md += ["", f"{len(failed)} point(s) failed; see the error column."]
    (sweep_dir / "summary.md").write_text("\n".join(md) + "\n")
    plot_pareto(rows, sweep_dir / "pareto.png")


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def plot_pareto(rows: list[dict[str, Any]], path: Path) -> None:
    """Predicted step time against budget, one line per eviction policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [r for r in rows if r.get("step_ms") is not None and r.get("budget_mb") is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, group in itertools.groupby(sorted(pts, key=lambda r: (r["eviction"], r["budget_mb"])),
                                           key=lambda r: r["eviction"]):
        g = list(group)
        # Several points per budget (other swept keys): the best one is the frontier.
        best: dict[float, float] = {}
        for r in g:
            best[r["budget_mb"]] = min(best.get(r["budget_mb"], math.inf), r["step_ms"])
        xs = sorted(best)
        ax.plot(xs, [best[x] for x in xs], marker="o", label=policy)
    floors = sorted({round(r["floor_mb"], 1) for r in rows if r.get("floor_mb")})
    for i, f in enumerate(floors):
        ax.axvline(f, color="red", ls="--", lw=1, label="floor" if i == 0 else None)
    ax.set_xlabel("budget (MB)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title("Step time against budget")
    ax.grid(alpha=0.3)
    if pts or floors:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class SweepSummary(Callback):
    """Hydra callback: progress with an ETA per finished job, summary at the end."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        total = sweep_size(list(config.hydra.overrides.task))
        (sweep_dir / ".progress.json").write_text(json.dumps({"total": total, "start": time.time()}))

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if HydraConfig.get().mode != RunMode.MULTIRUN:
            return
        sweep_dir = Path(config.hydra.sweep.dir)
        progress = sweep_dir / ".progress.json"
        if not progress.is_file():
            return
        state = json.loads(progress.read_text())
        done = sum(1 for p in sweep_dir.iterdir()
                   if p.is_dir() and ((p / "report.json").is_file() or (p / "error.json").is_file()))
        elapsed = time.time() - state["start"]
        total = max(state["total"], done)
        eta = elapsed / done * (total - done) if done else math.nan
        print(f"[sweep] {done}/{total} points done, {elapsed:.1f} s elapsed, ETA {eta:.1f} s",
              flush=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = collect(sweep_dir)
        write_summary(sweep_dir, rows)
        print(f"[sweep] summary: {sweep_dir / 'summary.md'} ({len(rows)} points)", flush=True)
