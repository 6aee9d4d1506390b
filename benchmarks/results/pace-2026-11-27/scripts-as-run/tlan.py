import json, sys
def load(path):
    d = json.load(open(path)); ev = d['traceEvents'] if isinstance(d, dict) else d
    names = {}
    for e in ev:
        if e.get('ph') == 'M' and e.get('name') == 'thread_name': names[(e['pid'], e['tid'])] = e['args']['name']
    out = {}
    for e in ev:
        if e.get('ph') == 'X':
            out.setdefault((e['pid'], names.get((e['pid'], e['tid']))), []).append((e['ts'], e['ts'] + e['dur'], e['name']))
    for k in out: out[k].sort()
    return out
def union(iv):
    iv = sorted((a, b) for a, b, *_ in iv); tot = 0; cur = None
    for a, b in iv:
        if cur is None or a > cur[1]:
            if cur: tot += cur[1] - cur[0]
            cur = [a, b]
        else: cur[1] = max(cur[1], b)
    if cur: tot += cur[1] - cur[0]
    return tot
def summarize(k, c, h, label):
    t0 = c[0][0]; t1 = c[-1][1]
    ks = sum(b - a for a, b, _ in c)
    hs = sum(b - a for a, b, _ in h)
    print(f"{label}: span {(t1-t0)/1e3:.1f} ms, kernels {len(c)} sum {ks/1e3:.1f} ms, copies {len(h)} sum {hs/1e3:.1f} ms, link busy {union(h)/1e3:.1f}, compute idle {(t1-t0-union(c))/1e3:.1f}")
if __name__ == '__main__':
    m = load(sys.argv[1])
    c, h = m[(2, 'compute')], m.get((2, 'h2d'), [])
    summarize(None, c, h, 'measured')
    if len(sys.argv) > 2:
        s = load(sys.argv[2])
        print({k: len(v) for k, v in s.items()})
