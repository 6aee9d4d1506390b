"""Operations per record of a spec model's step, counted on the meta device (no GPU, no weights).

    python benchmarks/launch_count.py model=llama8b workload=decode
    python benchmarks/launch_count.py model=ltx model.num_layers=8 workload=train_lora workload.video_tokens=16384

Runs the spec's own forward (and, for workload=train_lora, its LoRA backward) on meta tensors
under a dispatch mode that counts every aten operation that makes or changes data (views,
reshapes and empty allocations are not counted), and prints the count per record of the step
and the most frequent operations. benchmarks/host_lead.py measures the CUDA launches per record
of the same steps on a GPU; the two are compared in benchmarks/results/host-lead-h100-2026-11-27.md.
"""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Operations that make no new data on a GPU (no kernel): views and allocations.
NO_KERNEL = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "transpose", "t", "permute", "expand", "expand_as",
    "unsqueeze", "squeeze", "select", "slice", "alias", "as_strided", "detach", "split", "split_with_sizes",
    "unbind", "chunk", "narrow", "flatten", "unflatten", "view_as", "empty", "empty_strided", "empty_like",
    "new_empty", "new_empty_strided", "lift_fresh", "_local_scalar_dense"})


class CountOps(TorchDispatchMode):
    """Counts the aten operations dispatched inside it, by name, leaving out NO_KERNEL."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    from hydra import compose, initialize_config_dir

    from engine.config import register
    from engine.models import build_spec, forward, make_inputs
    from engine.models.lora import init_lora, lora_backward
    from engine.models.run import TORCH_DTYPES, DictSource

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=sys.argv[1:])
    spec = build_spec(cfg.model, cfg.workload)
    meta = torch.device("meta")
    weights = {n: torch.empty(w.shape, dtype=TORCH_DTYPES[w.dtype], device=meta) for n, w in spec.weights.items()}
    inputs = make_inputs(spec, cfg.workload, meta, seed=cfg.seed)
    count = CountOps()
    if cfg.workload.kind == "train_lora":
        lora = init_lora(spec, cfg.workload.lora_rank, device=meta, seed=cfg.seed + 1)
        with count:
            lora_backward(spec, DictSource(spec, weights), inputs, lora)
        records = 2 * len(spec.kernels)  # the forward's kernels and their backward mirrors
    else:
        with torch.no_grad(), count:
            forward(spec, DictSource(spec, weights), inputs)
        records = len(spec.kernels)
    total = sum(count.ops.values())
    print(f"{spec.name} {cfg.workload.name}: {total} operations over {records} records, "
          f"{total / records:.2f} a record")
    print("most frequent: " + ", ".join(f"{name} {n}" for name, n in count.ops.most_common(12)))


if __name__ == "__main__":
    main()
