"""The CUDA clock: streams weights through a capped pool as the residency policy decides.

    WeightExecutor   runtime.py   carries out policy decisions on a backend (a WeightSource)
    CudaBackend      cuda.py      capped cudaMemPool, copy stream, registered host memory
    CpuBackend       cpu.py       the same on the CPU, for tests
    host_weights     sources.py   where the host copy of each weight lives
    setup            setup.py     device, weight file, backend -> host weights -> executor, measurements
    training         training.py  LoRA training steps over streamed weights

Real torch modules (engine.offload, engine.record) live in engine/modules/; the modes that run it (execute, materialize, record, validate) live in engine/modes/.
"""
from engine.executor.runtime import WeightExecutor, make_backend
from engine.executor.sources import host_weights

__all__ = ["WeightExecutor", "host_weights", "make_backend"]
