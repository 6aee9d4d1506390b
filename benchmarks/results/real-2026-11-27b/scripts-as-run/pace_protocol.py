"""Does the module recorder's all-resident protocol time a GPU-bound step fast?
Plain module, every weight resident; steps synced one by one as pipelined_step_ns runs them."""
import statistics, sys, time, json
from pathlib import Path
from types import SimpleNamespace
import torch
from omegaconf import OmegaConf
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from engine.modules.build import build_module, example_inputs
from engine.modules.checkpoint import Checkpoint, module_weights
from engine.measure.probes import copy_stream_beside
from engine.weightfile import materialize
import importlib.util
spec = importlib.util.spec_from_file_location("rm", ROOT / "benchmarks" / "real_models.py")
rm = importlib.util.module_from_spec(spec); spec.loader.exec_module(rm)

out = {}
for key in sys.argv[1].split(","):
    cfg = OmegaConf.load(ROOT / "conf" / "model" / f"{rm.MODELS[key]}.yaml")
    dev = torch.device("cuda")
    module = build_module(cfg); table = module_weights(module, cfg.name)
    path = Path("/dev/shm") / f"{key}.safetensors"
    materialize(table, path, seed=0, device="cuda", order=list(table.weights))
    inputs = example_inputs(cfg, module, SimpleNamespace(**rm.WORKLOADS[key]), dev)
    with torch.no_grad(), Checkpoint(path, table) as ckpt:
        ref = build_module(cfg)
        ref.load_state_dict({n: t.to(dev) for n, t in ckpt.tensors().items()}, assign=True, strict=False)
        for name, b in list(ref.named_buffers()):
            owner = ref.get_submodule(name.rpartition(".")[0]) if "." in name else ref
            owner._buffers[name.rpartition(".")[2]] = b.to(dev)
    path.unlink()
    del module

    def step(copies=None):
        torch.cuda.synchronize()
        if copies: copies()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        with torch.no_grad():
            ref(**inputs)
        b.record(); b.synchronize()
        return a.elapsed_time(b)

    def warm(ms):
        t = 0
        while t < ms:
            t += step()
        return t
    res = {}
    step(); torch.cuda.synchronize(); time.sleep(3)
    warm(250); first = step(); copies = copy_stream_beside(round(first * 1e6), dev)
    pa, pb = [], []
    for _ in range(3):
        pa.append(step()); pb.append(step(copies))
    res["A recorder: 250ms warm, alternating alone/beside"] = (statistics.median(pa), statistics.median(pb))
    time.sleep(3)
    warm(250); res["B 250ms warm, 3 alone contiguous"] = statistics.median([step() for _ in range(3)])
    c = [step() for _ in range(20)]
    res["C contiguous, steps 11-20"] = statistics.median(c[10:])
    ea, eb = [], []
    for _ in range(3):
        ea.append(step()); eb.append(step(copies))
    res["E hot, alternating alone/beside"] = (statistics.median(ea), statistics.median(eb))
    time.sleep(3)
    warm(1000); res["D 1s warm, 3 alone contiguous"] = statistics.median([step() for _ in range(3)])
    time.sleep(3)
    warm(2000); res["F 2s warm, 3 alone contiguous"] = statistics.median([step() for _ in range(3)])
    out[key] = res
    for k, v in res.items():
        print(key, k, v, flush=True)
    del ref, inputs
    torch.cuda.empty_cache()
json.dump(out, open(sys.argv[2], "w"), indent=1)
