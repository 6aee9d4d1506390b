"""Host time per op: the recorder (held stream) vs free-running vs the executor's step."""
import os, statistics, subprocess, sys, time
from contextlib import ExitStack
from pathlib import Path
import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from engine.config import register
from engine.executor.setup import open_weight_file, forward_order, streamed_executor
from engine.models import make_inputs, forward
from engine.models.run import DictSource
from engine.models import build_spec
from engine.measure.clocks import CudaClock, CpuClock
CUDA = torch.cuda.is_available()
class Ev:
    def __init__(self): self.t = None
    def record(self): self.t = time.perf_counter_ns()
    def synchronize(self): pass
    def elapsed_time(self, o): return (o.t - self.t) / 1e6
def event(): return torch.cuda.Event(enable_timing=True) if CUDA else Ev()
def sync():
    if CUDA: torch.cuda.synchronize()
def sleep(ns):
    if CUDA: torch.cuda._sleep(int(ns * 2))

from engine.measure import timing as T
from engine.measure.probes import pipelined_step_ns
from engine.compute import medians_by_op

class NoHold(CudaClock if CUDA else CpuClock):
    def hold(self, ns): pass

class HostStamps:
    def __init__(self, src): self.src, self.t = src, []
    def fetch(self, i):
        self.t.append(time.perf_counter_ns()); return self.src.fetch(i)
    def __getattr__(self, n): return getattr(self.src, n)

def per_op(spec, host):
    return medians_by_op((k.op, ns) for k, ns in zip(spec.kernels, host))

def run(model, workload, path):
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"model={model}", f"workload={workload}", f"weights.file={path}", "weights.lookahead=2"] + ([] if CUDA else ["weights.backend=cpu"]))
    spec = build_spec(cfg.model, cfg.workload)
    dev = torch.device("cuda" if CUDA else "cpu"); clock = CudaClock(dev) if CUDA else CpuClock()
    rows = {}
    with ExitStack() as stack:
        wf = open_weight_file(cfg, spec, stack)
        weights = {n: t.to(dev, copy=True) for n, t in wf.tensors().items()}
        inputs = make_inputs(spec, cfg.workload, dev, seed=cfg.seed)
        src = DictSource(spec, weights)
        a = T.time_steps(spec, src, inputs, clock)
        rows["recorder (held)"] = (per_op(spec, a.host_ns), sum(a.host_ns), a.step_ns); print(rows, flush=True)
        b = T.time_steps(spec, src, inputs, NoHold(dev) if CUDA else NoHold())
        rows["stamps, no hold"] = (per_op(spec, b.host_ns), sum(b.host_ns), b.step_ns)
        # plain spec forward, free-running, host stamps only
        def free(source, n=20, hold=0):
            out = []
            for s in range(n + 3):
                sync()
                if hold: sleep(hold)
                hs = HostStamps(source)
                e0 = event(); e0.record()
                t0 = time.perf_counter_ns()
                with torch.no_grad():
                    forward(spec, hs, inputs)
                t1 = time.perf_counter_ns()
                e1 = event(); e1.record(); e1.synchronize()
                if s >= 3: out.append((hs.t[1:] + [t1], hs.t, e0.elapsed_time(e1) * 1e6, t1 - t0))
            host = [round(statistics.median(col)) for col in zip(*[[b - a for a, b in zip(o[1], o[0])] for o in out])]
            return per_op(spec, host), sum(host), statistics.median(o[2] for o in out), statistics.median(o[3] for o in out)
        p = free(src); rows["plain free"] = (p[0], p[1], p[2]); print("plain free host-wall ms", p[3] / 1e6)
        p = free(src, hold=200_000_000); rows["plain held 200ms"] = (p[0], p[1], p[2]); print("plain held host-wall ms", p[3] / 1e6)
        del weights, src
        if CUDA: torch.cuda.empty_cache()
        pip = pipelined_step_ns(spec, wf, inputs, cfg, clock)
        print("executor pipelined step ms", pip / 1e6)
        order = forward_order(spec)
        with ExitStack() as s2:
            ex = streamed_executor(s2, wf, order, backend=cfg.weights.backend, source=cfg.weights.source,
                                   budget_bytes=None, eviction="priority", lookahead=cfg.weights.lookahead, relocate=True)
            def exe(n=20, hold=0):
                out = []
                for s in range(n + 5):
                    sync()
                    if hold: sleep(hold)
                    hs = HostStamps(ex)
                    e0 = event(); e0.record()
                    t0 = time.perf_counter_ns()
                    with torch.no_grad(), ex.step():
                        forward(spec, hs, inputs)
                    t1 = time.perf_counter_ns()
                    e1 = event(); e1.record(); e1.synchronize()
                    if s >= 5: out.append((hs.t[1:] + [t1], hs.t, e0.elapsed_time(e1) * 1e6, t1 - t0))
                host = [round(statistics.median(col)) for col in zip(*[[b - a for a, b in zip(o[1], o[0])] for o in out])]
                return per_op(spec, host), sum(host), statistics.median(o[2] for o in out), statistics.median(o[3] for o in out)
            p = exe(); rows["executor free"] = (p[0], p[1], p[2]); print("executor free host-wall ms", p[3] / 1e6)
            p = exe(hold=300_000_000); rows["executor held 300ms"] = (p[0], p[1], p[2]); print("executor held host-wall ms", p[3] / 1e6)
    ops = sorted({o for r in rows.values() for o in r[0]})
    print(f"\n## {model} ({len(spec.kernels)} kernels): host us per kernel, op medians; host sum and GPU step ms")
    print("| measurement | " + " | ".join(ops) + " | host sum ms | step ms |")
    for name, (op, tot, step) in rows.items():
        print(f"| {name} | " + " | ".join(f"{op.get(o, 0)/1e3:.1f}" for o in ops) + f" | {tot/1e6:.2f} | {step/1e6:.2f} |")

if __name__ == "__main__":
    model, workload = sys.argv[1], sys.argv[2]
    path = f"/dev/shm/diag-{model}.ptd"
    try:
        subprocess.run([sys.executable, "-m", "engine", f"model={model}", f"workload={workload}", "mode=materialize",
                        f"out={path}", "hydra.run.dir=/tmp/mat-" + model], check=True, capture_output=True)
        run(model, workload, path)
    finally:
        Path(path).unlink(missing_ok=True)
