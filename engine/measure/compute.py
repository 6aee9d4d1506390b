"""The device's kernel times over a grid of shapes (mode=record's header probe "compute").

Spec kernels come in a few ops; a model or token count nobody recorded still
runs matmuls, attention cores and memory-bound passes, only at other shapes.
This probe times each op alone over a grid wide enough to bracket the models
the engine ships (rows from decode's 1 to training's 16k, widths 128..16k,
sequence lengths 1..16k), so `mode=calibrate` can fit kernel time by op and
shape (engine/compute.py) where no recorded kernel matches.

The "passes" part times the torch functions the spec forwards run around their
core ops (engine/models/layers.py: the norms, the modulation, the gate, the
residual add, GELU, the attention output's copy back into rows, and the copy and
add of an activation stored features-major) on (1, rows, width) activations
with per-sample (1, 1, width) scale, shift and gate, each with the bytes
engine/models/builder.py declares for that pass and its kind (compute.PASSES):
calibrate fits the pass cost to them, whatever model runs the passes.

The "attention_train" and "attention_masked_train" parts time attention as the CLI's
LoRA training runs it (engine/modes/module_setup.py turns cuDNN's kernels off): the forward
with autograd on and its backward, on the layout diffusers and transformers hand SDPA
((1, l, heads, d) viewed as (1, heads, l, d)). Unmasked it is the flash kernel; masked, the
memory-efficient one, which runs well under the cuDNN kernel inference takes.

The "tiled" shapes time flash attention where its tiles set the pace (engine/compute.py,
AttentionTiling): lengths off the 128-row tile, the head counts models run, and text-length
keys, with the GPU's SM count ("sms"), so calibrate counts attention in tile work.

Times are CUDA events around REPEATS launches after WARMUP, divided by REPEATS; inference
attention's queued behind a spin kernel so the events time the GPU alone (GPU_ALONE_OPS; the
grid names them under GPU_ALONE, and calibrate lets them replace points timed otherwise). Each point
starts from a rested GPU: the probe idles REST_S, and as long again as the point ran over
DUTY, so its duty stays under DUTY. Back to back, the grid's heavy points ran at the clocks of
a GPU under sustained load, slower than the same shapes inside a held step
(benchmarks/results/compute-pace-h100-2026-11-27.md); a recorded kernel's time is a held
step's, and the simulator adds the sustained load's slowdown itself.

    python -m engine.measure.compute --out FILE.json    # the probe alone, for engine.calibrate --probes
"""
from __future__ import annotations

import itertools
import time
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.compute import GPU_ALONE
from engine.measure.clocks import CudaClock
from engine.models.builder import MODULATE, NORM, ONE_PASS, RESIDUAL, SCALE
from engine.models.layers import gelu, layer_norm, modulate, per_head_rms, rms_norm

ROWS = (1, 16, 64, 256, 512, 1024, 2048, 4096, 6144, 8192, 16384)
WIDTHS = (128, 512, 1024, 2048, 3072, 4096, 5120, 6144, 8192, 10240, 12288, 13824, 14336, 16384)
SEQ = (1, 64, 256, 1024, 4096, 16384)
# Masked attention runs another kernel, whose rate bends between the powers of four: its grid
# is denser (a video model's joint sequence, 6400 tokens say, lies between 4096 and 8192).
SEQ_MASKED = (1, 64, 256, 1024, 2048, 4096, 6144, 8192, 16384)
HEAD_DIMS = (64, 128)
HEADS = (8, 32)
TRAIN_SEQ = (64, 256, 1024, 2048, 4096, 6144, 8192, 16384)  # a training step's sequences: no decode
# Flash attention's tiles (module docstring): self-attention at lengths on and off the tile over
# the head counts models run, queries against text-length keys, and the same masked.
TILED_SEQ = (1000, 1024, 1100, 1500, 2048, 2100, 3000, 3333, 4096, 4173, 4429, 5000, 6144, 6400, 7000, 8192, 8269,
             8525, 10000, 12000, 16384, 24576, 32760, 32768)  # 32760: a 480p video of 81 frames
TILED_HEADS = (8, 16, 24, 32, 38, 48)
CROSS_Q, CROSS_K, CROSS_HEADS = (1024, 4096, 4429, 8192), (77, 154, 256, 333, 512), (8, 24, 38)
MASKED_Q, MASKED_K, MASKED_HEADS = (4096, 4429, 6400), (77, 226, 256, 333), (8, 32)
# A decode's queries, masked: transformers folds a grouped-query model's query heads into its
# key-value heads, one query row each (8 heads of 4 rows for Mistral-7B); the kernel's time stays
# near one row's up to its query tile, which rates interpolated between 1 and 64 rows miss.
DECODE_Q = (2, 4, 8, 16)
FULL_MASK_SEQ = (64, 256, 1024, 2048, 4096, 4429, 6144, 8192, 16384)  # a prefill's, masked along its queries
TRAIN_TILED_SEQ = (1024, 1100, 2048, 2100, 4096, 4429, 6144, 6400, 8192, 8525)
TRAIN_TILED_HEADS = (8, 24, 38)
TRAIN_CROSS_Q, TRAIN_CROSS_K = (4096, 4429), (77, 333)
# What a training step's attention may run: everything but cuDNN's kernels (module docstring).
TRAIN_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
MEMORY_BYTES = tuple(1 << p for p in range(12, 31, 2))
PASS_ROWS = (256, 1024, 4096, 6144, 16384)
PASS_WIDTHS = (1024, 2048, 3072, 4096, 5120, 6144, 8192, 12288, 13824)
HEAD_DIM = 128  # the per-head norm's and the attention output copy's head width
EPS = 1e-6
WARMUP = 2
REPEATS = 5
MAX_FLOPS = 2e13  # skip grid points whose repeats would take seconds
REST_S = 0.01
DUTY = 0.2
HOLD_NS = 20_000_000  # the longest spin a timed call waits behind (time_op_ns)
# The ops timed on the GPU alone (time_op_ns `alone`): inference attention, whose launch through
# cuDNN costs the host more than a decode's kernel runs. The linears and passes keep the host's
# pace of launching them alone, which the module costs' gap per op was fitted beside
# (benchmarks/results/linear-probe-h200-2026-11-28.md: probed at the GPU's pace they priced worse).
GPU_ALONE_OPS = ("attention", "attention_masked", "attention_full_mask")

# name: (PASSES kind, the builder's bytes moved per activation byte, the forward's call on
# a: x (1, rows, width), y like x, s per-sample (1, 1, width), w a weight of the norm's width,
# hw one head wide, heads x laid out as SDPA's output (1, width / HEAD_DIM, rows, HEAD_DIM),
# xt x stored features-major (a conv's output flattened and transposed))
PASS_FNS: dict[str, tuple[str, int, Callable[[dict[str, torch.Tensor]], torch.Tensor]]] = {
    "rms_norm": ("rms_norm", NORM, lambda a: rms_norm(a["x"], EPS)),
    "rms_norm_weight": ("rms_norm", NORM, lambda a: rms_norm(a["x"], EPS, a["w"])),
    "per_head_rms": ("head_rms_norm", NORM, lambda a: per_head_rms(a["x"], a["hw"], EPS)),
    "layer_norm": ("layer_norm", NORM, lambda a: layer_norm(a["x"], EPS)),
    "layer_norm_affine": ("layer_norm", NORM, lambda a: layer_norm(a["x"], EPS, a["w"], a["w"])),
    "residual": ("pointwise", RESIDUAL, lambda a: a["x"] + a["y"]),
    "gelu": ("pointwise", ONE_PASS, lambda a: gelu(a["x"])),
    "modulate": ("broadcast", MODULATE, lambda a: modulate(a["x"], a["s"], a["s"])),
    "gate": ("broadcast", SCALE, lambda a: a["y"] * a["s"]),
    "head_copy": ("head_copy", ONE_PASS, lambda a: a["heads"].transpose(1, 2).flatten(2)),
    "transposed_copy": ("transposed_copy", ONE_PASS, lambda a: a["xt"].contiguous()),
    "transposed_residual": ("transposed", RESIDUAL, lambda a: a["xt"] + a["y"]),
}


def time_op_ns(fn: Callable[[], object], device: torch.device, alone: bool = False) -> float:
    """ns of one call of `fn`: WARMUP calls, then REPEATS timed with CUDA events, then a rest
    (module docstring). `alone`: on the GPU alone, the repeats queued behind a spin kernel as
    long as the warm-up's calls took (at most HOLD_NS), so a call whose launch costs the host
    more than its kernel runs (cuDNN's attention on a decode's shapes) is timed as the GPU runs
    it in a model (GPU_ALONE_OPS). The first call and the spin are not counted in the duty: a
    library may build its kernel's plan for a new shape there, host work that leaves the GPU cool."""
    fn()
    torch.cuda.synchronize(device)
    began = time.perf_counter()
    for _ in range(WARMUP - 1):
        fn()
    hold_ns = 0.0
    if alone:
        torch.cuda.synchronize(device)
        hold_ns = min(HOLD_NS, REPEATS * (time.perf_counter() - began) * 1e9 / (WARMUP - 1))
        CudaClock(device).hold(round(hold_ns))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPEATS):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    time.sleep(REST_S + (time.perf_counter() - began - hold_ns / 1e9) * (1 - DUTY) / DUTY)
    return start.elapsed_time(end) * 1e6 / REPEATS


def probe_passes(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> list[list]:
    """[[kind, rows, width, declared bytes, ns, name]] for each PASS_FNS name over
    PASS_ROWS x PASS_WIDTHS, the declared bytes those of a (1, rows, width) activation
    times the pass's multiplier."""
    out: list[list] = []
    for rows, width in itertools.product(PASS_ROWS, PASS_WIDTHS):
        a = {"x": torch.randn(1, rows, width, device=device, dtype=dtype),
             "y": torch.randn(1, rows, width, device=device, dtype=dtype),
             "s": torch.randn(1, 1, width, device=device, dtype=dtype),
             "w": torch.randn(width, device=device, dtype=dtype),
             "hw": torch.randn(HEAD_DIM, device=device, dtype=dtype),
             "heads": torch.randn(1, width // HEAD_DIM, rows, HEAD_DIM, device=device, dtype=dtype),
             "xt": torch.randn(1, width, rows, device=device, dtype=dtype).transpose(1, 2)}
        declared = rows * width * a["x"].element_size()
        for name, (kind, moved, fn) in PASS_FNS.items():
            out.append([kind, rows, width, moved * declared, round(time_op_ns(lambda: fn(a), device)), name])
        del a
    return out


Shape = tuple[int, int, int, int]  # (bh, lq, lk, d)


def tiled_shapes(masked: bool) -> list[Shape]:
    """The tiled shapes of inference attention (module docstring)."""
    if masked:
        return list(itertools.product(MASKED_HEADS, MASKED_Q, MASKED_K, HEAD_DIMS))
    return [(h, n, n, d) for h, n, d in itertools.product(TILED_HEADS, TILED_SEQ, HEAD_DIMS)] + \
        list(itertools.product(CROSS_HEADS, CROSS_Q, CROSS_K, HEAD_DIMS))


def tiled_training_shapes() -> list[Shape]:
    """The tiled shapes of a training step's unmasked attention."""
    return [(h, n, n, d) for h, n, d in itertools.product(TRAIN_TILED_HEADS, TRAIN_TILED_SEQ, HEAD_DIMS)] + \
        list(itertools.product(TRAIN_TILED_HEADS, TRAIN_CROSS_Q, TRAIN_CROSS_K, HEAD_DIMS))


def attention_shapes(masked: bool, head_dims: Sequence[int] | None = None) -> list[Shape]:
    """Inference attention's grid: HEADS x SEQ x SEQ x HEAD_DIMS (masked: SEQ_MASKED, and a
    decode's DECODE_Q query rows over SEQ_MASKED keys), then the tiled shapes; at `head_dims`
    instead, the grid alone at those."""
    seq, dims = SEQ_MASKED if masked else SEQ, HEAD_DIMS if head_dims is None else head_dims
    grid = list(itertools.product(HEADS, seq, seq, dims))
    decode = list(itertools.product(HEADS, DECODE_Q, SEQ_MASKED, dims)) if masked else []
    return list(dict.fromkeys(grid + decode + (tiled_shapes(masked) if head_dims is None else [])))


def training_attention_shapes(masked: bool, head_dims: Sequence[int] | None = None) -> list[Shape]:
    """A training step's attention grid: HEADS x TRAIN_SEQ x TRAIN_SEQ x HEAD_DIMS, then
    (unmasked) the tiled shapes; at `head_dims` instead, the grid alone at those."""
    grid = list(itertools.product(HEADS, TRAIN_SEQ, TRAIN_SEQ, HEAD_DIMS if head_dims is None else head_dims))
    return list(dict.fromkeys(grid + ([] if masked or head_dims is not None else tiled_training_shapes())))


def probe_attention(device: torch.device, dtype: torch.dtype = torch.bfloat16, masked: bool = False,
                    shapes: Sequence[Shape] | None = None) -> list[list]:
    """[[bh, lq, lk, d, ns]]: SDPA over (1, bh, l, d) at `shapes` (attention_shapes); `masked`
    with a boolean key mask (1, 1, 1, lk), as a model that pads its text passes it (torch then
    runs another kernel than the unmasked flash one)."""
    out = []
    for bh, lq, lk, d in attention_shapes(masked) if shapes is None else shapes:
        if 4.0 * bh * lq * lk * d > MAX_FLOPS:
            continue
        q = torch.randn(1, bh, lq, d, device=device, dtype=dtype)
        kv = torch.randn(1, bh, lk, d, device=device, dtype=dtype)
        mask = torch.ones(1, 1, 1, lk, device=device, dtype=torch.bool) if masked else None
        out.append([bh, lq, lk, d, round(time_op_ns(lambda: F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask),
                                                 device, alone=True))])
        del q, kv, mask
    return out


def probe_full_mask(device: torch.device, dtype: torch.dtype = torch.bfloat16,
                    shapes: Sequence[Shape] | None = None) -> list[list]:
    """[[bh, lq, lk, d, ns]]: SDPA over (1, bh, l, d) with a boolean mask that varies along the
    queries, (1, 1, lq, lk) causal, as transformers hands a sliding-window model's prefill (or
    a padded batch's), at `shapes` (full_mask_shapes)."""
    out = []
    for bh, lq, lk, d in full_mask_shapes() if shapes is None else shapes:
        if 4.0 * bh * lq * lk * d > MAX_FLOPS:
            continue
        q = torch.randn(1, bh, lq, d, device=device, dtype=dtype)
        kv = torch.randn(1, bh, lk, d, device=device, dtype=dtype)
        mask = torch.ones(lq, lk, device=device, dtype=torch.bool).tril(lk - lq)[None, None]
        out.append([bh, lq, lk, d, round(time_op_ns(lambda: F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask),
                                                 device, alone=True))])
        del q, kv, mask
    return out


def full_mask_shapes(head_dims: Sequence[int] = HEAD_DIMS) -> list[Shape]:
    """Self-attention with a mask along the queries: HEADS x FULL_MASK_SEQ x `head_dims`."""
    return [(h, n, n, d) for h, n, d in itertools.product(HEADS, FULL_MASK_SEQ, head_dims)]


def training_attention_rows(device: torch.device, dtype: torch.dtype, masked: bool,
                            shapes: Sequence[Shape] | None = None) -> list[list]:
    """[[bh, lq, lk, d, forward ns, backward ns]]: SDPA as a training step runs it (module
    docstring) at `shapes` (training_attention_shapes), `masked` with a boolean key mask
    (1, 1, 1, lk); the backward is the gradient of query, key and value from the output's."""
    out = []
    with sdpa_kernel(TRAIN_BACKENDS):
        for bh, lq, lk, d in training_attention_shapes(masked) if shapes is None else shapes:
            if 4.0 * bh * lq * lk * d > MAX_FLOPS:
                continue
            leaves = [torch.randn(1, n, bh, d, device=device, dtype=dtype, requires_grad=True) for n in (lq, lk, lk)]
            q, k, v = (t.transpose(1, 2) for t in leaves)
            mask = torch.ones(1, 1, 1, lk, device=device, dtype=torch.bool) if masked else None
            forward_ns = time_op_ns(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), device)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            grad = torch.randn_like(o)
            backward_ns = time_op_ns(lambda: torch.autograd.grad(o, leaves, grad, retain_graph=True), device)
            out.append([bh, lq, lk, d, round(forward_ns), round(backward_ns)])
            del leaves, q, k, v, mask, o, grad
    return out


def probe_attention_training(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict:
    """{"attention_train": [[bh, lq, lk, d, forward ns, backward ns]] unmasked,
    "attention_masked_train": the same masked}: attention as a training step runs it."""
    return {"attention_train": training_attention_rows(device, dtype, masked=False),
            "attention_masked_train": training_attention_rows(device, dtype, masked=True)}


def probe_head_dims(device: torch.device, head_dims: Sequence[int], dtype: torch.dtype = torch.bfloat16) -> dict:
    """Every attention part's grid (not the tiles) at `head_dims`, heads wider than the grid's
    (Gemma's 256): a probe file to add beside one written at HEAD_DIMS."""
    return {"attention": probe_attention(device, dtype, shapes=attention_shapes(False, head_dims)),
            "attention_masked": probe_attention(device, dtype, masked=True, shapes=attention_shapes(True, head_dims)),
            "attention_full_mask": probe_full_mask(device, dtype, full_mask_shapes(head_dims)),
            "attention_train": training_attention_rows(device, dtype, False,
                                                       training_attention_shapes(False, head_dims)),
            "attention_masked_train": training_attention_rows(device, dtype, True,
                                                              training_attention_shapes(True, head_dims))}


def probe_tiles(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The tiled shapes alone (module docstring), inference and training, with "sms": a probe
    file to add beside one written before they were probed."""
    return {"attention": probe_attention(device, dtype, shapes=tiled_shapes(False)),
            "attention_masked": probe_attention(device, dtype, masked=True, shapes=tiled_shapes(True)),
            "attention_train": training_attention_rows(device, dtype, False, tiled_training_shapes()),
            "sms": torch.cuda.get_device_properties(device).multi_processor_count}


def probe_compute(device: torch.device, dtype: torch.dtype = torch.bfloat16, training: bool = True) -> dict:
    """{"linear": [[m, n, k, ns]], "attention": [[bh, lq, lk, d, ns]], "attention_masked": the same
    with a key mask, "attention_full_mask" with one along the queries (probe_full_mask), "memory":
    [[bytes, ns]], "passes": probe_passes, "sms": the GPU's SM count}:
    y = x @ w.T + b for x (m, k), w (n, k); SDPA (probe_attention); y = x + y over bytes.
    `training` adds "attention_train" and "attention_masked_train" (probe_attention_training)."""
    out: dict = {"linear": [], "memory": [], "sms": torch.cuda.get_device_properties(device).multi_processor_count}
    for m, n, k in itertools.product(ROWS, WIDTHS, WIDTHS):
        if 2.0 * m * n * k > MAX_FLOPS:
            continue
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype)
        b = torch.randn(n, device=device, dtype=dtype)
        out["linear"].append([m, n, k, round(time_op_ns(lambda: F.linear(x, w, b), device))])
        del x, w, b
    out["attention"] = probe_attention(device, dtype)
    out["attention_masked"] = probe_attention(device, dtype, masked=True)
    out["attention_full_mask"] = probe_full_mask(device, dtype)
    if training:
        out.update(probe_attention_training(device, dtype))
    for nbytes in MEMORY_BYTES:
        x = torch.empty(nbytes // 2, device=device, dtype=dtype).normal_()
        y = torch.empty_like(x).normal_()
        out["memory"].append([3 * nbytes, round(time_op_ns(lambda: y.add_(x), device))])  # reads 2, writes 1
        del x, y
    out["passes"] = probe_passes(device, dtype)
    torch.cuda.empty_cache()
    return marked(out)


def marked(grid: dict) -> dict:
    """`grid` naming under GPU_ALONE the ops of it timed on the GPU alone (GPU_ALONE_OPS)."""
    grid[GPU_ALONE] = [op for op in GPU_ALONE_OPS if op in grid]
    return grid


def _head_dims(text: str) -> tuple[int, ...]:
    """--head-dims: positive head widths, comma-separated."""
    import argparse
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        dims = ()
    if not dims or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of head widths, such as 256")
    return dims


def main(argv: Sequence[str] | None = None) -> None:
    """python -m engine.measure.compute --out FILE.json: the compute probe of this GPU,
    as engine.calibrate --probes reads it."""
    import json
    import sys
    from datetime import datetime, timezone
    from pathlib import Path

    from engine.cli_errors import OneLineParser

    p = OneLineParser(prog="python -m engine.measure.compute", description=main.__doc__)
    p.add_argument("--out", required=True, type=Path, help="the probe file to write (JSON)")
    p.add_argument("--only", choices=("attention_masked", "attention_full_mask", "attention_train", "attention_tiles"),
                   help="probe this op alone (a probe file to add beside an older one)")
    p.add_argument("--head-dims", type=_head_dims, metavar="D,D",
                   help="probe every attention part at these head widths alone (a probe file to add beside an "
                        f"older one; the grid's are {','.join(map(str, HEAD_DIMS))})")
    args = p.parse_args(argv)
    if args.only and args.head_dims:
        p.error("--only and --head-dims each pick what to probe; give one of them")
    if not torch.cuda.is_available():
        print("error: the compute probe times kernels on a CUDA device, and torch sees none here; "
              "run it on the GPU the profile is for", file=sys.stderr)
        sys.exit(2)
    device = torch.device("cuda", torch.cuda.current_device())
    only = {"attention_masked": lambda: {"attention_masked": probe_attention(device, masked=True)},
            "attention_full_mask": lambda: {"attention_full_mask": probe_full_mask(device)},
            "attention_train": lambda: probe_attention_training(device),
            "attention_tiles": lambda: probe_tiles(device)}
    if args.head_dims:
        grid = marked(probe_head_dims(device, args.head_dims))
    else:
        grid = marked(only[args.only]()) if args.only else probe_compute(device)
    data = {"probes": {"compute": grid}, "device": torch.cuda.get_device_name(device),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    args.out.write_text(json.dumps(data) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
