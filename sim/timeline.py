"""The simulated timeline, for people: a Perfetto/Chrome trace and a PNG.

Each track (host, compute, h2d, d2h) holds at most one span at a time (the
host issues one kernel at a time; each copy direction is a FIFO), so its
"start X" / "end X" events pair up in order.

timeline.png answers "where does the step's time go" at a glance: the whole run as
busy-fraction strips per lane (compute, stalls, copies each way, the host), device
memory above them, and the steady-state step below as a Gantt chart with thin bars.
A compute gap is a stall when its kernel was launched and waited on copies, and idle
time (waiting for a launch) when the host had not launched it yet.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.files import write_text_atomic
from sim.simulator import SimResult

TRACKS = ("host", "compute", "h2d", "d2h")
_TID = {name: i + 1 for i, name in enumerate(TRACKS)}

Span = tuple[int, int, str]

# (label, colour) of each kind of bar, in the legend's order.
KINDS = {
    "compute": ("kernel", "#2ca02c"),
    "stall": ("stall: launched, waiting on copies", "#d62728"),
    "idle": ("idle: waiting for the host's launch", "#c7c7c7"),
    "h2d": ("H2D weight copy", "#1f77b4"),
    "restore": ("H2D activation restore", "#9467bd"),
    "d2h": ("D2H activation spill", "#ff7f0e"),
    "host": ("host issuing a kernel", "#7f7f7f"),
}


def spans(result: SimResult) -> dict[str, list[Span]]:
    """(start ns, end ns, name) per track, from the event log."""
    out: dict[str, list[Span]] = {t: [] for t in TRACKS}
    open_: dict[str, tuple[int, str]] = {}
    for t, track, what in result.events:
        kind, _, name = what.partition(" ")
        if kind == "start":
            open_[track] = (t, name)
        elif kind == "end":
            start, name = open_.pop(track)
            out[track].append((start, t, name))
    return out


MEASURED_TRACKS = ("compute", "h2d")


def write_chrome_trace(result: SimResult, path: str | Path, measured: list | None = None) -> None:
    """A JSON trace for ui.perfetto.dev or chrome://tracing; times in microseconds.
    `measured`, (track, name, start ms, end ms) of the executor's timed last step,
    is a second process, placed at the simulated last step's start."""
    tracks = spans(result)
    events: list[dict] = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "simulated GPU"}}]
    events += [{"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": name}}
               for name, tid in _TID.items()]
    for track, items in tracks.items():
        events += [{"ph": "X", "name": name, "pid": 1, "tid": _TID[track], "ts": s / 1e3, "dur": (e - s) / 1e3}
                   for s, e, name in items]
    events += [{"ph": "i", "s": "t", "name": what, "pid": 1, "tid": _TID[track], "ts": t / 1e3}
               for t, track, what in result.events if not what.startswith(("start ", "end "))]
    events += [{"ph": "C", "name": "device bytes", "pid": 1, "ts": t / 1e3, "args": {"bytes": b}}
               for t, b in result.device_bytes]
    events += [{"ph": "i", "s": "g", "name": f"step {i} end", "pid": 1, "ts": t / 1e3}
               for i, t in enumerate(result.step_ends_ns)]
    if measured:
        t0 = _last_step_start(result) / 1e3
        events += [{"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "measured GPU (last step)"}}]
        events += [{"ph": "M", "name": "thread_name", "pid": 2, "tid": i + 1, "args": {"name": name}}
                   for i, name in enumerate(MEASURED_TRACKS)]
        events += [{"ph": "X", "name": name, "pid": 2, "tid": MEASURED_TRACKS.index(track) + 1,
                    "ts": t0 + a * 1e3, "dur": (b - a) * 1e3} for track, name, a, b in measured]
    write_text_atomic(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, separators=(",", ":")))


def _last_step_start(result: SimResult) -> int:
    ends = result.step_ends_ns
    return ends[-2] if len(ends) > 1 else 0


def lanes(tracks: dict[str, list[Span]]) -> dict[str, list[tuple[int, int]]]:
    """(start, end) ns per kind of bar (KINDS): compute gaps split into stalls and idle
    time by when the host launched the kernel (the end of its host span)."""
    out: dict[str, list[tuple[int, int]]] = {k: [] for k in KINDS}
    compute, launches = tracks["compute"], [e for _, e, _ in tracks["host"]]
    prev_end = 0
    for i, (s, e, _) in enumerate(compute):
        launched = launches[i] if i < len(launches) else prev_end
        if launched > prev_end:
            out["idle"].append((prev_end, min(launched, s)))
        if s > max(prev_end, launched):
            out["stall"].append((max(prev_end, launched), s))
        out["compute"].append((s, e))
        prev_end = e
    for s, e, name in tracks["h2d"]:
        out["restore" if name.startswith("restore ") else "h2d"].append((s, e))
    out["d2h"] = [(s, e) for s, e, _ in tracks["d2h"]]
    out["host"] = [(s, e) for s, e, _ in tracks["host"]]
    return out


def busy_fraction(intervals: list[tuple[int, int]], edges: "np.ndarray") -> "np.ndarray":  # noqa: F821
    """The share of each bin [edges[i], edges[i+1]) covered by disjoint, sorted intervals."""
    import numpy as np

    if not intervals:
        return np.zeros(len(edges) - 1)
    iv = np.asarray(intervals, dtype=np.float64)
    times = iv.reshape(-1)  # s0, e0, s1, e1, ...
    covered = np.concatenate([[0.0], np.cumsum(iv[:, 1] - iv[:, 0])])
    cum = np.empty(len(times))
    cum[0::2], cum[1::2] = covered[:-1], covered[1:]  # covered time is flat between intervals
    at = np.interp(edges, times, cum)
    return np.diff(at) / np.diff(edges)


LIGHT = {"h2d": "#6baed6", "restore": "#c5b0d5", "d2h": "#ffbb78"}  # every other copy

# Lanes of the picture, top to bottom, and the kinds drawn in each.
ROWS = (("host", ("host",)), ("compute", ("compute", "stall", "idle")), ("H2D", ("h2d", "restore")),
        ("D2H", ("d2h",)))


def plot_timeline(result: SimResult, path: str | Path, measured: list | None = None) -> None:
    """timeline.png: device memory and busy-fraction lanes over the whole run, and the
    last (steady-state) step as a Gantt chart; with `measured` (the executor's timed
    last step), that step as measured below it, on the same scale."""
    import numpy as np
    from matplotlib.figure import Figure  # no pyplot: no global backend, Agg renders savefig
    from matplotlib.patches import Patch

    by_kind = lanes(spans(result))
    ends = result.step_ends_ns
    t_end = ends[-1] if ends else max((e for iv in by_kind.values() for _, e in iv), default=1)
    t0, t1 = (ends[-2] if len(ends) > 1 else 0), t_end
    pred = result.prediction

    fig = Figure(figsize=(13, 9.5 if measured else 7.5))  # fixed margins: a constrained layout costs as much as the drawing
    ratios = (1.1, 1.3, 2.2) + ((1.4,) if measured else ())
    axes = fig.subplots(len(ratios), 1, gridspec_kw={"height_ratios": ratios, "left": 0.06, "right": 0.99,
                                                     "top": 0.92, "bottom": 0.1, "hspace": 0.45})
    mem, whole, step = axes[:3]
    fig.suptitle(f"Simulated: {pred['step_ms']:.2f} ms a step (compute {pred['compute_ms']:.2f}, "
                 f"stall {pred['stall_ms']:.2f}), copies {pred['overlap']:.0%} hidden behind compute, "
                 f"peak {pred['peak_device_bytes'] / 1e9:.2f} GB", fontsize=11)

    ms = np.array([t for t, _ in result.device_bytes]) / 1e6
    mem.step(ms, np.array([b for _, b in result.device_bytes]) / 1e9, where="post", color="tab:purple", lw=1)
    mem.set_ylabel("device GB")
    mem.set_title("device memory: weights + saved activations (dotted: step ends)", fontsize=9, loc="left")

    edges = np.linspace(0, t_end, 601)
    for row, (_, kinds) in enumerate(ROWS):
        bottom = np.full(len(edges) - 1, row - 0.4)
        for kind in kinds:  # stacked: a compute lane's kernels, stalls and idle time fill it
            top = bottom + 0.8 * busy_fraction(by_kind[kind], edges)
            # fill_between, not stairs: stairs with an array baseline draws ~15x slower
            whole.fill_between(np.repeat(edges, 2)[1:-1] / 1e6, np.repeat(bottom, 2), np.repeat(top, 2),
                               color=KINDS[kind][1], lw=0)
            bottom = top
    whole.set_title("whole run: share of each moment each lane is busy (bar height)", fontsize=9, loc="left")

    for row, (_, kinds) in enumerate(ROWS):
        for kind in kinds:
            bars = [(max(s, t0) / 1e6, (min(e, t1) - max(s, t0)) / 1e6) for s, e in by_kind[kind] if e > t0 and s < t1]
            if kind in LIGHT:  # back-to-back copies in alternating shades, so each one shows
                step.broken_barh(bars[1::2], (row - 0.3, 0.6), color=LIGHT[kind], lw=0)
                bars = bars[::2]
            step.broken_barh(bars, (row - 0.3, 0.6), color=KINDS[kind][1], lw=0)
    step.set_xlim(t0 / 1e6, t1 / 1e6)
    step.set_title(f"last step ({(t1 - t0) / 1e6:.2f} ms), the steady state: one bar per kernel and copy",
                   fontsize=9, loc="left")
    step.set_xlabel("time (ms)")

    for ax in (whole, step):
        ax.set_yticks(range(len(ROWS)), [name for name, _ in ROWS])
        ax.set_ylim(len(ROWS) - 0.5, -0.5)
    if measured:
        _plot_measured(axes[3], measured, (t1 - t0) / 1e6)
    for ax in (mem, whole):
        ax.set_xlim(0, t_end / 1e6)
        for t in ends:
            ax.axvline(t / 1e6, color="black", lw=0.6, ls=":")
    shown = [k for k in KINDS if by_kind[k] or (measured and k == "stall")]
    fig.legend(handles=[Patch(color=KINDS[k][1], label=KINDS[k][0]) for k in shown], loc="lower center",
               ncols=min(4, len(shown)), fontsize=8, frameon=False)
    fig.savefig(path, dpi=100)


def _plot_measured(ax: Any, measured: list, simulated_ms: float) -> None:
    """The executor's timed step as a Gantt chart: kernels, the gaps where the GPU
    waited for their weights, and the weight copies."""
    kernels = sorted((a, b) for track, _, a, b in measured if track == "compute")
    copies = sorted((a, b) for track, _, a, b in measured if track == "h2d")
    gaps = [(e, s) for (_, e), (s, _) in zip(kernels, kernels[1:]) if s > e]
    step_ms = max((b for _, _, _, b in measured), default=0.0)
    for row, (bars, kind) in enumerate(((kernels, "compute"), (copies, "h2d"))):
        drawn = [(a, b - a) for a, b in bars]
        if kind == "h2d":
            ax.broken_barh(drawn[1::2], (row - 0.3, 0.6), color=LIGHT["h2d"], lw=0)
            drawn = drawn[::2]
        ax.broken_barh(drawn, (row - 0.3, 0.6), color=KINDS[kind][1], lw=0)
    ax.broken_barh([(a, b - a) for a, b in gaps], (-0.3, 0.6), color=KINDS["stall"][1], lw=0)
    ax.set_xlim(0, max(step_ms, simulated_ms))
    ax.set_yticks(range(2), ["compute", "H2D"])
    ax.set_ylim(1.5, -0.5)
    ax.set_title(f"last step as measured ({step_ms:.2f} ms; simulated {simulated_ms:.2f} ms): kernels, the GPU "
                 "waiting for their weights (red), weight copies", fontsize=9, loc="left")
    ax.set_xlabel("time from the step's start (ms)")
