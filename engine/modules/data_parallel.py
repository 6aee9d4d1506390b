"""Data-parallel training of an offloaded module: one replica per GPU of a node.

    torch.distributed.init_process_group("nccl")      # torchrun starts one process per GPU
    share = engine.replica_pool_mb(NODE_PINNED_MB, checkpoint_bytes, world_size)
    h = engine.offload(model, budget_mb=16000, example_inputs=batch, training=True, checkpoint=ckpt,
                       activations={"mode": "sync", "num_offload_layers": 2, "pool": {"max_mb": share}})
    ddp = engine.data_parallel(model)
    with h.step():
        loss_fn(ddp(**batch)).backward()            # the adapters' gradients averaged over the replicas
    optimizer.step()

Every replica maps the same checkpoint, so the page cache holds one copy for the
node. DistributedDataParallel would broadcast every parameter and buffer from rank
0 when it starts, but a streamed parameter is a placeholder (engine/modules/hooks.py)
whose bytes live in the checkpoint every replica already maps: only the trainable
parameters, which each replica may have initialised differently, are broadcast
here; DDP then starts without its own broadcast and averages the trainable
parameters' gradients in backward, as it always does.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from engine.errors import ConfigError


def data_parallel(module: nn.Module, **ddp_kwargs: Any) -> DistributedDataParallel:
    """`module` (offloaded with training=True, or not offloaded) wrapped in DDP, its
    trainable parameters first made rank 0's. `ddp_kwargs` go to DDP (device_ids
    defaults to the module's device on CUDA)."""
    if not dist.is_available() or not dist.is_initialized():
        raise ConfigError("engine.data_parallel needs torch.distributed: start one process per GPU with torchrun "
                          "and call torch.distributed.init_process_group() first")
    trainable = [p for p in module.parameters() if p.requires_grad]
    if not trainable:
        raise ConfigError(f"this {type(module).__name__} has no trainable parameters to train data-parallel; add "
                          "the adapters (peft get_peft_model) first")
    for key in ("init_sync", "broadcast_buffers", "forward_sync_buffers"):
        if ddp_kwargs.get(key):
            raise ConfigError(f"data_parallel({key}=True) would broadcast the streamed placeholders; every replica "
                              "maps the same checkpoint, so drop it")
    with torch.no_grad():
        for p in trainable:
            dist.broadcast(p.data, src=0)
    device = trainable[0].device
    if device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [device.index if device.index is not None else
                                              torch.cuda.current_device()])
    # No buffer broadcast in forward (torch >= 2.13 names it forward_sync_buffers).
    quiet = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters \
        else "broadcast_buffers"
    return DistributedDataParallel(module, init_sync=False, **{quiet: False}, **ddp_kwargs)
