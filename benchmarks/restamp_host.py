"""Give recorded spec inference traces the executor's host time per kernel, and their
compute's pace under sustained load and beside copies.

    python benchmarks/restamp_host.py measure --models ltx,flux,wan14b,llama8b --out host.json  # CUDA
    python benchmarks/restamp_host.py apply host.json data/traces/full/*-full.jsonl.gz            # any CPU
    python benchmarks/restamp_host.py apply-copies host.json data/traces/full/*.jsonl.gz          # any CPU
    python benchmarks/restamp_host.py rescale data/traces/h200/ltx2-train-8blocks.jsonl.gz          # any CPU

Recordings made before the recorder timed the host kernel by kernel without events (on an
idle stream then; engine.measure.probes.HeldStreamHost now) carry the host time between CUDA
events stamped around every kernel, which adds the events' own host cost to each kernel.
`measure` writes each model's random weights (`mode=materialize`, into --dir), runs the
recorder's all-resident steps on them (`resident_steps`: the pipelined step, then each
kernel's host time as the recorder now takes it) twice,
then deletes the weight file. A lent host's pace drops for seconds at a time under
interference it does not report, and only drops, so `apply` takes the run whose pipelined
step is the shorter. `apply` puts those host times into traces of the same model and workload:
the probe's `host.kernel_ns`, each forward record's `host_ns` (its op's median, scaled to
the pipelined step where the host bounds it, as the recorder does), `pipelined_step_ns` and
`host_scale`; where the run measured them (the recorder since 2026-11-27), the pipelined
step alone and beside H2D copies (`compute_under_copy`, `compute_slowdown_under_copy`) and,
GPU-bound, `compute_sustained_slowdown` (the pipelined step over the held one); every
kernel's recorded time untouched; header `host_restamped` says from where.
Training traces are refused (the recorder times their host between stamps).

`rescale` fits a recording's host times to its own pipelined step by the recorder's present
rule (`engine.measure.timing.pipelined_scale`): recordings made before it left a GPU-bound
step's host times as stamped, even where they summed to more than the step (an 8-block LTX-2
LoRA step on the H200: 170.2 ms of host in a 150.5 ms step). Each record's `host_ns` and
`host_scale` change; `host_rescaled` says so.

`measure` also runs the recorder's copy probe once (`probes.probe_copies`: each size's copies
queued behind a held stream); `apply-copies` puts its sizes under HOST_ISSUED_BYTES into any
recorded trace (header `probes.copies`; `copies_restamped` says from where): recordings made
before the hold timed those at the host's issue rate. Their larger copies, which the host
issues faster than they run, stay as each recording measured them: machines of one kind differ
in their link, and `mode=calibrate` takes the median over the recordings.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.trace import Trace, read_trace, write_trace  # noqa: E402

WORKLOADS = {"llama8b": "decode"}
HOST_ISSUED_BYTES = 1 << 20  # copies this small ran as fast as the host issued them, unheld


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def measure(models: list[str], weight_dir: Path, out: Path) -> None:
    """Each model's host times (module docstring) into `out`, a JSON file kept across calls."""
    import torch
    from hydra import compose, initialize_config_dir

    from engine.config import register
    from engine.executor.setup import device_name, open_weight_file
    from engine.measure.clocks import clock_for
    from engine.measure.probes import probe_copies, resident_steps
    from engine.models import build_spec, make_inputs

    register()
    result = json.loads(out.read_text()) if out.exists() else {}
    # On a machine without CUDA, the cpu backend (a check of this script, not a measurement).
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = [] if device.type == "cuda" else ["weights.backend=cpu"]
    if device.type == "cuda":
        copies, duplex = probe_copies(device)
        result["copy_probe"] = {"copies": copies, "duplex": duplex, "device": device_name(device),
                                "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())}
        log("copies: " + ", ".join(f"{c['nbytes']} B {c['nbytes'] / c['ns']:.2f} GB/s"
                                   for c in copies if c["dir"] == "h2d"))
        out.write_text(json.dumps(result))
    for model in models:
        workload = WORKLOADS.get(model, "infer")
        path = weight_dir / f"host-{model}.ptd"
        try:
            log(f"{model}: materialize")
            subprocess.run([sys.executable, "-m", "engine", f"model={model}", f"workload={workload}",
                            "mode=materialize", f"out={path}", f"hydra.run.dir={out.parent / (model + '-materialize')}"],
                           check=True, cwd=ROOT)
            with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
                cfg = compose("config", overrides=[f"model={model}", f"workload={workload}", f"weights.file={path}",
                                                   "weights.lookahead=2", *backend])
            spec = build_spec(cfg.model, cfg.workload)
            clock = clock_for(device)
            runs = []
            with ExitStack() as stack:
                wf = open_weight_file(cfg, spec, stack)
                inputs = make_inputs(spec, cfg.workload, device, seed=cfg.seed)
                for _ in range(2):
                    r = resident_steps(spec, wf, inputs, cfg, clock)
                    runs.append({"pipelined_step_ns": r.step_ns, "kernel_ns": r.host_ns, "under_copy": r.under_copy})
                    beside = (f", alone / beside copies {r.under_copy[0] / 1e6:.2f} / {r.under_copy[1] / 1e6:.2f} ms"
                              if r.under_copy else "")
                    log(f"{model}: pipelined step {r.step_ns / 1e6:.2f} ms, host {sum(r.host_ns) / 1e6:.2f} ms "
                        f"over {len(r.host_ns)} kernels{beside}")
            result[model] = {"workload": workload, "device": device_name(device), "torch": torch.__version__,
                             "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
                             "kernels": [k.name for k in spec.kernels], "runs": runs}
            out.write_text(json.dumps(result))
        finally:
            path.unlink(missing_ok=True)
    print("\n| model | pipelined step ms (1st / 2nd) | host sum ms (1st / 2nd) | alone / beside copies ms |")
    print("|---|---|---|---|")
    for model, m in result.items():
        if model == "copy_probe":
            continue
        steps = " / ".join(f"{r['pipelined_step_ns'] / 1e6:.2f}" for r in m["runs"])
        host = " / ".join(f"{sum(r['kernel_ns']) / 1e6:.2f}" for r in m["runs"])
        beside = ", ".join(f"{r['under_copy'][0] / 1e6:.2f} / {r['under_copy'][1] / 1e6:.2f}"
                           for r in m["runs"] if r.get("under_copy"))
        print(f"| {model} | {steps} | {host} | {beside or '-'} |")


def restamped(trace: Trace, m: dict, source: str) -> Trace:
    """`trace` with the host times of `m` (one model's entry of a `measure` file)."""
    from engine.compute import slowdown_under_copy, sustained_slowdown
    from engine.measure.timing import host_scale, op_host_ns
    from engine.trace import host_bound
    from engine.models import available_models, build_spec, load_model_config

    h = trace.header
    forward = [r for r in trace.records if r.phase == "fwd"]
    if len(forward) != len(trace.records):
        raise SystemExit(f"{h.get('model')}: a training trace; its host times are the stamped steps', "
                         "record it again to change them")
    if [r.name for r in forward] != m["kernels"]:
        raise SystemExit(f"{h.get('model')}: the measured kernels are not the trace's; measure the trace's model "
                         "and workload")
    by_name = {load_model_config(stem).name: stem for stem in available_models()}
    cfg = asdict(load_model_config(by_name[h["model"]]))
    spec = build_spec({**cfg, "num_layers": h["num_layers"]}, SimpleNamespace(**h["workload"]))
    run = min(m["runs"], key=lambda r: r["pipelined_step_ns"])
    host = run["kernel_ns"]
    scale = host_scale(spec, SimpleNamespace(step_ns=h["step_ns"], host_ns=host, backward_host_ns=None),
                       run["pipelined_step_ns"])
    by_op = op_host_ns(spec, host)
    records = tuple(replace(r, host_ns=round(by_op[k.op] * scale)) for r, k in zip(trace.records, spec.kernels))
    probes = {**h["probes"], "host": {**h["probes"]["host"], "kernel_ns": host}}
    header = {**h, "probes": probes, "pipelined_step_ns": run["pipelined_step_ns"], "host_scale": round(scale, 6),
              "host_restamped": f"{source}: {m['device']}, {m['date']} (benchmarks/restamp_host.py)"}
    if run.get("under_copy") and not host_bound(h["step_ns"], run["pipelined_step_ns"]):
        alone, beside = run["under_copy"]  # as the recorder writes them (engine/modes/record.py)
        probes["compute_under_copy"] = {"alone_ns": alone, "with_copy_ns": beside}
        header["compute_slowdown_under_copy"] = round(slowdown_under_copy(alone, beside), 4)
        header["compute_sustained_slowdown"] = round(sustained_slowdown(h["step_ns"], run["pipelined_step_ns"]), 4)
    return Trace(header, trace.weight_sizes, records)


def apply_copies(measured: Path, paths: list[Path]) -> None:
    """The measured copy probe's small sizes into each trace's header, every other field untouched."""
    probe = json.loads(measured.read_text()).get("copy_probe")
    if probe is None:
        raise SystemExit(f"{measured}: no copy probe; run measure on a CUDA machine")
    for path in paths:
        trace = read_trace(path)
        h = trace.header
        kept = [c for c in h["probes"]["copies"] if c["nbytes"] >= HOST_ISSUED_BYTES]
        probes = {**h["probes"], "copies": [c for c in probe["copies"] if c["nbytes"] < HOST_ISSUED_BYTES] + kept}
        header = {**h, "probes": probes,
                  "copies_restamped": f"{measured.name}: {probe['device']}, {probe['date']} (benchmarks/restamp_host.py)"}
        write_trace(path, Trace(header, trace.weight_sizes, trace.records))
        print(f"{path}: copy probe from {measured.name}")


def apply(measured: Path, paths: list[Path]) -> None:
    data = json.loads(measured.read_text())
    data.pop("copy_probe", None)
    for path in paths:
        trace = read_trace(path)
        names = [r.name for r in trace.records if r.phase == "fwd"]
        entry = next((m for m in data.values() if m["kernels"] == names), None)
        if entry is None:
            print(f"{path}: no measured model has its kernels; left as it was")
            continue
        new = restamped(trace, entry, measured.name)
        write_trace(path, new)
        old_sum = sum(r.host_ns for r in trace.records) / 1e6
        print(f"{path}: host {old_sum:.2f} -> {sum(r.host_ns for r in new.records) / 1e6:.2f} ms a step, "
              f"host_scale {new.header['host_scale']}")


def rescale(paths: list[Path]) -> None:
    """Each trace's host times fitted to its pipelined step by the recorder's present rule."""
    from engine.measure.timing import host_bound, pipelined_scale

    for path in paths:
        trace = read_trace(path)
        h = trace.header
        old = float(h.get("host_scale") or 1.0)
        host = sum(r.host_ns for r in trace.records) / old
        pipelined = h.get("pipelined_step_ns")
        scale = 1.0 if pipelined is None else pipelined_scale(round(host), pipelined,
                                                              gpu_bound=not host_bound(h["step_ns"], pipelined))
        records = tuple(replace(r, host_ns=round(r.host_ns / old * scale)) for r in trace.records)
        header = {**h, "host_scale": round(scale, 6),
                  "host_rescaled": f"host_scale {old} -> {round(scale, 6)} (benchmarks/restamp_host.py rescale)"}
        write_trace(path, Trace(header, trace.weight_sizes, records))
        print(f"{path}: host {host * old / 1e6:.2f} -> {sum(r.host_ns for r in records) / 1e6:.2f} ms a step, "
              f"host_scale {old} -> {round(scale, 6)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--models", default="ltx,flux,wan14b,llama8b")
    m.add_argument("--dir", default="/dev/shm")
    m.add_argument("--out", required=True)
    for name in ("apply", "apply-copies"):
        a = sub.add_parser(name)
        a.add_argument("measured")
        a.add_argument("traces", nargs="+")
    sub.add_parser("rescale").add_argument("traces", nargs="+")
    args = ap.parse_args()
    if args.cmd == "measure":
        measure([m for m in args.models.split(",") if m], Path(args.dir), Path(args.out))
    elif args.cmd == "rescale":
        rescale([Path(p) for p in args.traces])
    elif args.cmd == "apply":
        apply(Path(args.measured), [Path(p) for p in args.traces])
    else:
        apply_copies(Path(args.measured), [Path(p) for p in args.traces])


if __name__ == "__main__":
    main()
