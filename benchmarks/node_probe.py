"""What the GPUs of one host share: H2D and D2H on each GPU alone, then on all at once.

    python benchmarks/node_probe.py                 # every visible GPU
    python benchmarks/node_probe.py --gib 4 --repeats 5

Each GPU copies --gib GiB from one pinned host buffer (shared by all, as the
replicas share the page-cached weight file) in 256 MiB pieces on a stream of
its own, timed with CUDA events; "alone" runs one GPU at a time, "together"
starts every GPU's copies at once (one host thread each) and takes the bytes
of all over the time until the last landed. Prints the medians and the
conf/node fields they give: shared_*_gbps is the together rate (when it is
under the sum of the alone rates, the GPUs share a path), and host_ram_mb.
"""
from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch

PIECE = 256 << 20


def copy_gbps(device: int, host: torch.Tensor, nbytes: int, direction: str, start: threading.Barrier | None,
              out: dict) -> None:
    torch.cuda.set_device(device)
    dev = torch.empty(PIECE, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    pieces = nbytes // PIECE
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up
            (dev.copy_(host[:PIECE], non_blocking=True) if direction == "h2d"
             else host[:PIECE].copy_(dev, non_blocking=True))
    stream.synchronize()
    if start is not None:
        start.wait()
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        for i in range(pieces):
            src = host[(i % 4) * PIECE:(i % 4 + 1) * PIECE]
            dev.copy_(src, non_blocking=True) if direction == "h2d" else src.copy_(dev, non_blocking=True)
    stream.synchronize()
    out[device] = (pieces * PIECE, time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0, help="GiB each GPU copies per run")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise SystemExit("node_probe.py needs CUDA GPUs; the node profile is for a host with several")
    nbytes = int(args.gib * (1 << 30)) // PIECE * PIECE
    host = torch.empty(4 * PIECE, dtype=torch.uint8, pin_memory=True).fill_(1)
    rows = {}
    for direction in ("h2d", "d2h"):
        alone = []
        for g in range(gpus):
            runs = []
            for _ in range(args.repeats):
                out: dict = {}
                copy_gbps(g, host, nbytes, direction, None, out)
                runs.append(out[g][0] / out[g][1] / 1e9)
            alone.append(statistics.median(runs))
        together = []
        for _ in range(args.repeats):
            out = {}
            start = threading.Barrier(gpus)
            threads = [threading.Thread(target=copy_gbps, args=(g, host, nbytes, direction, start, out))
                       for g in range(gpus)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            together.append(sum(b for b, _ in out.values()) / max(s for _, s in out.values()) / 1e9)
        rows[direction] = (alone, statistics.median(together))
    ram_mb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1e6
    print(f"node probe: {time.strftime('%Y-%m-%d')}, {gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print("| direction | each GPU alone, GB/s | all GPUs at once, GB/s in all | sum of alone |")
    print("|---|---|---|---|")
    for direction, (alone, together) in rows.items():
        print(f"| {direction} | {', '.join(f'{a:.1f}' for a in alone)} | {together:.1f} | {sum(alone):.1f} |")
    print(f"\n# conf/node fields\ngpus: {gpus}\nshared_h2d_gbps: {rows['h2d'][1]:.1f}\n"
          f"shared_d2h_gbps: {rows['d2h'][1]:.1f}\nhost_ram_mb: {ram_mb:.0f}")


if __name__ == "__main__":
    main()
