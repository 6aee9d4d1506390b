"""H2D copy rate by how far the copies reach: a small window of the host file and of the device
buffer (as the recorder's copy probe and link_sources.py copy) against the whole of a large
registered file into a buffer the size of a weight pool (as the executor copies a model).

    python benchmarks/link_reach.py --gib 36 --pool-gib 12 --rounds 4   # on a CUDA machine

A --gib file in /dev/shm (allocated, not written), mapped and registered read-only as the
executor registers a weight file; a device buffer of --pool-gib. Per round and chunk size, four
cases copy the same bytes (the whole file's worth), back to back behind a spin kernel, timed
with CUDA events:
  near/near   source and destination each cycle over a 4 GiB / 512 MiB window
  far/near    the source walks the whole file, the destination cycles over 512 MiB
  near/far    the source cycles over 4 GiB, the destination walks the whole pool
  far/far     both walk everything (the executor's case)
Cases alternate within a round, so a link that drifts shows in every column alike. --offset
starts every source copy that many bytes past a page boundary (a weight file aligns its tensors
to 64 bytes, not to pages). Prints one row per round and the medians. Deletes its file.
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

from link_sources import copy_rate

REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly
REGISTER_PORTABLE = 1
NEAR_SRC, NEAR_DST = 4 * 2**30, 512 * 2**20
CASES = ("near/near", "far/near", "near/far", "far/far")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=36.0, help="the registered host file")
    ap.add_argument("--pool-gib", type=float, default=12.0, help="the device buffer")
    ap.add_argument("--chunks-mib", default="64,384")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--offset", type=int, default=0, help="bytes past a page boundary each source copy starts")
    args = ap.parse_args()

    import torch

    cudart = torch.cuda.cudart()
    nbytes = int(args.gib * 2**30) // 2**21 * 2**21
    pool = int(args.pool_gib * 2**30) // 2**21 * 2**21
    chunks = [int(c) * 2**20 for c in args.chunks_mib.split(",")]
    path = Path("/dev/shm") / f"link-reach-{os.getpid()}.bin"
    try:
        t = time.perf_counter()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.posix_fallocate(fd, 0, nbytes)
        m = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
        os.close(fd)
        src = torch.frombuffer(memoryview(m), dtype=torch.uint8)
        err = cudart.cudaHostRegister(src.data_ptr(), nbytes, REGISTER_READ_ONLY | REGISTER_PORTABLE)
        if int(err) != 0:
            raise SystemExit(f"cudaHostRegister failed: {err}")
        print(f"{nbytes / 2**30:.1f} GiB in {path}, allocated and registered in {time.perf_counter() - t:.1f} s; "
              f"device buffer {pool / 2**30:.1f} GiB; source copies start {args.offset} B past a page")
        dev = torch.empty(pool, dtype=torch.uint8, device="cuda")
        stream = torch.cuda.Stream()

        def rate(case: str, chunk: int) -> float:
            far_src, far_dst = case.split("/")[0] == "far", case.split("/")[1] == "far"
            src_span = ((nbytes if far_src else NEAR_SRC) - args.offset) // chunk * chunk
            dst_span = (pool if far_dst else NEAR_DST) // chunk * chunk
            steps = (i * chunk for i in range(nbytes // chunk))
            o = args.offset
            return copy_rate(stream, ((dev[k % dst_span:k % dst_span + chunk],
                                       src[o + k % src_span:o + k % src_span + chunk]) for k in steps))

        cols = [(case, c) for c in chunks for case in CASES]
        for case, c in cols[:len(CASES)]:
            rate(case, c)  # warm each path once
        table: dict[tuple[str, int], list[float]] = {col: [] for col in cols}
        print("\nGB/s by round (case/chunk MiB):")
        print("round  " + " ".join(f"{case}/{c >> 20}".rjust(14) for case, c in cols))
        for r in range(args.rounds):
            row = []
            for col in cols:
                g = rate(*col)
                table[col].append(g)
                row.append(g)
            print(f"{r:>5}  " + " ".join(f"{g:14.2f}" for g in row))
        print("\n| case | " + " | ".join(f"{c >> 20} MiB median / min / max GB/s" for c in chunks) + " |")
        print("|---|" + "---|" * len(chunks))
        for case in CASES:
            cells = [f"{statistics.median(table[(case, c)]):.2f} / {min(table[(case, c)]):.2f} / "
                     f"{max(table[(case, c)]):.2f}" for c in chunks]
            print(f"| {case} | " + " | ".join(cells) + " |")
        cudart.cudaHostUnregister(src.data_ptr())
    finally:
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
