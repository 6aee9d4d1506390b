"""The prediction: per-step figures derived from a finished run.

A step runs from the end of the previous step's last kernel (0 for the first)
to the end of its own last kernel. Figures are for the last step (the steady
state) unless said otherwise:

    step_ms            the last step's duration
    first_step_ms      the first step's duration (cold: the pool starts empty)
    compute_ms         sum of the last step's kernel run times (slowdown under copies included;
                       a block's wait for its own host's launches is not among them)
    stall_ms           compute-stream idle time waiting on copies: a launched kernel
                       waiting for its weights, restores or offloads, plus idle time
                       for want of a launch while the launcher sat blocked on copies
                       (an allocation waiting for a free, an inline finalize).
                       step_ms - compute_ms - stall_ms is launch overhead that did not hide.
    overlap            share of the time the link was busy (either direction) in the
                       step's window during which a kernel was running; 1.0 when
                       nothing was copied (nothing exposed)
    h2d_bytes          bytes the last step's decisions copied host to device
                       (weight fetches and prefetches, activation restores)
    d2h_bytes          bytes the last step's decisions copied device to host (spills)
    peak_device_bytes  the most weight bytes plus the most saved-activation bytes on
                       the device over the whole run (a fit must hold in every step), each
                       peak taken on its own: the weight pool and torch's allocator each
                       keep the memory they reached, and `execute` measures each apart
    peak_process_bytes the whole device: peak_device_bytes + the transient activations
                       (a recorded module's measured peak of torch's allocations in a
                       step: activations, inputs and resident parameters, or a
                       synthesized inference's live activations and inputs traced on
                       the meta device, header "activation_peak_bytes"; else (training,
                       spec recordings) the largest kernel's activation
                       traffic, io_bytes less its weights: its inputs and outputs alive
                       together) + the context: the CUDA context and workspaces, as a
                       recording measured them (header "context_bytes"), else
                       hardware.context_mb
    peak_pool_torch_bytes  the same less the context: what `execute` measures (the weights'
                       held peak plus torch's allocator's)
    device_bound_bytes the most the device may have to hold: peak_process_bytes with the
                       weights at their backend's cap: on the CUDA pool its capacity (the
                       budget, or every weight) and its slack against fragmentation, which
                       the driver reserves as its placement needs (not predicted: up to all
                       of it); on vmm the chunks' peak, predicted. `check` holds this
                       against the device's memory
    pool_hits          last step's spills that got a pinned slab ("spill")
    pool_misses        last step's spills into unpinned memory ("miss")
    spilled            saved tensors the policy spilled in the last step (hits + misses)
    kept               saved tensors never spilled in the last step
    mean_step_ms       the mean duration of the warm steps: all but the first two (the cold
                       one and the one after the warm-up barrier), or the last when fewer than
                       three were simulated. Belady's decisions need not repeat from step to
                       step; its long run is this mean, not the last step
    step_ms_range      [shortest, longest] warm step
    mean_h2d_bytes     the warm steps' mean host-to-device bytes
    hazards            every step's use-after-evict hazards below the floor, in order:
                       {step, kernel (the reader), weight, evicted_by, time_ns, time_ms
                       (when the launcher evicted it)}

Everything is computed after the run from per-kernel start/end times and the
issued copies, so the simulation loop only records.
"""
from __future__ import annotations

from typing import Any

from engine.measure.spread import warm_steps
from engine.policy.placement import held_bytes, pool_slack_bytes
from engine.trace import Trace
from sim.compute import ComputeStream
from sim.launcher import Launcher
from sim.link import D2H, H2D
from sim.pool import DevicePool

NS_PER_MS = 1e6

Intervals = list[tuple[int, int]]


def union(intervals: Intervals) -> Intervals:
    """The intervals merged where they overlap, in order (sorted, disjoint)."""
    out: Intervals = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def _intersection_ns(a: Intervals, b: Intervals) -> int:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        lo = max(a[i][0], b[j][0])
        hi = min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def transient_bytes(trace: Trace) -> int:
    """Activation bytes alive beside the weights and the saved tensors (module docstring)."""
    recorded = trace.header.get("activation_peak_bytes")
    if recorded is not None:
        return int(recorded)
    sizes = trace.weight_sizes
    return max((r.io_bytes - sum(sizes[w] for w in set(r.weights)) for r in trace.records), default=0)


def pool_cap_bytes(launcher: Launcher, pool: DevicePool) -> int:
    """The most the CUDA pool may hold for the weights: its capacity and its slack
    (engine/policy/placement.py), as the executor caps it."""
    sizes = launcher.trace.weight_sizes
    if launcher.placement is not None:
        capacity = launcher.placement.pool_bytes
    else:
        capacity = held_bytes(pool.cap if pool.cap is not None else sum(sizes.values()), sizes.values())
    return capacity + pool_slack_bytes(max(sizes.values(), default=0))


def context_bytes(trace: Trace, hardware: Any) -> int:
    """Device bytes outside the tensors: a recording's own measurement (header
    "context_bytes"), else the hardware profile's context_mb."""
    recorded = trace.header.get("context_bytes")
    return int(recorded) if recorded is not None else round(hardware.context_mb * 1e6)


# Warm steps further apart than this share of their mean vary by design (belady's copies
# cycle): their mean is the long run, which a median, the commonest step, misses. Closer, a
# median is within half of it of their mean and, unlike a mean, is not moved by the odd
# slow step (a relocation, the host).
VARY = 0.05


def steps_vary(prediction: dict) -> bool:
    """Whether the warm steps differ (belady's may): their mean is then the long run, and
    more steps make it a better one."""
    lo, hi = prediction["step_ms_range"]
    return hi - lo > VARY * prediction["mean_step_ms"]


# A step whose GPU idles under this share of it is bound by its compute.
IDLE_BOUND = 0.03


def bound_by(step_ns: float, stall_ns: float, host_wait_ns: float) -> str:
    """What sets a step's time: "compute" where the GPU idles under IDLE_BOUND of the step,
    else what it idles for longer: "copies" (a stall) or "host" (its launches)."""
    if stall_ns + host_wait_ns <= IDLE_BOUND * step_ns:
        return "compute"
    return "host" if host_wait_ns > stall_ns else "copies"


def step_ends(compute: ComputeStream, kernels_per_step: int, steps: int) -> list[int]:
    """When each step's last kernel completed; a step runs from the previous step's end to its own."""
    return [compute.end_ns[(s + 1) * kernels_per_step - 1] for s in range(steps)]


def predict(launcher: Launcher, compute: ComputeStream, pool: DevicePool,
            kernels_per_step: int, steps: int) -> dict:
    ends = step_ends(compute, kernels_per_step, steps)
    last = steps - 1
    t0 = ends[last - 1] if last else 0
    t1 = ends[last]
    first = range(last * kernels_per_step, steps * kernels_per_step)
    compute_ns = stall_ns = host_wait_ns = 0
    busy: Intervals = []
    blocked = launcher.blocked
    b = 0
    for i in first:
        s, e = compute.start_ns[i], compute.end_ns[i]
        compute_ns += compute.run_ns[i]
        host_wait_ns += e - s - compute.run_ns[i]  # a block's kernels ran out of launches before its host was done
        prev_end = compute.end_ns[i - 1] if i else 0
        launched = compute.launched_ns[i]
        stall_ns += s - max(prev_end, launched)  # a launched kernel waits only for copies
        if launched > prev_end:
            # Idle for want of a launch: a stall where the launcher sat blocked on copies,
            # the host's wait where it was busy issuing.
            while b < len(blocked) and blocked[b][1] <= prev_end:
                b += 1
            j = b
            on_copies = 0
            while j < len(blocked) and blocked[j][0] < launched:
                on_copies += max(0, min(blocked[j][1], launched) - max(blocked[j][0], prev_end))
                j += 1
            stall_ns += on_copies
            host_wait_ns += launched - prev_end - on_copies
        busy.append((s, e))
    copying = union([(max(c.start_ns, t0), min(c.end_ns, t1)) for _, _, c in launcher.copies
                      if c.start_ns < t1 and c.end_ns > t0])
    copy_ns = sum(e - s for s, e in copying)
    hidden_ns = _intersection_ns(copying, union(busy))
    counts = launcher.step_counters(last)
    first_warm = steps - warm_steps(steps)
    warm = [(ends[i] - (ends[i - 1] if i else 0)) / NS_PER_MS for i in range(first_warm, steps)]
    h2d = [0] * steps
    for step, direction, c in launcher.copies:
        if direction == H2D:
            h2d[step] += c.nbytes
    warm_h2d = h2d[first_warm:]
    transient = transient_bytes(launcher.trace)
    # The device bytes the weights hold at most: on the vmm backend, its chunks (the conversion slack
    # included); beside them, the saved activations' own peak (the pool and torch's allocator each keep theirs).
    weights = pool.weight_peak if launcher.chunks is None else \
        max(pool.weight_peak, launcher.chunks.peak_held * launcher.chunks.granule)
    held = weights + pool.activation_peak
    capped = weights if launcher.chunks is not None else pool_cap_bytes(launcher, pool)  # the weights at the cap
    context = context_bytes(launcher.trace, launcher.hardware)
    return {
        "step_ms": (t1 - t0) / NS_PER_MS,
        "first_step_ms": ends[0] / NS_PER_MS,
        "mean_step_ms": sum(warm) / len(warm),
        "step_ms_range": [min(warm), max(warm)],
        "mean_h2d_bytes": sum(warm_h2d) / len(warm_h2d),
        "compute_ms": compute_ns / NS_PER_MS,
        "stall_ms": stall_ns / NS_PER_MS,
        # The GPU idle while the host issued (step = compute + stall + host wait), and the
        # host's own work a step: launches, hooks and fetches.
        "host_wait_ms": host_wait_ns / NS_PER_MS,
        "host_ms": launcher.host_work_ns[last] / NS_PER_MS,
        "bound_by": bound_by(t1 - t0, stall_ns, host_wait_ns),
        "overlap": hidden_ns / copy_ns if copy_ns else 1.0,
        "h2d_bytes": h2d[last],
        "d2h_bytes": sum(c.nbytes for s, d, c in launcher.copies if s == last and d == D2H),
        "peak_device_bytes": pool.peak,
        "peak_pool_torch_bytes": held + transient,
        "peak_process_bytes": held + transient + context,
        "device_bound_bytes": capped + pool.activation_peak + transient + context,
        "pool_hits": counts.pool_hits,
        "pool_misses": counts.pool_misses,
        "spilled": counts.spilled,
        "kept": counts.kept,
        "hazards": [
            {"step": h.step, "kernel": h.kernel, "weight": h.weight, "evicted_by": h.evicted_by,
             "time_ns": h.time_ns, "time_ms": h.time_ns / NS_PER_MS}
            for h in launcher.hazards
        ],
    }
