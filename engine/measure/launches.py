"""Counting the CUDA launches each record of a step makes (the launch census).

CUDA queues a bounded number of launched, unfinished operations per device
(hardware launch_queue_depth); a host that has filled it waits in its next launch.
How many records the host can run ahead of the GPU therefore depends on how many
launches each record makes: a few for a spec kernel, hundreds for a real module's
block. The recorders run one extra step under torch.profiler with a
mark (a profiler annotation) where each record starts, and count the device
operations (kernels, copies, memsets) whose launch falls between one mark and the
next. Launches before the first mark belong to the first record; launches inside a
`fetch()` span (the recorder bringing a record's weights in, which a run does on its
copy stream) are not counted.

    Census        the profiler around one step; `mark(key)` where record `key` starts,
                  `fetch()` around work not to count
    launches_by_mark   the count per mark from a Kineto trace's events (pure: tested on the CPU)
"""
from __future__ import annotations

import bisect
import json
import logging
import os
import tempfile
import threading
from contextlib import nullcontext
from typing import Any, Hashable, Iterable, Mapping

import torch

log = logging.getLogger(__name__)
_ONE_PROFILER = threading.Lock()  # torch's profiler is the process's: one census at a time

MARK = "offload-engine record "
FETCH = "offload-engine fetch"
DEVICE_OPS = ("kernel", "gpu_memcpy", "gpu_memset")  # Kineto categories of work a launch queues
HOST_CALLS = ("cuda_runtime", "cuda_driver")
TEARDOWN = "TEARDOWN_CUPTI"  # Kineto's switch: detach CUPTI when a profiling session ends


def launches_by_mark(events: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Device operations per mark label in a Kineto chrome trace's events: each operation
    counted under the last mark its launching host call follows (the first mark if none)."""
    events = list(events)
    calls = {e["args"]["correlation"]: e["ts"] for e in events
             if e.get("cat") in HOST_CALLS and "correlation" in e.get("args", {})}
    notes = [e for e in events if e.get("cat") == "user_annotation"]
    marks = sorted((e["ts"], e["name"][len(MARK):]) for e in notes if e.get("name", "").startswith(MARK))
    if not marks:
        return {}
    fetches = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in notes if e.get("name") == FETCH)
    starts = [a for a, _ in fetches]
    times = [t for t, _ in marks]
    counts = dict.fromkeys((label for _, label in marks), 0)
    for e in events:
        if e.get("cat") not in DEVICE_OPS:
            continue
        ts = calls.get(e.get("args", {}).get("correlation"))
        if ts is None:
            continue
        f = bisect.bisect_right(starts, ts) - 1
        if f >= 0 and ts <= fetches[f][1]:
            continue  # the recorder's own weight copies
        counts[marks[max(0, bisect.bisect_right(times, ts) - 1)][1]] += 1
    return counts


class Census:
    """One step's launches per record: run the step inside (`with Census(on) as c:`), calling
    `c.mark(key)` where each record's host work starts; `counts` after the block maps each
    key to its launches. Off (`on` False, or no CUDA device) it marks nothing and counts
    stay empty: a recording on the cpu backend has no launches to count. Censuses in two
    threads take turns (launches another thread makes meanwhile count too); under a profiler
    the caller runs, it counts nothing (one warning): torch runs one profiler a process."""

    def __init__(self, on: bool):
        self.on = on and torch.cuda.is_available()
        self.counts: dict[Hashable, int] = {}
        self._keys: dict[str, Hashable] = {}
        self._prof: Any = None

    def mark(self, key: Hashable) -> None:
        if not self.on:
            return
        label = str(key)
        self._keys.setdefault(label, key)
        with torch.profiler.record_function(MARK + label):
            pass

    def fetch(self) -> Any:
        """A span whose launches are not counted (a context manager)."""
        return torch.profiler.record_function(FETCH) if self.on else nullcontext()

    def __enter__(self) -> Census:
        if not self.on:
            return self
        _ONE_PROFILER.acquire()
        if torch.autograd.profiler._is_profiler_enabled:
            _ONE_PROFILER.release()
            self.on = False
            log.warning("a torch profiler is running: the recording's launches are not counted (the simulator "
                        "takes one a record); record outside the profiler to count them")
            return self
        # Kineto leaves CUPTI attached after a session unless told to tear it down; every later
        # launch in the process then pays CUPTI's callbacks, the recording's all-resident steps
        # and a user's steps after an eviction="auto" set-up included. A caller's own setting stays.
        os.environ.setdefault(TEARDOWN, "1")
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                        torch.profiler.ProfilerActivity.CUDA])
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._prof is None:
            return
        try:
            torch.cuda.synchronize()
            self._prof.__exit__(*exc)
        finally:
            _ONE_PROFILER.release()
        if exc[0] is not None:
            return
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            self._prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f)["traceEvents"]
        finally:
            os.unlink(path)
        self.counts = {self._keys[label]: n for label, n in launches_by_mark(events).items() if label in self._keys}
