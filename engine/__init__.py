"""offload-engine: simulate, then run, GPU memory offloading (docs/DESIGN.md).

`engine.offload(module, budget_mb=..., example_inputs=...)` streams any
torch.nn.Module's weights through a capped pool; it is imported on first use,
so the CLI's planning and simulation modes never import torch.
"""
from typing import Any

__all__ = ["offload", "record", "synthesize", "data_parallel", "replica_pool_mb"]


def __getattr__(name: str) -> Any:
    if name in ("offload", "record"):
        from engine.modules import offload as api

        return getattr(api, name)
    if name == "synthesize":
        from engine.modules.synthesize import synthesize

        return synthesize
    if name == "data_parallel":
        from engine.modules.data_parallel import data_parallel

        return data_parallel
    if name == "replica_pool_mb":
        from engine.node import replica_pool_mb

        return replica_pool_mb
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
