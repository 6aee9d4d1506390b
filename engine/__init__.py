"""offload-engine: simulate, then run, GPU memory offloading (docs/DESIGN.md).

`engine.offload(module, budget_mb=..., example_inputs=...)` streams any
torch.nn.Module's weights through a capped pool; it is imported on first use,
so the CLI's planning and simulation modes never import torch.
"""
from typing import Any

__all__ = ["offload", "record"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from engine.modules import offload as api

        return getattr(api, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
