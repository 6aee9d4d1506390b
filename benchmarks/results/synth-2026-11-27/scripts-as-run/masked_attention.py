# As run, but for the probe's timing helper: imported then as engine.measure.compute._time_ns,
# now public under this name.
import torch, torch.nn.functional as F, json, os
from engine.measure.compute import time_op_ns as _time_ns
dev = torch.device('cuda')
rows = []
for bh, l in ((24, 6400), (24, 4352), (32, 4096), (24, 6144)):
    q = torch.randn(1, bh, l, 128, device=dev, dtype=torch.bfloat16)
    m = torch.ones(1, 1, 1, l, device=dev, dtype=torch.bool)
    a = _time_ns(lambda: F.scaled_dot_product_attention(q, q, q), dev)
    b = _time_ns(lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=m), dev)
    rows.append((bh, l, round(a/1e3, 1), round(b/1e3, 1)))
    print(bh, l, 'unmasked', round(a/1e3,1), 'us masked', round(b/1e3,1), 'us')
