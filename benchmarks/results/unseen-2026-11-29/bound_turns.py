"""Is the all-resident engine.offload of a host-bound decode slower than the plain module, or does
the host's pace move under both? Mistral-7B decode (4096-token KV cache) in one process: the plain
module (loaded from the checkpoint) and the same weights through engine.offload(budget_mb=None,
eviction="priority": no recording, so no launch census), timed in alternating turns of 20 synced
steps; then one launch census (engine.measure.launches.Census around a plain step) and more turns.
With `auto` (argument 1) the offload takes the default path instead: eviction="auto" records the
module (its launch census, its all-resident and held steps) and picks by simulation. Prints each
turn's median step (ms, perf_counter around the call and a device sync)."""
import statistics
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
import engine  # noqa: E402
from engine.measure.launches import Census  # noqa: E402
from engine.modules.build import build_module, example_inputs  # noqa: E402
from engine.modules.checkpoint import load_resident, module_weights  # noqa: E402
from engine.weightfile import materialize  # noqa: E402

cfg = OmegaConf.load(ROOT / "conf" / "model" / "mistral7b_hf.yaml")
wl = SimpleNamespace(kind="decode", batch=1, video_tokens=0, audio_tokens=0, text_tokens=0, context_tokens=4096)
dev = torch.device("cuda")
path = Path("/dev/shm/turns.safetensors")
module = build_module(cfg)
table = module_weights(module, cfg.name)
materialize(table, path, seed=0, device="cuda", order=list(table.weights))
inputs = example_inputs(cfg, module, wl, dev)


def turn(fn, n: int = 20) -> float:
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


with torch.no_grad():
    plain = load_resident(build_module(cfg), path, dev)
    run_plain = lambda: plain(**inputs)  # noqa: E731
    turn(run_plain, 10)
    print(f"plain alone: {turn(run_plain):.2f} / {turn(run_plain):.2f} ms", flush=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        auto = sys.argv[1:] == ["auto"]
        handle = engine.offload(module, budget_mb=None, example_inputs=inputs, checkpoint=path,
                                **({"hardware": "h200"} if auto else {"eviction": "priority", "lookahead": 2}))
    run_ours = lambda: module(**inputs)  # noqa: E731
    turn(run_ours, 10)
    for i in range(4):
        print(f"turn {i}: plain {turn(run_plain):.2f} ms, offloaded (bound={handle.bound}) {turn(run_ours):.2f} ms",
              flush=True)
    with Census(True) as census:
        census.mark(0)
        plain(**inputs)
    print(f"a launch census ({sum(census.counts.values())} launches)", flush=True)
    for i in range(4):
        print(f"turn {i}: plain {turn(run_plain):.2f} ms, offloaded {turn(run_ours):.2f} ms", flush=True)
    handle.remove()
path.unlink()
