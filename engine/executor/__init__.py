"""The CUDA clock: streams weights through a capped pool as the residency policy decides.

    WeightExecutor   runtime.py   carries out policy decisions on a backend (a WeightSource)
    CudaBackend      cuda.py      capped cudaMemPool, copy stream, registered host memory
    CpuBackend      host.py      the same on the CPU, for tests
    offload          module.py    any torch.nn.Module
    run_execute      execute.py   mode=execute (and run_materialize for mode=materialize)
"""
from engine.executor.execute import run_execute, run_materialize
from engine.executor.module import OffloadHandle, offload
from engine.executor.runtime import WeightExecutor, make_backend
from engine.executor.sources import host_weights

__all__ = ["OffloadHandle", "WeightExecutor", "host_weights", "make_backend", "offload", "run_execute",
           "run_materialize"]
