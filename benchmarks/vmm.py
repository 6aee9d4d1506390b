"""The vmm backend beside the pool backend on a GPU, in one process.

    python benchmarks/vmm.py probe                         # granule, map cost, chunk creation
    python benchmarks/vmm.py soak --steps 200 --blocks 8   # LTX-2 8 blocks, belady/lru/priority at 40%/60%
    python benchmarks/vmm.py full --budgets 16000          # all 48 blocks (a 37.75 GB file)
    python benchmarks/vmm.py train --blocks 8 --budgets 500 --evictions belady --steps 12   # LoRA steps
    python benchmarks/vmm.py interference                  # what maps and unmaps cost kernels running meanwhile

soak: for every eviction and budget fraction, each backend gets a new executor
and runs --steps forwards of the spec LTX-2 through it (weight file in --dir,
registered); the two executors live side by side and take turns of --turn
steps, so the machine's drift over the run falls on both rows alike. Outputs
are compared bitwise with the all-resident forward at steps 1, 50, 100, 200
and the last. A pool refusal that relocation
cannot answer ends the run and is printed. full: the same without the
bitwise check (the reference would not fit beside both executors), --steps
steps each. train: LoRA
rank 32 steps at 6144 video tokens through the executor as mode=execute runs
them (relocating inside a step as inference does), no bitwise check.

Each row: median and mean step (CUDA events, the steps after the first; a
relocation's stall shows in the mean), relocations (the pool's answer to
fragmentation: a stall each), the peak of live block
bytes, the memory the backend held at most (pool reserve / chunks created),
and for vmm the driver calls a step, the map time they cost at the probed rate,
and the host time of the chunk books a step: all of it, of it waiting for a free,
and of it in the driver's calls (the rest is the books' Python). The table is
printed last.

interference: each backend's memory under the same work, timed with CUDA
events: a queue of bf16 matmuls reading a 128 MiB weight placed by it, H2D
copies into that weight, and the matmuls again with the host mapping and
unmapping chunks of another range between launches (the host stays ahead;
the difference over the calls is the device time each call takes from them),
the two in turns, PAIRS times; the median difference and its spread.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Mapping

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor_bench import WORKLOAD, ltx_spec, median_ms, resident_outputs  # noqa: E402

from engine.errors import ExecutorError  # noqa: E402
from engine.executor.setup import bitwise_equal, forward_order, shared_host_weights  # noqa: E402
from engine.executor.runtime import WeightExecutor, make_backend  # noqa: E402
from engine.executor.vmm import CudaVmm  # noqa: E402
from engine.executor.training import StreamedWeights, train_order, train_step  # noqa: E402
from engine.models.lora import init_lora  # noqa: E402
from engine.measure.probes import probe_vmm  # noqa: E402
from engine.models import forward, make_inputs  # noqa: E402
from engine.models.spec import ModelSpec  # noqa: E402
from engine.policy import AccessOrder  # noqa: E402
from engine.units import MB  # noqa: E402
from engine.weightfile import WeightFile, materialize  # noqa: E402

CHECKPOINTS = (1, 50, 100, 200)
TRAIN_WORKLOAD = SimpleNamespace(**{**vars(WORKLOAD), "name": "train_lora", "kind": "train_lora", "lora_rank": 32})
BACKENDS = ("cuda", "vmm")
PAIRS = 9  # interference: matmul runs without and with maps, in turns


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def probe() -> dict:
    return probe_vmm(torch.device("cuda", torch.cuda.current_device()))


def interference(budget: int = 1024 * MB, launches: int = 100, every: int = 5) -> list[dict]:
    """Each backend's memory under the same work (module docstring): matmuls reading a
    weight placed there, H2D copies into it, and the matmuls again with the host mapping
    and unmapping chunks of another range between launches."""
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(6144, 4096, dtype=torch.bfloat16, device=device)
    out = torch.empty(6144, 16384, dtype=torch.bfloat16, device=device)
    nbytes = 16384 * 4096 * 2
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    driver = CudaVmm(device)
    g = driver.granule
    chunks = [driver.create(g) for _ in range(2)]
    address = driver.reserve(2 * g)
    mapped = [False, False]

    def toggle(i: int) -> None:  # map chunk i % 2 at its slot, or unmap it
        slot = address + (i % 2) * g
        if mapped[i % 2]:
            driver.unmap(slot, g)
        else:
            driver.map(slot, chunks[i % 2], g)
            driver.set_access(slot, g)
        mapped[i % 2] = not mapped[i % 2]

    rows = []
    try:
        for name in BACKENDS:
            backend = make_backend(name, budget, nbytes)
            block = backend.alloc(nbytes)
            w = block.data.view(torch.bfloat16).view(16384, 4096)
            w.normal_()

            def matmuls(action: Callable[[int], None] | None = None) -> None:
                for i in range(launches):
                    torch.matmul(x, w.t(), out=out)
                    if action is not None and i % every == every - 1:
                        action(i // every)

            def copies() -> None:
                for _ in range(4):
                    backend.copy_in(block, host)
                torch.cuda.current_stream().wait_stream(backend.copy)

            matmuls()  # warm-up
            pairs = [(median_ms(matmuls, 0, 1)[0], median_ms(lambda: matmuls(toggle), 0, 1)[0])
                     for _ in range(PAIRS)]  # in turns, so drift falls on both
            rows.append({"backend": name, "matmul us": statistics.median(a for a, _ in pairs) * 1e3 / launches,
                         "h2d GB/s": 4 * nbytes / median_ms(copies, 1, 5)[0] / 1e6,
                         "us a map or unmap": statistics.median(b - a for a, b in pairs) * 1e3 / (launches // every),
                         "spread us": (max(b - a for a, b in pairs) - min(b - a for a, b in pairs)) * 1e3
                         / (launches // every)})
            torch.cuda.synchronize()
            backend.free_after(block, None)
            backend.close()
    finally:
        torch.cuda.synchronize()
        for i, on in enumerate(mapped):
            if on:
                driver.unmap(address + i * g, g)
        for c in chunks:
            driver.release(c)
        driver.free_range(address, 2 * g)
    return rows


class Run:
    """One backend's executor over a row's steps; `step()` runs the next one, so the two
    backends' rows can take turns (drift over the run then falls on both alike)."""

    def __init__(self, stack: ExitStack, spec: ModelSpec, order: AccessOrder, host: Mapping[str, torch.Tensor],
                 inputs: dict, reference: dict | None, backend: str, budget: int, eviction: str, steps: int,
                 map_ns: tuple[int, int], profile: bool = False, lora: dict | None = None):
        self.spec, self.inputs, self.reference, self.lora = spec, inputs, reference, lora
        self.map_ns = map_ns
        self.row = {"backend": backend, "budget_mb": round(budget / MB), "eviction": eviction, "bitwise": None,
                    "stopped": None}
        self.marks = {c for c in CHECKPOINTS if c <= steps} | {steps}
        self.steps = steps
        self.relocations, self.maps, self.ran = 0, [], 0
        self.timed: list = []  # every step's StepStats
        self.ex = stack.enter_context(WeightExecutor(order, host, budget_bytes=budget, eviction=eviction,
                                                     lookahead=2, backend=backend))
        self.streamed = StreamedWeights(self.ex, len(spec.kernels)) if lora is not None else None
        self.counts = getattr(self.ex.backend, "map_counts", None)
        self.before = self.counts() if self.counts else None
        self.profiler = cProfile.Profile() if profile else None

    @property
    def done(self) -> bool:
        return self.ran == self.steps or self.row["stopped"] is not None

    def step(self) -> None:
        """The next step (a forward, or a LoRA training step)."""
        step, ex = self.ran + 1, self.ex
        profiling = self.profiler is not None and step >= 3
        if profiling:
            self.profiler.enable()
        try:
            with torch.no_grad():
                if self.lora is not None:
                    with torch.enable_grad():
                        out = train_step(self.spec, ex, self.streamed, None, self.inputs, self.lora,
                                         torch.device("cuda"))
                else:
                    with ex.step():
                        out = forward(self.spec, ex, self.inputs)
        except ExecutorError as err:
            self.row["stopped"] = f"step {step}: {err}"
            log(f"{self.row['backend']} {self.row['eviction']} {self.row['budget_mb']} MB stopped in "
                f"{self.row['stopped']}")
            return
        finally:
            if profiling:
                self.profiler.disable()
        if self.lora is None and step in self.marks and self.reference is not None:
            same = all(bitwise_equal(out[k], self.reference[k]) for k in self.reference)
            self.row["bitwise"] = same if self.row["bitwise"] is None else self.row["bitwise"] and same
        del out
        self.ran = step
        self.relocations += ex.steps[-1].relocations
        self.timed.append(ex.steps[-1])  # the executor keeps only its last steps: time them all
        if self.counts:
            now = self.counts()
            self.maps.append({k: now[k] - self.before[k] for k in now})
            self.before = now

    def finish(self) -> dict:
        """The row: what the steps run measured."""
        row, ex = self.row, self.ex
        if self.profiler is not None:
            stats = io.StringIO()
            pstats.Stats(self.profiler, stream=stats).sort_stats("tottime").print_stats(18)
            log(f"{row['backend']} {row['eviction']} {row['budget_mb']} MB: host profile of steps 3-{self.ran}\n"
                f"{stats.getvalue()}")
        row.update(steps=self.ran, relocations=self.relocations, held_mb=ex.backend.reserved_peak_bytes() / MB)
        if self.timed:  # a run that stopped in its first step has none
            ms = [ex.backend.elapsed_ms(s.start, s.end) for s in self.timed]
            warm = ms[1:] or ms
            row.update(step_ms=statistics.median(warm), mean_ms=statistics.mean(warm),
                       peak_live_mb=max(s.peak_device_bytes for s in self.timed) / MB,
                       h2d_gb=ex.telemetry()[-1]["h2d_bytes"] / 1e9)
        if self.maps:
            steady = self.maps[1:] or self.maps
            for k in ("maps", "unmaps", "creates", "releases", "waits", "reused"):
                row[f"{k}_per_step"] = statistics.median(m[k] for m in steady)
            row["books_ms_per_step"] = statistics.median(m["host_ms"] for m in steady)
            row["wait_ms_per_step"] = statistics.median(m["wait_ms"] for m in steady)
            row["driver_ms_per_step"] = statistics.median(m["driver_ms"] for m in steady)
            row["map_ms_per_step"] = (row["maps_per_step"] * self.map_ns[0]
                                      + row["unmaps_per_step"] * self.map_ns[1]) / 1e6
        log(f"{row['backend']} {row['eviction']} {row['budget_mb']} MB: {row['steps']} steps, "
            f"{row.get('step_ms', float('nan')):.1f} ms, {self.relocations} relocations, bitwise {row['bitwise']}")
        return row


def in_turns(runs: list[Run], turn: int) -> None:
    """Step `runs` in turns of `turn` steps each until every one is done."""
    while not all(r.done for r in runs):
        for r in runs:
            for _ in range(turn):
                if r.done:
                    break
                r.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("probe", "soak", "full", "train", "interference"))
    ap.add_argument("--steps", type=int, default=None, help="default: 200 (soak), 10 (full)")
    ap.add_argument("--blocks", type=int, default=None)
    ap.add_argument("--evictions", default="belady,lru,priority")
    ap.add_argument("--fractions", default="0.4,0.6", help="soak: budgets as fractions of the model")
    ap.add_argument("--budgets", default="16000", help="full: budgets in MB")
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    ap.add_argument("--keep-file", action="store_true", help="leave the weight file in --dir")
    ap.add_argument("--profile", action="store_true", help="print each row's host profile (cProfile, steps 3 on)")
    ap.add_argument("--turn", type=int, default=10,
                    help="steps each backend runs before the other takes its turn (--steps: one after the other)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("vmm.py needs a CUDA device; tests/test_vmm.py runs the backend's bookkeeping on the CPU")
    probed = probe()
    log(f"probe: {probed}")
    if args.what == "probe":
        return
    if args.what == "interference":
        for row in interference():
            log(str(row))
        return
    training = args.what == "train"
    workload = TRAIN_WORKLOAD if training else WORKLOAD
    spec = ltx_spec("ltx", args.blocks if args.what in ("soak", "train") else None, workload)
    order = train_order(forward_order(spec)) if training else forward_order(spec)
    path = args.dir / f"{spec.name}-{spec.num_layers}blocks-seed0.ptd"
    if not path.exists():
        log(f"materializing {spec.model_bytes / 1e9:.2f} GB into {path}")
        materialize(spec, path, seed=0, device="cuda")
    inputs = make_inputs(spec, workload, device="cuda", seed=1)
    lora = init_lora(spec, workload.lora_rank, device="cuda", seed=2) if training else None
    wf = WeightFile(path, spec)
    reference = None
    if args.what == "soak":
        reference = resident_outputs(spec, wf, inputs)
        budgets = [int(float(f) * spec.model_bytes) for f in args.fractions.split(",")]
        steps = args.steps or 200
    else:
        budgets = [int(float(b) * MB) for b in args.budgets.split(",")]
        steps = args.steps or (12 if training else 10)
    rows = []
    try:
        for eviction in args.evictions.split(","):
            for budget in budgets:
                with ExitStack() as stack:
                    host = shared_host_weights(stack, wf, "mmap_registered", "cuda")  # registered once for both
                    runs = [Run(stack, spec, order, host, inputs, reference, backend, budget, eviction, steps,
                                (probed["map_ns"], probed["unmap_ns"]), args.profile, lora) for backend in BACKENDS]
                    in_turns(runs, args.turn)
                    rows.extend(r.finish() for r in runs)
    finally:
        wf.close()
        if not args.keep_file:
            path.unlink(missing_ok=True)
    print()
    print(f"vmm {args.what}: {time.strftime('%Y-%m-%d')}, {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"`python3 benchmarks/vmm.py {' '.join(sys.argv[1:])}`")
    print(f"{spec.name}, {spec.num_layers} blocks, {spec.model_bytes / 1e9:.2f} GB bf16, {len(order)} kernels, "
          f"{len(order.sizes)} weights, lookahead 2; granule {probed['granule']} B, map "
          f"{probed['map_ns'] / 1e3:.2f} us, unmap {probed['unmap_ns'] / 1e3:.2f} us, create "
          f"{probed['create_ns'] / 1e3:.2f} us, release {probed['release_ns'] / 1e3:.2f} us a chunk (by size in "
          f"granules, [map, unmap, create, release] ns: {probed['by_class']})")
    cols = ("eviction", "budget_mb", "backend", "steps", "step_ms", "mean_ms", "relocations", "bitwise", "peak_live_mb",
            "held_mb", "h2d_gb", "maps_per_step", "unmaps_per_step", "creates_per_step", "releases_per_step",
            "waits_per_step", "reused_per_step", "map_ms_per_step", "books_ms_per_step", "wait_ms_per_step",
            "driver_ms_per_step",
            "stopped")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.1f}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols)
              + " |")


if __name__ == "__main__":
    main()
