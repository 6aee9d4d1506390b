"""The simulated timeline, for people: a Perfetto/Chrome trace and a PNG.

Each track (host, compute, h2d, d2h) holds at most one span at a time (the
host issues one kernel at a time; each copy direction is a FIFO), so its
"start X" / "end X" events pair up in order.
"""
from __future__ import annotations

import json
from pathlib import Path

from sim.simulator import SimResult

TRACKS = ("host", "compute", "h2d", "d2h")
_TID = {name: i + 1 for i, name in enumerate(TRACKS)}
_COLORS = {"host": "tab:gray", "compute": "tab:green", "h2d": "tab:blue", "d2h": "tab:orange"}


def spans(result: SimResult) -> dict[str, list[tuple[int, int, str]]]:
    """(start ns, end ns, name) per track, from the event log."""
    out: dict[str, list[tuple[int, int, str]]] = {t: [] for t in TRACKS}
    open_: dict[str, tuple[int, str]] = {}
    for t, track, what in result.events:
        kind, _, name = what.partition(" ")
        if kind == "start":
            open_[track] = (t, name)
        elif kind == "end":
            start, name = open_.pop(track)
            out[track].append((start, t, name))
    return out


def write_chrome_trace(result: SimResult, path: str | Path) -> None:
    """A JSON trace for ui.perfetto.dev or chrome://tracing; times in microseconds."""
    events: list[dict] = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "simulated GPU"}}]
    events += [{"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": name}}
               for name, tid in _TID.items()]
    for track, items in spans(result).items():
        events += [{"ph": "X", "name": name, "pid": 1, "tid": _TID[track], "ts": s / 1e3, "dur": (e - s) / 1e3}
                   for s, e, name in items]
    events += [{"ph": "i", "s": "t", "name": what, "pid": 1, "tid": _TID[track], "ts": t / 1e3}
               for t, track, what in result.events if not what.startswith(("start ", "end "))]
    events += [{"ph": "C", "name": "device bytes", "pid": 1, "ts": t / 1e3, "args": {"bytes": b}}
               for t, b in result.device_bytes]
    events += [{"ph": "i", "s": "g", "name": f"step {i} end", "pid": 1, "ts": t / 1e3}
               for i, t in enumerate(result.step_ends_ns)]
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def plot_timeline(result: SimResult, path: str | Path) -> None:
    """timeline.png: device memory over time above the occupancy of each stream."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, Agg renders savefig

    fig = Figure(figsize=(12, 6), layout="constrained")
    mem, occ = fig.subplots(2, 1, sharex=True, height_ratios=(1, 1))
    ms = [t / 1e6 for t, _ in result.device_bytes]
    mem.step(ms, [b / 1e9 for _, b in result.device_bytes], where="post", color="tab:purple")
    mem.set_ylabel("device GB")
    mem.set_title("device memory (weights + saved activations)")
    for t in result.step_ends_ns:
        mem.axvline(t / 1e6, color="black", linewidth=0.5, linestyle=":")
        occ.axvline(t / 1e6, color="black", linewidth=0.5, linestyle=":")
    for row, (track, items) in enumerate(spans(result).items()):
        occ.broken_barh([(s / 1e6, (e - s) / 1e6) for s, e, _ in items], (row - 0.4, 0.8),
                        color=_COLORS[track])
    occ.set_yticks(range(len(TRACKS)), TRACKS)
    occ.invert_yaxis()
    occ.set_xlabel("time (ms)")
    occ.set_title("stream occupancy (dotted: step ends)")
    fig.savefig(path, dpi=120)
