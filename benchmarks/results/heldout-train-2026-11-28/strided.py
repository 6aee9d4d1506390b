"""Offline: would splitting a real module's memory-bound elements into contiguous and strided
(a broadcast or non-contiguous operand: torch's non-vectorized elementwise path) explain the
synthesized inference residuals? Per recording: each forward record's compute (at held pace)
less its cores at the table's rates, against (contiguous elements, strided elements, ops)."""
import sys, collections, math
from types import SimpleNamespace
from pathlib import Path
import torch
from omegaconf import OmegaConf
from torch.utils._pytree import tree_flatten
import engine.modules.census as census
from engine.modules.synthesize import meta_forward, on_meta
from engine.trace import read_trace
from engine.compute import load_table

ROOT = Path(".")
strided = collections.defaultdict(int)
orig = census.OpCensus.__torch_dispatch__


def patched(self, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    before = self.current.memory_elements
    pos = self._current
    out = orig(self, func, types, args, kwargs)
    added = self.kernels[pos].memory_elements - before
    if added:
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.numel() > 1]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        n = max((t.numel() for t in outs), default=0)
        odd = any((not t.is_contiguous()) or (t.numel() != n and n) for t in tensors)
        if odd:
            strided[pos] += added
    return out


census.OpCensus.__torch_dispatch__ = patched
pairs = [("ltx2.trace.jsonl.gz", "ltx2_diffusers"), ("flux.trace.jsonl.gz", "flux_diffusers"),
         ("wan14b.trace.jsonl.gz", "wan14b_diffusers"), ("qwen_image.trace.jsonl.gz", "qwen_image_diffusers"),
         ("hunyuan_video.trace.jsonl.gz", "hunyuan_video_diffusers")]
table = load_table("h100_calibrated.kernels.json")
rows = {}
for f, model in pairs:
    trace = read_trace(ROOT / "data/traces/modules" / f)
    cfg = OmegaConf.merge(OmegaConf.load(ROOT / "conf" / "model" / f"{model}.yaml"),
                          OmegaConf.from_dotlist(trace.header.get("model_set", [])))
    module, inputs = on_meta(cfg, SimpleNamespace(**trace.header["workload"]))
    strided.clear()
    seen = meta_forward(module, inputs, trace.header.get("grouping", "block"), cfg.get("blocks") and list(cfg.blocks))
    scale = float(trace.header.get("compute_scale") or 1.0)
    out = []
    for i, (r, c) in enumerate(zip([r for r in trace.records if r.phase == "fwd"], seen.recording.census)):
        cores = sum(table.core_ns(op, shape) or 0.0 for op, shape in c.cores)
        out.append((r.compute_ns / scale - cores, c.memory_elements - strided[i], strided[i], c.ops))
    rows[model] = out
    tot = sum(o[1] + o[2] for o in out)
    print(f"{model}: elements {tot:.3g}, strided share {sum(o[2] for o in out) / tot:.2f}, rest ms {sum(o[0] for o in out) / 1e6:.1f}")

import numpy as np
import itertools


def nnls(A, b):
    best = None
    n = A.shape[1]
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            c, *_ = np.linalg.lstsq(A[:, cols], b, rcond=None)
            if (c < 0).any():
                continue
            full = np.zeros(n); full[list(cols)] = c
            loss = np.sum((A @ full - b) ** 2)
            if best is None or loss < best[0]:
                best = (loss, full)
    return best[1]


def feats(o, three):
    return [o[1], o[2], o[3]] if three else [o[1] + o[2], o[3]]


for three, label in ((False, "2-term (elements, ops)"), (True, "3-term (contiguous, strided, ops)")):
    print("==", label)
    for held in rows:
        X, y, w = [], [], []
        for m in rows:
            if m == held:
                continue
            step = sum(o[0] for o in rows[m])
            for o in rows[m]:
                X.append(feats(o, three)); y.append(o[0]); w.append(1 / step)
        X, y, w = np.array(X, float), np.array(y, float), np.array(w)
        coef = nnls(X * w[:, None], y * w)
        pred = sum(float(np.dot(coef, feats(o, three))) for o in rows[held])
        actual = sum(o[0] for o in rows[held])
        print(f"  {held:26s} rest {actual / 1e6:6.1f} ms, held out {pred / 1e6:6.1f} ({100 * (pred / actual - 1):+5.1f}%) coef {coef}")
