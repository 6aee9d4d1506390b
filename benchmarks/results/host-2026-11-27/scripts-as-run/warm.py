import statistics, subprocess, sys, time
from contextlib import ExitStack
from pathlib import Path
import torch
from hydra import compose, initialize_config_dir
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from engine.config import register
from engine.executor.setup import open_weight_file, forward_order, streamed_executor
from engine.models import make_inputs, forward, build_spec
from engine.measure.clocks import CudaClock
from engine.measure.probes import IdleStreamHost
path = "/dev/shm/warm.ptd"
try:
    subprocess.run([sys.executable, "-m", "engine", "model=llama8b", "workload=decode", "mode=materialize",
                    f"out={path}", "hydra.run.dir=/tmp/mat"], check=True, capture_output=True)
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["model=llama8b", "workload=decode", f"weights.file={path}"])
    spec = build_spec(cfg.model, cfg.workload)
    dev = torch.device("cuda"); clock = CudaClock(dev)
    with ExitStack() as st:
        wf = open_weight_file(cfg, spec, st)
        inputs = make_inputs(spec, cfg.workload, dev, seed=cfg.seed)
        ex = streamed_executor(st, wf, forward_order(spec), backend="cuda", source=cfg.weights.source,
                               budget_bytes=None, eviction="priority", lookahead=1, relocate=True)
        def run(secs, label):
            t0 = time.perf_counter(); stamps = []
            while time.perf_counter() - t0 < secs:
                s = clock.stamp()
                with torch.no_grad(), ex.step(): forward(spec, ex, inputs)
                stamps.append((time.perf_counter() - t0, s, clock.stamp()))
            clock.synchronize()
            win = {}
            for t, s, e in stamps: win.setdefault(int(t / 0.5), []).append(clock.ns(s, e) / 1e6)
            print(label, " ".join(f"{statistics.median(v):.1f}" for k, v in sorted(win.items())), flush=True)
        run(1, "cold 1s:")
        time.sleep(2); run(4, "after 2s idle, 0.5s windows:")
        for _ in range(10):
            idle = IdleStreamHost(ex, clock)
            with torch.no_grad(), ex.step(): forward(spec, idle, inputs)
            idle.host_ns()
        run(4, "after 10 idle-stream forwards:")
        for _ in range(10):
            torch.cuda._sleep(200_000_000); torch.cuda.synchronize()
        run(4, "after 10 x 100ms GPU waits:")
        run(4, "again:")
finally:
    Path(path).unlink(missing_ok=True)
