"""The device's kernel times over a grid of shapes (mode=record's header probe "compute").

Spec kernels come in a few ops; a model or token count nobody recorded still
runs matmuls, attention cores and memory-bound passes, only at other shapes.
This probe times each op alone over a grid wide enough to bracket the models
the engine ships (rows from decode's 1 to training's 16k, widths 128..16k,
sequence lengths 1..16k), so `mode=calibrate` can fit kernel time by op and
shape (engine/compute.py) where no recorded kernel matches.

Times are CUDA events around REPEATS launches after WARMUP, divided by REPEATS.
"""
from __future__ import annotations

import itertools
from typing import Callable

import torch
import torch.nn.functional as F

ROWS = (1, 16, 64, 256, 1024, 4096, 16384)
WIDTHS = (128, 512, 2048, 4096, 8192, 16384)
SEQ = (1, 64, 256, 1024, 4096, 16384)
HEAD_DIMS = (64, 128)
HEADS = (8, 32)
MEMORY_BYTES = tuple(1 << p for p in range(12, 31, 2))
WARMUP = 2
REPEATS = 5
MAX_FLOPS = 2e13  # skip grid points whose repeats would take seconds


def _time_ns(fn: Callable[[], object], device: torch.device) -> float:
    for _ in range(WARMUP):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPEATS):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) * 1e6 / REPEATS


def probe_compute(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict:
    """{"linear": [[m, n, k, ns]], "attention": [[bh, lq, lk, d, ns]], "memory": [[bytes, ns]]}:
    y = x @ w.T + b for x (m, k), w (n, k); SDPA over (1, bh, l, d); y = x + y over bytes."""
    out: dict[str, list[list[float]]] = {"linear": [], "attention": [], "memory": []}
    for m, n, k in itertools.product(ROWS, WIDTHS, WIDTHS):
        if 2.0 * m * n * k > MAX_FLOPS:
            continue
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype)
        b = torch.randn(n, device=device, dtype=dtype)
        out["linear"].append([m, n, k, round(_time_ns(lambda: F.linear(x, w, b), device))])
        del x, w, b
    for bh, lq, lk, d in itertools.product(HEADS, SEQ, SEQ, HEAD_DIMS):
        if 4.0 * bh * lq * lk * d > MAX_FLOPS:
            continue
        q = torch.randn(1, bh, lq, d, device=device, dtype=dtype)
        kv = torch.randn(1, bh, lk, d, device=device, dtype=dtype)
        out["attention"].append(
            [bh, lq, lk, d, round(_time_ns(lambda: F.scaled_dot_product_attention(q, kv, kv), device))])
        del q, kv
    for nbytes in MEMORY_BYTES:
        x = torch.empty(nbytes // 2, device=device, dtype=dtype).normal_()
        y = torch.empty_like(x).normal_()
        out["memory"].append([3 * nbytes, round(_time_ns(lambda: y.add_(x), device))])  # reads 2, writes 1
        del x, y
    torch.cuda.empty_cache()
    return out
