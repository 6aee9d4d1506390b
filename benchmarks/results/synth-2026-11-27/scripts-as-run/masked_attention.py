# As run, but for the timing helper, which it imported from engine/measure/compute.py
# (_time_ns: WARMUP calls, then REPEATS timed with CUDA events, then a rest) and is inlined here.
import time
import torch, torch.nn.functional as F, json, os
from engine.measure.compute import DUTY, REPEATS, REST_S, WARMUP


def _time_ns(fn, device):
    torch.cuda.synchronize(device)
    began = time.perf_counter()
    for _ in range(WARMUP):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPEATS):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    time.sleep(REST_S + (time.perf_counter() - began) * (1 - DUTY) / DUTY)
    return start.elapsed_time(end) * 1e6 / REPEATS
dev = torch.device('cuda')
rows = []
for bh, l in ((24, 6400), (24, 4352), (32, 4096), (24, 6144)):
    q = torch.randn(1, bh, l, 128, device=dev, dtype=torch.bfloat16)
    m = torch.ones(1, 1, 1, l, device=dev, dtype=torch.bool)
    a = _time_ns(lambda: F.scaled_dot_product_attention(q, q, q), dev)
    b = _time_ns(lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=m), dev)
    rows.append((bh, l, round(a/1e3, 1), round(b/1e3, 1)))
    print(bh, l, 'unmasked', round(a/1e3,1), 'us masked', round(b/1e3,1), 'us')
