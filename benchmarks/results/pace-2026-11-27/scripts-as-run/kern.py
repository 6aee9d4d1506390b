import sys, bisect
sys.path.insert(0, '/tmp'); sys.path.insert(0, '/work/main')
from tlan import load
from engine.trace import read_trace
t = read_trace(sys.argv[2])
rec = [r.compute_ns / 1e3 for r in t.records]  # us
m = load(sys.argv[1]); c = m[(2, 'compute')]; h = m.get((2, 'h2d'), [])
assert len(c) == len(rec), (len(c), len(rec))
# link busy intervals (union)
iv = sorted((a, b) for a, b, _ in h); U = []
for a, b in iv:
    if U and a <= U[-1][1]: U[-1][1] = max(U[-1][1], b)
    else: U.append([a, b])
def busy(a, b):
    s = 0
    for x, y in U:
        if y <= a: continue
        if x >= b: break
        s += min(b, y) - max(a, x)
    return s
groups = {'none': [0, 0], 'part': [0, 0], 'full': [0, 0]}
for (a, b, n), r in zip(c, rec):
    f = busy(a, b) / max(1e-9, b - a)
    g = 'none' if f < 0.02 else 'full' if f > 0.98 else 'part'
    groups[g][0] += b - a; groups[g][1] += r
for g, (mm, rr) in groups.items():
    if rr: print(f"  {g}: measured {mm/1e3:.1f} ms, recorded {rr/1e3:.1f} ms, ratio {mm/rr:.4f}")
