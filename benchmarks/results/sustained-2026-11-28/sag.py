"""FLUX.1-dev recorded at 4096, 16384 and again 4096 image tokens on one lease: each recording's sag
(its pipelined all-resident step over its held kernels, the recorder's compute_scale), to tell
the shape's part from the lease's."""
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import engine  # noqa: E402
from engine.modules.build import build_module, example_inputs  # noqa: E402
from engine.modules.checkpoint import module_weights  # noqa: E402
from engine.weightfile import materialize  # noqa: E402
from real_models import WORKLOADS  # noqa: E402

cfg = OmegaConf.load(ROOT / "conf" / "model" / "flux_diffusers.yaml")
module = build_module(cfg)
table = module_weights(module, cfg.name)
path = Path("/dev/shm/flux.safetensors")
materialize(table, path, seed=0, device="cuda", order=list(table.weights))
for tokens in (4096, 16384, 4096):
    shape = {**WORKLOADS["flux"], "video_tokens": tokens}
    t0 = time.perf_counter()
    trace = engine.record(module, example_inputs(cfg, module, SimpleNamespace(**shape), torch.device("cuda")),
                          checkpoint=path, name=cfg.name, workload=shape)
    h = trace.header
    held = h["step_ns"] / h["compute_scale"]
    print(f"FLUX {tokens} tokens: held {held / 1e6:.1f} ms, pipelined {h['pipelined_step_ns'] / 1e6:.1f} ms, "
          f"compute_scale {h['compute_scale']:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
path.unlink()
