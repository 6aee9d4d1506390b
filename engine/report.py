"""report.json (stable keys, for machines) and report.md (tables, for people).

The same markdown is printed to the terminal, so what a user reads and what
the run directory keeps never disagree.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Sequence

from engine.files import write_text_atomic
from engine.measure.spread import MEDIAN_REL_SE, median_rel_se, spread_text


def fmt_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    return f"{n / 1e6:,.1f} MB" if abs(n) < 1e9 else f"{n / 1e9:,.3f} GB"


def table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "| " + " | ".join("-" * w for w in widths) + " |",
                      *(line(r) for r in rows)])


def title_md(model_option: str, cfg: Any) -> str:
    """The report's first lines: the model as the user named it (and its spec's name
    where that differs), the workload, budget and mode, and the hardware profile."""
    model = model_option if model_option == cfg.model.name else f"{model_option} ({cfg.model.name})"
    budget = "everything resident" if cfg.budget is None else f"budget {cfg.budget:g} MB"
    hw = cfg.hardware
    return (f"# {model} / {cfg.workload.name} on {hw.name}: {budget}, mode={cfg.mode}\n\n"
            f"hardware={hw.name}: {hw.source}; {hw.device_memory_mb:,} MB device memory, "
            f"H2D {hw.h2d_gbps:g} GB/s, D2H {hw.d2h_gbps:g} GB/s")


def plan_md(plan: dict) -> str:
    budget = plan["budget_bytes"]
    head = [
        "## Plan",
        "",
        table(["what", "value"], [
            ["parameters", f"{plan['param_count']:,}"],
            ["model bytes", f"{plan['model_bytes']:,} ({fmt_bytes(plan['model_bytes'])})"],
            ["weights / kernels per step", f"{plan['weight_count']:,} / {plan['kernel_count']:,}"],
            ["budget", "all resident (null)" if budget is None else f"{budget:,} ({fmt_bytes(budget)})"],
            ["floor (the advised minimum: full lookahead)",
             f"{plan['floor_bytes']:,} ({fmt_bytes(plan['floor_bytes'])})"],
            ["floor set by", " + ".join(plan["floor_kernels"])
             + f" ({fmt_bytes(plan['floor_pair_bytes'])}) + lookahead {plan['lookahead']} headroom "
               f"{fmt_bytes(plan['floor_headroom_bytes'])}"
             + (f" (the pair counts {fmt_bytes(plan['floor_resident_bytes'])} of weights under one granule, "
                "resident on the vmm backend)" if plan.get("floor_resident_bytes") else "")],
            ["hard minimum (under it hazards are certain)",
             f"{plan['floor_pair_bytes']:,} ({fmt_bytes(plan['floor_pair_bytes'])})"],
            ["distinct weight sizes (pool warm list)", f"{len(plan['pool_warm_sizes'])}"],
        ]),
    ]
    if plan["below_floor"]:
        certain = plan["budget_bytes"] < plan["floor_pair_bytes"]
        head += ["", f"**Budget is under the floor**: execute refuses it; use "
                     f"budget={-(-plan['floor_bytes'] // 1_000_000)} or more. "
                     + ("It is under the hard minimum too: every policy has hazards here."
                        if certain else "It is above the hard minimum: the prefetches run short, no hazards.")]
    else:
        head += ["", table(["eviction", "resident", "streamed / step", "copies / step", "first step"], [
            [name, fmt_bytes(p["resident_bytes"]), fmt_bytes(p["streamed_bytes_per_step"]),
             f"{p['copies_per_step']:,}", fmt_bytes(p["first_step_bytes"])]
            for name, p in plan["policies"].items()])]
    return "\n".join(head)


def write_report(out_dir: Path, report: dict, markdown: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / "report.json", json.dumps(report, indent=2, sort_keys=False) + "\n")
    write_text_atomic(out_dir / "report.md", markdown + "\n")


def launches_cell(launches: Sequence[int]) -> str:
    """A recorded step's CUDA launches (one count per record) as a report cell: the total and
    per record, or why there are none."""
    total = sum(launches)
    if not total:
        return "not counted (no CUDA device)"
    return f"{total:,} ({total / len(launches):.1f} a record)"


def varying_steps_note(step_ms_range: Sequence[float]) -> str:
    """The report's line where the policy's steps differ by design (belady's copies cycle):
    which step the step time is, predicted and measured (engine.measure.spread.typical_step_ms)."""
    lo, hi = step_ms_range
    return (f"the policy's steps differ by design (predicted {lo:.2f} to {hi:.2f} ms): the step time, predicted "
            "and measured, is the mean of the warm steps (all but the first two), not the median")


def relocations_note(measurement: dict) -> str | None:
    """The report's lines on the pool's refusals under the budget in a measured run, if it had any:
    those the released reserve answered, and the relocations."""
    total = measurement.get("relocations") or 0
    released = (measurement.get("reserve_releases") or 0) - total  # a relocation follows a release
    lines = []
    if released > 0:
        lines.append(f"- {released} pool refusals under the budget answered by releasing the pool's unused reserve "
                     "(no weight moved; the host waited for the copy stream to drain once each, and the link idled "
                     "while the driver mapped memory again: a stall the simulator does not predict; "
                     "weights.backend=vmm never does this)")
    if total:
        warm = measurement.get("warm_relocations", 0)
        lines.append(
            f"- {total} relocations, {warm} of them in the steps the median is taken over: the pool refused a "
            "block under the budget (fragmentation) and the resident weights were copied in again; the "
            f"simulator does not model this, so {'the measured step includes' if warm else 'only the first step includes'} "
            "stalls it did not predict; weights.backend=vmm never relocates")
    return "\n".join(lines) or None


def steps_cell(times_ms: Sequence[float]) -> str:
    """The measured steps a median is taken over (a run's steps after its first), for a
    report: their spread, and where it leaves the median uncertain by more than 1%, how many
    steps would pin it there (the standard error falls as one over the root of the count)."""
    text = spread_text(times_ms)
    se = median_rel_se(times_ms)
    if se <= MEDIAN_REL_SE:
        return text
    if not math.isfinite(se):
        return text + " (its spread needs three steps after the first: workload.steps=4 or more)"
    steps = 1 + math.ceil(len(times_ms) * (se / MEDIAN_REL_SE) ** 2)
    return text + f" (about workload.steps={steps} would pin the median within {MEDIAN_REL_SE:.0%})"
