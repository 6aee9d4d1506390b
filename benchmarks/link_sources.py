"""H2D copy rate by where the host bytes live, interleaved over time on one GPU.

    python benchmarks/link_sources.py --gib 4 --rounds 12   # on a CUDA machine

Sources, each --gib GiB:
  pinned        torch's pinned allocation (cudaHostAlloc): what mode=record's copy probe reads
  shm           a file in /dev/shm, mapped and registered read-only (cudaHostRegister), as the
                executor registers a weight file
  disk          the same for a file on --disk-dir, in the page cache (a checkpoint's case)
  anon          an anonymous mapping, registered

Each round times, per source and chunk size, copies of the whole range back to back (queued
behind a spin kernel, so the copy engine's time, not the host's issue) with CUDA events.
Rounds alternate sources so a link that drifts shows in every column alike. Prints the machine's
PCIe link and NUMA facts, one row per round, and the medians. Deletes its files.
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable

CHUNKS_MIB = (4, 64, 512)
REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly
REGISTER_PORTABLE = 1


def facts() -> None:
    """What the lease says about its link and memory placement."""
    q = subprocess.run(["nvidia-smi", "-q"], capture_output=True, text=True).stdout
    keep = [ln.strip() for ln in q.splitlines()
            if any(k in ln for k in ("Generation", "Link Width", "Max ", "Current ", "Bus Id", "Replays",
                                     "Tx Throughput", "Rx Throughput"))]
    print("nvidia-smi -q (PCIe):", "; ".join(dict.fromkeys(keep))[:900])
    for path in ("/sys/kernel/mm/transparent_hugepage/enabled", "/sys/kernel/mm/transparent_hugepage/shmem_enabled"):
        try:
            print(path, Path(path).read_text().strip())
        except OSError as e:
            print(path, "unreadable:", e)
    nodes = sorted(p.name for p in Path("/sys/devices/system/node").glob("node[0-9]*"))
    print("NUMA nodes:", nodes or "none visible", "| CPUs:", os.cpu_count(),
          "| affinity:", len(os.sched_getaffinity(0)))
    for ln in Path("/proc/meminfo").read_text().splitlines():
        if ln.split(":")[0] in ("MemTotal", "MemAvailable", "AnonHugePages", "ShmemHugePages", "Hugepagesize"):
            print(" ", ln)
    iommu = list(Path("/sys/class/iommu").glob("*")) if Path("/sys/class/iommu").exists() else []
    print("iommu devices:", [p.name for p in iommu] or "none visible")


def copy_rate(stream: Any, copies: Iterable[tuple[Any, Any]]) -> float:
    """GB/s of `copies` ((destination, source) tensors) issued back to back on `stream` behind a
    spin kernel, so the copy engine's time is timed (CUDA events), not the host's issue."""
    import torch

    nbytes = 0
    with torch.cuda.stream(stream):
        torch.cuda._sleep(2_000_000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        for dst, src in copies:
            dst.copy_(src, non_blocking=True)
            nbytes += src.numel() * src.element_size()
        b.record(stream)
    b.synchronize()
    return nbytes / (a.elapsed_time(b) * 1e6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--disk-dir", default="/tmp")
    args = ap.parse_args()

    import torch

    facts()
    cudart = torch.cuda.cudart()
    nbytes = int(args.gib * 2**30) // 2**21 * 2**21
    dev = torch.empty(max(CHUNKS_MIB) * 2**20, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    sources: dict[str, torch.Tensor] = {}
    keep: list = []  # the mappings stay open to the end (tensors view them)
    cleanup: list[Path] = []

    t = time.perf_counter()
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pinned.fill_(1)
    sources["pinned"] = pinned
    print(f"pinned alloc + fill: {time.perf_counter() - t:.1f} s")

    def register(view: memoryview, name: str) -> torch.Tensor:
        t = time.perf_counter()
        tensor = torch.frombuffer(view, dtype=torch.uint8)
        err = cudart.cudaHostRegister(tensor.data_ptr(), nbytes, REGISTER_READ_ONLY | REGISTER_PORTABLE)
        if int(err) != 0:
            raise SystemExit(f"cudaHostRegister of {name} failed: {err}")
        print(f"{name}: register {time.perf_counter() - t:.1f} s")
        return tensor

    for name, folder in (("shm", "/dev/shm"), ("disk", args.disk_dir)):
        path = Path(folder) / f"link-sources-{os.getpid()}.bin"
        cleanup.append(path)
        t = time.perf_counter()
        block = b"\x01" * (64 * 2**20)
        with open(path, "wb") as f:
            for _ in range(nbytes // len(block)):
                f.write(block)
            f.write(b"\x01" * (nbytes % len(block)))
        print(f"{name}: wrote {path} in {time.perf_counter() - t:.1f} s")
        fd = os.open(path, os.O_RDONLY)
        m = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
        os.close(fd)
        keep.append(m)
        sources[name] = register(memoryview(m), name)
    anon = mmap.mmap(-1, nbytes)
    anon.madvise(mmap.MADV_HUGEPAGE)
    torch.frombuffer(anon, dtype=torch.uint8).fill_(1)
    keep.append(anon)
    sources["anon"] = register(memoryview(anon), "anon")

    def rate(src: torch.Tensor, chunk: int) -> float:
        return copy_rate(stream, ((dev[:chunk], src[i * chunk:(i + 1) * chunk]) for i in range(nbytes // chunk)))

    for src in sources.values():  # warm each path once
        rate(src, 64 * 2**20)
    cols = [(name, c) for c in CHUNKS_MIB for name in sources]
    table: dict[tuple[str, int], list[float]] = {col: [] for col in cols}
    print("\nGB/s by round (source/chunk MiB):")
    print("round " + " ".join(f"{n}/{c}".rjust(10) for n, c in cols))
    start = time.perf_counter()
    for r in range(args.rounds):
        row = []
        for name, c in cols:
            g = rate(sources[name], c * 2**20)
            table[(name, c)].append(g)
            row.append(g)
        print(f"{r:>2} {time.perf_counter() - start:5.1f}s " + " ".join(f"{g:10.2f}" for g in row))
        time.sleep(0.5)
    print("\n| source | " + " | ".join(f"{c} MiB median / min / max GB/s" for c in CHUNKS_MIB) + " |")
    print("|---|" + "---|" * len(CHUNKS_MIB))
    for name in sources:
        cells = []
        for c in CHUNKS_MIB:
            v = table[(name, c)]
            cells.append(f"{statistics.median(v):.2f} / {min(v):.2f} / {max(v):.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")

    for name, src in sources.items():
        if name != "pinned":
            cudart.cudaHostUnregister(src.data_ptr())
    for path in cleanup:
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
