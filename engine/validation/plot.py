"""validate.png: a validation report drawn. Left, each policy's step time against the budget,
predicted (a line) beside measured (its markers), every weight resident at the model's size;
right, each row's step error, held-out rows hatched, the rows the CUDA pool's events fell in
outlined."""
from __future__ import annotations

from pathlib import Path

# The band of step error the right panel shades around zero.
BAND = 0.04


def plot_validation(rep: dict, path: str | Path) -> None:
    """Draw `rep` (engine.validation.report's report) into `path`."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, Agg renders savefig

    rows = rep["rows"]
    fig = Figure(figsize=(13, 5.5), layout="constrained")
    steps, errors = fig.subplots(1, 2, width_ratios=(1.3, 1))
    series: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["budget_mb"] is not None:
            series.setdefault((r["kind"], r["eviction"], r["lookahead"]), []).append(r)
    for i, (key, rs) in enumerate(sorted(series.items())):
        rs = sorted(rs, key=lambda r: r["budget_mb"])
        color = f"C{i % 10}"
        xs = [r["budget_mb"] for r in rs]
        label = f"{key[1]} lookahead {key[2]}" + (" (training)" if key[0] == "train_lora" else "")
        steps.plot(xs, [r["predicted"]["step_ms"] for r in rs], ls="--", color=color, lw=1.2)
        steps.scatter(xs, [r["measured"]["step_ms"] for r in rs], color=color, s=26, label=label, zorder=3)
    resident = [r for r in rows if r["budget_mb"] is None]
    if resident:
        at = [rep["model_mb"]] * len(resident)
        steps.scatter(at, [r["measured"]["step_ms"] for r in resident], marker="D", color="0.2", s=26,
                      label="every weight resident", zorder=3)
        steps.scatter(at, [r["predicted"]["step_ms"] for r in resident], marker="_", color="0.2", s=160, zorder=3)
    steps.plot([], [], ls="--", color="0.4", label="predicted (lines; resident: bars)")
    steps.set_xlabel("budget (MB of GPU memory for weights)")
    steps.set_ylabel("step time (ms)")
    steps.set_title(f"{rep['trace_model']} on {rep['hardware']}: measured (markers), predicted (lines)",
                    fontsize=10)
    steps.grid(alpha=0.3)
    steps.legend(fontsize=7)

    ys = list(range(len(rows)))
    values = [100 * (r["error"]["step_ms"] or 0.0) for r in rows]
    bars = errors.barh(ys, values, color=["0.55" if r["held_out"] else "tab:blue" for r in rows], height=0.7)
    for bar, r in zip(bars, rows):
        if r["held_out"]:
            bar.set_hatch("///")
        if r["pool_events"]:
            bar.set_edgecolor("tab:red")
            bar.set_linewidth(1.5)
    errors.axvspan(-100 * BAND, 100 * BAND, color="tab:green", alpha=0.08)
    errors.axvline(0, color="0.3", lw=0.8)
    errors.set_yticks(ys, [r["id"] for r in rows], fontsize=6)
    errors.invert_yaxis()
    errors.set_xlabel("step error, predicted over measured (%)")
    errors.set_title(f"errors (hatched: held out; red edge: the pool's events; shaded: within {BAND:.0%})", fontsize=10)
    errors.grid(axis="x", alpha=0.3)
    fig.savefig(path, dpi=110)

