"""H2D copy rate alone and beside compute on another stream: does the step's compute slow the
weight copies? (The simulator slows compute beside copies, `compute_slowdown_under_copy`; not
copies beside compute.)

    python benchmarks/copy_under_compute.py --gib 4 --rounds 5   # on a CUDA machine

Per round, each timed with CUDA events on the copy stream: --gib GiB of pinned host memory
copied to the device in 384 MiB chunks (about an LTX-2 block) alone; then the same while the
compute stream runs, already busy and for longer than the copies take, either bf16 matmuls
(8192 x 8192 x 8192, compute-bound) or in-place adds over two 4 GiB tensors (HBM-bound). Prints
one row per round and the medians.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from link_sources import copy_rate  # noqa: E402

CHUNK = 384 * 2**20
LOADS = ("alone", "matmul", "hbm")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    import torch

    nbytes = int(args.gib * 2**30) // CHUNK * CHUNK
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    x = torch.ones(2**31, dtype=torch.bfloat16, device="cuda")
    y = torch.ones(2**31, dtype=torch.bfloat16, device="cuda")
    copy, compute = torch.cuda.Stream(), torch.cuda.Stream()
    copies = [(dst[i:i + CHUNK], src[i:i + CHUNK]) for i in range(0, nbytes, CHUNK)]
    link_ms = nbytes / 50e6  # about how long the copies take, at 50 GB/s

    def load(kind: str) -> None:
        """Enqueue at least 3x the copies' time of `kind` work on the compute stream."""
        if kind == "alone":
            return
        with torch.cuda.stream(compute):
            if kind == "matmul":  # about 1.4 ms each on an H100
                for _ in range(int(3 * link_ms / 1.4) + 1):
                    torch.mm(a, a)
            else:  # 4 GiB read twice and written once: about 4 ms each at 3 TB/s
                for _ in range(int(3 * link_ms / 4) + 1):
                    x.add_(y)

    table: dict[str, list[float]] = {k: [] for k in LOADS}
    print("GB/s by round: " + "  ".join(LOADS))
    for r in range(args.rounds):
        row = []
        for kind in LOADS:
            torch.cuda.synchronize()
            load(kind)  # enqueued first: the compute stream is busy before the copies start
            g = copy_rate(copy, copies)
            torch.cuda.synchronize()
            table[kind].append(g)
            row.append(g)
        print(f"{r:>2}  " + "  ".join(f"{g:7.2f}" for g in row))
    print("\n| load on the compute stream | H2D median / min / max GB/s | vs alone |")
    print("|---|---|---|")
    alone = statistics.median(table["alone"])
    for kind in LOADS:
        v = table[kind]
        print(f"| {kind} | {statistics.median(v):.2f} / {min(v):.2f} / {max(v):.2f} | "
              f"{statistics.median(v) / alone - 1:+.1%} |")


if __name__ == "__main__":
    sys.exit(main())
