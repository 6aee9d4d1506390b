import sys, time, statistics
from pathlib import Path
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import torch
from executor_bench import WORKLOAD, access_order, ltx_spec
from engine.executor import WeightExecutor, host_weights, make_backend
from engine.executor.cuda import CudaBackend
from engine.models import forward, make_inputs
from engine.weightfile import WeightFile, materialize

spec = ltx_spec("ltx", 8); order = access_order(spec)
path = Path("/dev/shm/ltx8exp.ptd")
if not path.exists(): materialize(spec, path, seed=0, device="cuda")
inputs = make_inputs(spec, WORKLOAD, device="cuda", seed=1)
wf = WeightFile(path, spec)
orig_free = CudaBackend.free_after
def old_free(self, block, mark):  # the pre-FreeBlocks behaviour: every free goes back to the pool
    orig_free(self, block, mark); self.trim()
for variant in ("kept", "no-keep"):
    CudaBackend.free_after = orig_free if variant == "kept" else old_free
    for budget_mb in (2403, 4120):
        for ev in ("lru", "belady", "priority"):
            backend = make_backend("cuda", budget_mb * 10**6, max(order.sizes.values()))
            host = host_weights(wf, "mmap_registered", backend)
            ex = WeightExecutor(order, host.tensors, budget_bytes=budget_mb * 10**6, eviction=ev, lookahead=1, backend=backend)
            try:
                with torch.no_grad():
                    for _ in range(8):
                        with ex.step():
                            forward(spec, ex, inputs)
                tele = ex.telemetry()
                print(variant, budget_mb, ev, "ms", [round(t["step_ms"]) for t in tele], "reloc", [t["relocations"] for t in tele], flush=True)
            except Exception as e:
                print(variant, budget_mb, ev, "FAILED", str(e)[:150], flush=True)
            finally:
                ex.close(); host.close(); backend.close()
