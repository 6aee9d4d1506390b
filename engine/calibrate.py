"""mode=calibrate: a hardware profile fitted to recorded traces.

Every field comes from what mode=record measured (header "probes" of
each trace; with several traces, the median over them):

    h2d_gbps, d2h_gbps      pinned copies of the largest probe size, each way alone
    small_copy_mib/_gbps    H2D rate at every probe size (the simulator interpolates
                            between them; below the smallest its rate holds)
    duplex_gbps             bytes of one copy each way, started together, over the time
                            until both landed (the simulator's fair share gives that total)
    mmap_registered_gbps    the pinned large-copy rate (h2d_gbps): a registered file's
                            pages are pinned and DMA alike; the streamed forward's weight
                            copies of 64 MiB or more from the registered file only where
                            they ran faster (the recorder waits on each copy, so they read
                            low against a streamed step's back-to-back copies)
    alloc_us                median host time of one pool allocation
    fetch_host_us           least squares over a streamed forward's fetches: host ns =
                            a + b x (copies issued); b is fetch + allocation, so
                            fetch_host_us = b - alloc_us
    kernel_launch_us        mean host time per kernel of the resident step (kernels over
                            BLOCKED x the median dropped: the host sat on a full launch
                            queue behind the held stream), plus the
                            streamed fetch's fixed part a beyond a resident fetch
    compute_slowdown_under_copy   the recorded step beside a stream of H2D copies over
                            its time alone, minus 1 (never below 0)
    compute_sustained_slowdown    median of the GPU-bound inference recordings' own (header
                            "compute_sustained_slowdown": the pipelined step over the held one,
                            minus 1; training recordings made before the recorder left it out
                            carry a meaningless one); the base profile's where none has it
    matmul_tflops, hbm_gbps achieved rates of the recorded kernels: FLOPs over time of
                            compute-bound records (>= RIDGE FLOP/byte), bytes over time of
                            weightless memory-bound ones (the roofline, for kernels without a shape)
    kernel_table            kernel times by op and shape, fitted to the recorded kernels, the
                            probe grids and (--modules) real modules' recordings
                            (engine/calibrate_kernels.py); written beside the profile as
                            NAME.kernels.json

Fields no recording measures (pageable and unregistered-mmap rates, device memory,
launch queue depth, the activation offloader's hook costs, which mode=validate's training
rows measure, the sustained-load window) are the base profile's, and the `source` line says so.
"""
from __future__ import annotations

import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Sequence

from engine.calibrate_kernels import is_training, probe_file_device, probe_median, read_probe_file, write_kernel_table
from engine.compute import BLOCKED, slowdown_under_copy
from engine.config import HardwareConfig
from engine.errors import ConfigError, TraceError
from engine.trace import Trace, read_trace
from engine.units import MIB

RIDGE = 100.0  # FLOP per byte above which a kernel counts as compute-bound
LARGE_COPY = 64 * MIB
FITTED = ("h2d_gbps", "d2h_gbps", "duplex_gbps", "small_copy_mib", "small_copy_gbps", "mmap_registered_gbps",
          "alloc_us", "fetch_host_us", "kernel_launch_us", "compute_slowdown_under_copy",
          "compute_sustained_slowdown", "matmul_tflops", "hbm_gbps", "kernel_table", "vmm_granule_bytes",
          "vmm_map_us", "vmm_unmap_us", "vmm_create_us", "vmm_release_us")
PROFILE_FIELDS = ("name", "source", "device", "device_memory_mb", "h2d_gbps", "d2h_gbps", "duplex_gbps", "pageable_gbps",
                  "mmap_gbps", "mmap_registered_gbps", "small_copy_mib", "small_copy_gbps", "matmul_tflops",
                  "hbm_gbps", "kernel_table", "kernel_launch_us", "fetch_host_us", "alloc_us", "launch_queue_depth",
                  "offload_kernel_us", "pack_hook_us", "unpack_hook_us", "compute_slowdown_under_copy",
                  "compute_sustained_slowdown", "sustained_window_ms",
                  "context_mb", "vmm_granule_bytes", "vmm_map_us",
                  "vmm_unmap_us", "vmm_create_us", "vmm_release_us")


def _probes(trace: Trace, where: str) -> dict:
    probes = trace.header.get("probes")
    if not isinstance(probes, dict):
        raise TraceError(f"{where}: the header has no \"probes\"; calibrate needs a trace recorded on the GPU "
                         "with mode=record (a synthesized trace measures nothing)")
    for key in ("copies", "duplex", "alloc_ns", "host", "compute_under_copy"):
        if key not in probes:
            raise TraceError(f"{where}: header probes lack {key!r}; re-record the trace with mode=record on a GPU")
    return probes


def copy_rates(all_copies: Sequence[Sequence[dict]], direction: str) -> dict[int, float]:
    """GB/s (bytes per ns) by copy size, median over traces."""
    by_size: dict[int, list[float]] = {}
    for copies in all_copies:
        for c in copies:
            if c["dir"] == direction and c["ns"] > 0:
                by_size.setdefault(int(c["nbytes"]), []).append(c["nbytes"] / c["ns"])
    if not by_size:
        raise TraceError(f"calibrate: no {direction} copy probes; re-record the trace with mode=record on a GPU")
    return {size: probe_median(v) for size, v in sorted(by_size.items())}


def fit_fetch_cost(samples: Sequence[Sequence[int]]) -> tuple[float, float]:
    """Least squares of host ns = a + b * copies over [copies, host ns] samples: (a, b)."""
    n = len(samples)
    if n < 2:
        return 0.0, 0.0
    xs = [float(s[0]) for s in samples]
    ys = [float(s[1]) for s in samples]
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return my, 0.0
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def launch_mean(kernel_ns: Sequence[int]) -> float:
    """Mean host ns per kernel, without the kernels where the host sat blocked on a
    full launch queue (over BLOCKED x the median: the recorder holds the stream)."""
    cut = BLOCKED * statistics.median(kernel_ns)
    return statistics.fmean(ns for ns in kernel_ns if ns <= cut)


def achieved_rates(traces: Sequence[Trace]) -> tuple[float | None, float | None]:
    """(matmul TFLOP/s, HBM GB/s) of the recorded forward kernels."""
    flops = flop_ns = io = io_ns = 0
    for t in traces:
        for r in t.records:
            if r.phase != "fwd" or r.compute_ns <= 0:
                continue
            if r.io_bytes and r.flops / r.io_bytes >= RIDGE:
                flops += r.flops
                flop_ns += r.compute_ns
            elif r.flops == 0 and r.io_bytes and not r.weights:
                io += r.io_bytes
                io_ns += r.compute_ns
    return (flops / flop_ns / 1e3 if flop_ns else None), (io / io_ns if io_ns else None)


def distinct_names(paths: Sequence[Path]) -> list[str]:
    """Each path by its file name, with as many of its folders before it as tell it apart
    from the others (two recordings both named flux-full.jsonl.gz: full/..., h200/...)."""
    depth = [1] * len(paths)
    while True:
        names = ["/".join(Path(q).parts[-d:]) for q, d in zip(paths, depth)]
        clashes = {n for n in names if names.count(n) > 1}
        grow = [i for i, n in enumerate(names) if n in clashes and depth[i] < len(Path(paths[i]).parts)]
        if not grow:
            return names
        for i in grow:
            depth[i] += 1


def add_module_costs_source(profile: dict, names: Sequence[str]) -> None:
    """Say in the profile's source which real modules' recordings its module costs come from."""
    if names:
        profile["source"] += f"; module costs from {', '.join(names)}"


def one_device(devices: Iterable[tuple[str, Any]]) -> str | None:
    """The one GPU that recorded every source ((name, its header's "device"), the device None
    where it does not say); TraceError when they name more than one: a profile describes one GPU."""
    named: dict[str, list[str]] = {}
    for where, device in devices:
        if device is not None:
            named.setdefault(str(device), []).append(where)
    if len(named) > 1:
        seen = "; ".join(f"{d}: {', '.join(w[:3])}{' ...' if len(w) > 3 else ''}" for d, w in named.items())
        raise TraceError(f"calibrate was given recordings of {len(named)} GPUs ({seen}); a profile describes one "
                         "GPU: pass only the recordings and probe files made on the GPU it is for")
    return next(iter(named), None)


def fit_profile(traces: Sequence[Trace], base: Any, name: str, names: Sequence[str] = ()) -> dict:
    """A full hardware profile: the fitted fields from `traces`, the rest from `base`."""
    if not traces:
        raise TraceError("calibrate needs at least one recorded trace")
    names = [names[i] if i < len(names) else f"trace {i}" for i in range(len(traces))]
    device = one_device((n, t.header.get("device")) for n, t in zip(names, traces))
    probes = [_probes(t, n) for t, n in zip(traces, names)]
    h2d = copy_rates([p["copies"] for p in probes], "h2d")
    d2h = copy_rates([p["copies"] for p in probes], "d2h")
    largest = max(h2d)
    h2d_gbps = h2d[largest]
    duplex = probe_median(d["h2d_bytes"] / d["ns"] + d["d2h_bytes"] / d["ns"] for p in probes for d in p["duplex"])
    alloc_us = probe_median(ns for p in probes for ns in p["alloc_ns"]) / 1e3
    a, b = fit_fetch_cost([s for p in probes for s in p["host"]["fetch"]])
    resident_fetch = probe_median(p["host"]["resident_fetch_ns"] for p in probes)
    launch_ns = probe_median(launch_mean(p["host"]["kernel_ns"]) for p in probes) + max(0.0, a - resident_fetch)
    slowdown = probe_median(slowdown_under_copy(p["compute_under_copy"]["alone_ns"], p["compute_under_copy"]["with_copy_ns"])
                    for p in probes)
    registered = [c for t, p in zip(traces, probes) if p.get("weight_source") == "mmap_registered"
                  for r in t.records for c in r.copies if c.get("nbytes", 0) >= LARGE_COPY and c.get("ns", 0) > 0]
    tflops, hbm = achieved_rates(traces)
    profile = {f: _base(base, f) for f in PROFILE_FIELDS}
    profile.update(
        name=name,
        h2d_gbps=round(h2d_gbps, 3),
        d2h_gbps=round(d2h[max(d2h)], 3),
        duplex_gbps=round(duplex, 3),
        small_copy_mib=[round(s / MIB, 6) for s in h2d],
        small_copy_gbps=[round(r, 3) for r in h2d.values()],
        alloc_us=round(alloc_us, 3),
        fetch_host_us=round(max(0.0, b / 1e3 - alloc_us), 3),
        kernel_launch_us=round(launch_ns / 1e3, 3),
        compute_slowdown_under_copy=round(slowdown, 4),
    )
    sustained = [float(t.header["compute_sustained_slowdown"]) for t in traces
                 if "compute_sustained_slowdown" in t.header and not is_training(t)]
    if sustained:
        profile["compute_sustained_slowdown"] = round(probe_median(sustained), 4)
    profile["mmap_registered_gbps"] = round(h2d_gbps, 3)
    if registered:
        profile["mmap_registered_gbps"] = max(profile["mmap_registered_gbps"], round(
            sum(c["nbytes"] for c in registered) / sum(c["ns"] for c in registered), 3))
    vmm = [p["vmm"] for p in probes if "vmm" in p]  # traces recorded before the vmm backend lack it
    if vmm:
        profile["vmm_granule_bytes"] = vmm[0]["granule"]
        profile["vmm_map_us"] = round(probe_median(v["map_ns"] for v in vmm) / 1e3, 3)
        for call in ("unmap", "create", "release"):
            profile[f"vmm_{call}_us"] = round(probe_median(v[f"{call}_ns"] for v in vmm if f"{call}_ns" in v) / 1e3, 3) \
                if any(f"{call}_ns" in v for v in vmm) else _base(base, f"vmm_{call}_us")
    if tflops:
        profile["matmul_tflops"] = round(tflops, 1)
    if hbm:
        profile["hbm_gbps"] = round(hbm, 1)
    profile["device"] = device
    memory = [int(t.header["device_memory_mb"]) for t in traces if t.header.get("device_memory_mb")]
    if memory:  # recordings made before the header carried it leave it to the base profile
        profile["device_memory_mb"] = min(memory)
    dates = sorted(str(t.header.get("date")) for t in traces)
    profile["source"] = (f"calibrated {datetime.now(timezone.utc).date()} by mode=calibrate from "
                         f"{len(traces)} recorded trace(s) ({', '.join(names)}; {device}, "
                         f"recorded {dates[0]}..{dates[-1]}); fitted: {', '.join(FITTED)}"
                         f"{', device_memory_mb' if memory else ''}; pageable_gbps, mmap_gbps, "
                         f"{'' if memory else 'device_memory_mb, '}launch_queue_depth, the offloader hook costs "
                         f"and sustained_window_ms from {_base(base, 'name')}")
    return profile


def _base(base: Any, field: str) -> Any:
    if isinstance(base, dict):  # a profile file may leave a field to the schema's default
        value = base[field] if field in base else getattr(HardwareConfig, field)
    else:
        value = getattr(base, field)
    if hasattr(value, "__iter__") and not isinstance(value, str):
        return list(value)
    return value


def profile_yaml(profile: dict) -> str:
    """The profile as a conf/hardware/*.yaml file (`hardware=NAME` once it is there)."""
    import yaml

    head = (f"# {profile['name']}: written by `python -m engine mode=calibrate`; see engine/calibrate.py\n"
            "# for how each field is fitted. Pass it as hardware=" + profile["name"] + ".\n"
            "defaults:\n  - /hardware_schema@_here_\n  - _self_\n")
    body = {f: profile[f] for f in PROFILE_FIELDS}
    return head + yaml.safe_dump(body, sort_keys=False, width=120)


def trace_paths(paths: Sequence[str | Path]) -> list[Path]:
    """Trace files from files and directories (every *.jsonl / *.jsonl.gz in a directory)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.name.endswith((".jsonl", ".jsonl.gz")))
            if not found:
                raise TraceError(f"{p}: no *.jsonl or *.jsonl.gz traces in this directory; record some with "
                                 "mode=record")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise TraceError(f"{p}: no such trace file or directory; record one with mode=record")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """python -m engine.calibrate TRACE_OR_DIR... --out FILE.yaml: calibrate from several traces."""
    import sys

    from engine.cli_errors import OneLineParser

    p = OneLineParser(prog="python -m engine.calibrate", description=main.__doc__)
    p.add_argument("traces", nargs="+", help="recorded traces, or directories of them")
    p.add_argument("--out", required=True, type=Path, help="the profile to write, e.g. conf/hardware/x.yaml")
    p.add_argument("--base", default="h100_pcie5", help="profile in conf/hardware for the fields not measured")
    p.add_argument("--probes", action="append", default=[], type=Path,
                   help="a compute probe file (python -m engine.measure.compute --out FILE) for the kernel table; "
                        "repeatable")
    p.add_argument("--modules", action="append", default=[],
                   help="recordings of real modules (files or directories) whose op census prices a real "
                        "module's blocks beside their cores in the kernel table; repeatable")
    args = p.parse_args(argv)
    try:
        paths = trace_paths(args.traces)
        traces = [read_trace(q) for q in paths]
        probes = [read_probe_file(q) for q in args.probes]
        module_paths = trace_paths(args.modules) if args.modules else []
        modules = [read_trace(q) for q in module_paths]
        sources = [*paths, *module_paths, *args.probes]
        names = distinct_names(sources)
        one_device(zip(names, [*(t.header.get("device") for t in [*traces, *modules]),
                               *(probe_file_device(q) for q in args.probes)]))
        base = base_profile(args.base)
        profile = fit_profile(traces, base, args.out.name.split(".")[0], names[:len(paths)])
    except (TraceError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    if args.probes:
        profile["source"] += f"; kernel table also from {', '.join(q.name for q in args.probes)}"
    add_module_costs_source(profile, [q.name for q in module_paths])
    try:
        write_kernel_table(profile, traces, args.out, probes, modules)
    except TraceError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    args.out.write_text(profile_yaml(profile))
    print(f"wrote {args.out} from {len(paths)} trace(s)" + (f" and {len(probes)} probe file(s)" if probes else ""))
    given = {q.resolve() for q in args.probes}
    unused = [q for d in map(Path, args.traces) if d.is_dir() for q in sorted(d.glob("probes-*.json"))
              if q.resolve() not in given]
    if unused:
        print(f"note: {', '.join(str(q) for q in unused)} beside the traces not taken (a probe file counts only "
              "with --probes FILE)", file=sys.stderr)


def base_profile(name: str) -> dict:
    """A shipped hardware profile (conf/hardware/NAME.yaml) as the plain dict calibrate fits
    over (engine.config.load_hardware gives the composed DictConfig a run uses)."""
    from importlib.resources import files

    import yaml

    path = files("conf").joinpath("hardware").joinpath(f"{name}.yaml")
    if not path.is_file():
        raise ConfigError(f"hardware profile {name!r} is not in conf/hardware; pick one of those")
    data = yaml.safe_load(path.read_text())
    data.pop("defaults", None)
    return data


if __name__ == "__main__":
    main()
