"""engine.data_parallel on the CPU: two replicas (gloo), each streaming its frozen weights
and spilling its activations under a share of the node's pinned budget; the averaged
gradients equal one process's over the same global batch, bitwise."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import engine
from engine.errors import ConfigError
from test_modules_training import make

ACT = {"mode": "sync", "num_offload_layers": 2, "min_tensor_bytes": 4096}
STEPS = 3
X = torch.randn(2, 128, 64, generator=torch.Generator().manual_seed(1))  # the same in every process


def global_batch_reference() -> dict:
    """One process, no offload: the two micro-batches' mean loss, accumulated."""
    net = make()
    for r in range(2):
        (net(X[r:r + 1]).pow(2).mean() / 2).backward()
    return {n: p.grad for n, p in net.named_parameters() if p.requires_grad}


def replica(rank: int, init: str, out: dict) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        net = make()
        with torch.no_grad():  # rank 1's adapters start elsewhere: data_parallel makes them rank 0's
            for p in net.parameters():
                if p.requires_grad:
                    p.add_(rank)
        block = sum(p.numel() * 4 for p in net.blocks[0].parameters() if not p.requires_grad)
        h = engine.offload(net, budget_mb=3 * block / 1e6, training=True, backend="cpu", example_inputs=(X,),
                           activations={**ACT, "pool": {"max_mb": 0.05}})
        ddp = engine.data_parallel(net)
        for _ in range(STEPS):
            for p in net.parameters():
                p.grad = None
            with h.step():
                ddp(X[rank:rank + 1]).pow(2).mean().backward()
        out[rank] = {"grads": {n: p.grad.clone() for n, p in net.named_parameters() if p.requires_grad},
                     "rows": h.telemetry(), "pool_bytes": h._offloader.slabs.nbytes}
        h.remove()
    finally:
        dist.destroy_process_group()


def test_two_replicas_average_the_global_batch_gradients_bitwise(tmp_path):
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        init = f"file://{tmp_path / 'rendezvous'}"
        procs = [ctx.Process(target=replica, args=(r, init, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0, 0]
        out = dict(out)
    ref = global_batch_reference()
    for rank in range(2):
        grads = out[rank]["grads"]
        assert grads.keys() == ref.keys()
        assert all(torch.equal(grads[k], ref[k]) for k in ref), rank
        rows = out[rank]["rows"]
        assert rows[-1]["weight_h2d_bytes"] > 0  # the frozen weights streamed
        assert rows[-1]["pool_misses"] > 0 and rows[-1]["pool_hits"] > 0  # the cap cut the exact pool
        assert out[rank]["pool_bytes"] <= 0.05e6 * 1.05  # slabs start on page boundaries


def test_data_parallel_needs_torch_distributed():
    with pytest.raises(ConfigError, match="start one process per GPU with torchrun"):
        engine.data_parallel(make())


def test_replica_pool_share_of_the_node_budget():
    assert engine.replica_pool_mb(10_000, 4_000_000_000, 2) == pytest.approx(3000.0)
    with pytest.raises(ConfigError, match="leaves no pinned memory for the activation pools"):
        engine.replica_pool_mb(1000, 4_000_000_000, 2)
