"""Why an all-resident engine.offload step of SD3.5 Large at 1024 tokens ran 90 ms against the plain
module's 55 (call 3): each forward's host time and GPU time, plain and offloaded, and a cProfile of one."""
import cProfile, io, pstats, statistics, sys, time, warnings
from pathlib import Path
from types import SimpleNamespace
import torch
from omegaconf import OmegaConf
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
import engine  # noqa: E402
from engine.modules.build import build_module, example_inputs  # noqa: E402
from engine.modules.checkpoint import load_resident, module_weights  # noqa: E402
from engine.weightfile import materialize  # noqa: E402
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack  # noqa: E402
from torch.overrides import _get_current_function_mode_stack  # noqa: E402

model = sys.argv[1] if len(sys.argv) > 1 else "sd35_large_diffusers"
tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
cfg = OmegaConf.load(ROOT / "conf" / "model" / f"{model}.yaml")
wl = SimpleNamespace(kind="infer", batch=1, video_tokens=tokens, audio_tokens=0, text_tokens=333, context_tokens=0)
dev = torch.device("cuda")
path = Path("/dev/shm/bound.safetensors")
module = build_module(cfg)
if not path.exists():
    materialize(module_weights(module, cfg.name), path, seed=0, device="cuda", order=list(module_weights(module).weights))
inputs = example_inputs(cfg, module, wl, dev)


def measure(name, fn, m):
    seen = []
    first = next(iter(m.modules()))
    blocks = [c for c in m.modules() if type(c).__name__.endswith("Block")]
    h = blocks[0].register_forward_pre_hook(lambda mod, a: seen.append(
        (len(_get_current_dispatch_mode_stack()), len(_get_current_function_mode_stack()),
         len(mod._forward_pre_hooks), len(mod._forward_hooks), torch.is_grad_enabled())))
    for _ in range(3):
        fn(); torch.cuda.synchronize()
    host, gpu = [], []
    for _ in range(8):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); t = time.perf_counter(); fn(); host.append((time.perf_counter() - t) * 1e3); b.record(); b.synchronize()
        gpu.append(a.elapsed_time(b))
    pr = cProfile.Profile(); pr.enable(); fn(); pr.disable(); torch.cuda.synchronize()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
    h.remove()
    print(f"== {name}: host {statistics.median(host):.1f} ms, synced step {statistics.median(gpu):.1f} ms; "
          f"modes/hooks at block 0 (dispatch, function, pre, post, grad): {seen[-1]}")
    print("\n".join(s.getvalue().splitlines()[:40]))


with torch.no_grad():
    ref = load_resident(build_module(cfg), path, dev)
    measure("plain", lambda: ref(**inputs), ref)
    print("param 0 of plain:", next(ref.parameters()).is_contiguous(), next(ref.parameters()).data_ptr() % 256)
    del ref
    torch.cuda.empty_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = engine.offload(module, budget_mb=None, example_inputs=inputs, eviction="priority", lookahead=2,
                                checkpoint=path)
    measure("offloaded, all resident", lambda: module(**inputs), module)
    ps = list(module.parameters())
    print("params of offloaded: contiguous", sum(p.is_contiguous() for p in ps), "/", len(ps),
          "aligned 256:", sum(p.data_ptr() % 256 == 0 for p in ps), "types", {type(p.data).__name__ for p in ps},
          "base views", sum(p.data._base is not None for p in ps))
path.unlink()
