"""Why a host-bound step's time moves within one process: Llama decode, plain, in turns.

    python benchmarks/host_drift.py                  # Llama-3.1-8B shape, 32 layers
    python benchmarks/host_drift.py --layers 8 --turns 6 --steps 20

A transformers Llama built from a config with random bf16 weights on the device, one
decode token over a KV cache (a step of small kernels: the host bounds it). The same
forward runs in turns of --steps synced steps under each setting, so drift falls on all:

    default     as the process starts
    threads=1   torch.set_num_threads(1) (no intra-op pool to wake)
    one core    the process pinned to the core it runs on (os.sched_setaffinity)

Per turn: the median and max step (perf_counter around the synced call), the CPU time
the container was throttled meanwhile (cgroup cpu.stat) and the hypervisor gave to others
(steal, /proc/stat), the load average and the clock of the core the process ran on. A table per setting last.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.modules.build import llama_inputs  # noqa: E402

CPU_STAT = Path("/sys/fs/cgroup/cpu.stat")


def throttled_us() -> int:
    """Microseconds this cgroup's tasks were throttled by its CPU quota (cgroup v2), or -1."""
    try:
        for line in CPU_STAT.read_text().splitlines():
            key, value = line.split()
            if key == "throttled_usec":
                return int(value)
    except (OSError, ValueError):
        pass
    return -1


def steal_ms() -> float:
    """Milliseconds of CPU time the hypervisor gave to others (all cores, /proc/stat), or -1."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        return int(fields[8]) * 1e3 / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return -1.0


def core_mhz(core: int) -> float:
    """The current clock of `core` (cpufreq, else /proc/cpuinfo), or 0."""
    try:
        return int(Path(f"/sys/devices/system/cpu/cpu{core}/cpufreq/scaling_cur_freq").read_text()) / 1e3
    except (OSError, ValueError):
        pass
    try:
        blocks = Path("/proc/cpuinfo").read_text().split("\n\n")
        for line in blocks[core].splitlines():
            if line.startswith("cpu MHz"):
                return float(line.split(":")[1])
    except (OSError, IndexError, ValueError):
        pass
    return 0.0


def current_core() -> int:
    return int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[36])


def turn(fn: Callable[[], None], steps: int) -> dict:
    throttle0, steal0 = throttled_us(), steal_ms()
    core = current_core()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    throttle = throttled_us()
    return {"median": statistics.median(times), "max": max(times),
            "throttled_ms": (throttle - throttle0) / 1e3 if throttle0 >= 0 else float("nan"),
            "steal_ms": steal_ms() - steal0 if steal0 >= 0 else float("nan"),
            "load": os.getloadavg()[0], "core": core, "mhz": core_mhz(core)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--steps", type=int, default=15)
    args = ap.parse_args()
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                   num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=8)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    inputs = llama_inputs(model, SimpleNamespace(kind="decode", batch=1, context_tokens=args.context, text_tokens=0),
                          torch.device("cuda"), torch.bfloat16)
    print(f"cores allowed {len(os.sched_getaffinity(0))}, torch threads {torch.get_num_threads()}, "
          f"cgroup cpu.max {Path('/sys/fs/cgroup/cpu.max').read_text().strip() if Path('/sys/fs/cgroup/cpu.max').exists() else '?'}",
          flush=True)
    allowed, threads = os.sched_getaffinity(0), torch.get_num_threads()

    def setting(name: str) -> None:
        torch.set_num_threads(1 if name == "threads=1" else threads)
        os.sched_setaffinity(0, {current_core()} if name == "one core" else allowed)

    def step() -> None:
        with torch.no_grad():
            model(**inputs)

    settings = ("default", "threads=1", "one core")
    rows: dict[str, list[dict]] = {s: [] for s in settings}
    for _ in range(3):
        step()
    for t in range(args.turns):
        for s in settings:
            setting(s)
            r = turn(step, args.steps)
            rows[s].append(r)
            print(f"turn {t} {s:9s}: median {r['median']:6.2f} ms, max {r['max']:6.2f}, throttled "
                  f"{r['throttled_ms']:7.1f} ms, steal {r['steal_ms']:6.1f} ms, load {r['load']:.2f}, core {r['core']} at {r['mhz']:.0f} MHz",
                  flush=True)
    setting("default")
    print("\n| setting | median of turn medians ms | turn medians min-max | throttled ms, all turns | steal ms, all turns |")
    print("|---|---|---|---|---|")
    for s in settings:
        meds = [r["median"] for r in rows[s]]
        print(f"| {s} | {statistics.median(meds):.2f} | {min(meds):.2f}-{max(meds):.2f} | "
              f"{sum(r['throttled_ms'] for r in rows[s]):.1f} | {sum(r['steal_ms'] for r in rows[s]):.1f} |")


if __name__ == "__main__":
    main()
