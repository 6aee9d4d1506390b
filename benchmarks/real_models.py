"""The user's own model: diffusers / transformers modules recorded, predicted and run at the limit.

    python benchmarks/real_models.py --models ltx2 --budgets 16000 --peer --out DIR
    python benchmarks/real_models.py --models flux,wan14b --budgets 8000,16000 --out DIR
    python benchmarks/real_models.py --models llama8b --budgets 4000,8000,12000 --out DIR
    python benchmarks/real_models.py --models ltx2 --budgets 16000 --backends cuda,vmm --out DIR
    python benchmarks/real_models.py --models llama8b --budgets 0,8000          # 0: all resident, our hooks
    python benchmarks/real_models.py --models flux --budgets 16000,0 --workload video_tokens=16384   # another shape
    python benchmarks/real_models.py --models qwen3_moe --budgets 8000,0 --model-set module.config.num_hidden_layers=24
    python benchmarks/real_models.py --models flux --budgets 12000 --groupings block,leaf \
        --evictions priority,belady,lru --lookahead 1,2,3                       # tuning: 18 candidates

Per model (conf/model/<name>_diffusers.yaml / llama8b_hf.yaml, built on the meta device):
  checkpoint  random bf16 weights written once to --dir (a single .safetensors, mode=materialize's writer)
  resident    every weight loaded to the device from the checkpoint: the reference output and the
              compute floor; again beside a stream of H2D copies (the slowdown under copies)
  record      engine.record: each block timed on the device -> the trace the predictions replay
              (once per --groupings entry: leaf makes every leaf module with weights a kernel)
  ours        per budget (0: every weight resident through the same hooks, budget_mb=None):
              engine.offload(checkpoint=..., eviction = the simulator's pick on that trace):
              set-up time (map + register + record order + warm), step time (median of --steps after
              --warmup, CUDA events, the host waiting for each step's last kernel: a synced loop, as
              one reading each output runs, predicted with loop="synced"), the same steps launched
              back to back (free-running: a loop that never reads its output), H2D bytes,
              outputs bitwise against one of the resident steps' (a forward whose own kernels are
              not deterministic, Llama decode's on some inputs, has more than one), prediction beside it
  limit       max(resident x (1 + slowdown under copies), mean H2D bytes a step / pinned H2D bandwidth)
  timeline    (--timeline) one more step per row with each kernel and weight copy timed on the device
  peer        (--peer) diffusers enable_group_offload(block_level, 1 block per group, use_stream=True)
              on the same module with CPU weights viewing the same checkpoint mapping

Prints a markdown table last, then per budget the configuration the simulator ranks first against
the best measured, and writes real_models.json under --out.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import engine  # noqa: E402
from engine.executor.setup import bitwise_equal  # noqa: E402
from engine.measure.probes import copy_stream_beside, probe_copies  # noqa: E402
from engine.config import load_hardware  # noqa: E402
from engine.errors import BelowFloorError  # noqa: E402
from engine.modules.build import build_module, example_inputs, first_output  # noqa: E402
from engine.modules.checkpoint import Checkpoint, load_resident, module_weights  # noqa: E402
from engine.modules.offload import predict  # noqa: E402
from engine.modules.outcomes import distinct  # noqa: E402
from engine.policy import KEEP_STEPS  # noqa: E402
from engine.trace import Trace, write_trace  # noqa: E402
from engine.weightfile import materialize  # noqa: E402

MODELS = {"ltx2": "ltx2_diffusers", "flux": "flux_diffusers", "wan14b": "wan14b_diffusers",
          "qwen_image": "qwen_image_diffusers", "hunyuan_video": "hunyuan_video_diffusers", "llama8b": "llama8b_hf",
          "qwen3_moe": "qwen3_moe_hf", "gpt_oss": "gpt_oss_hf", "sd35_large": "sd35_large_diffusers",
          "qwen25_14b": "qwen25_14b_hf", "mochi": "mochi_diffusers", "auraflow": "auraflow_diffusers",
          "mistral7b": "mistral7b_hf", "mistral7b_prefill": "mistral7b_hf", "llama8b_prefill": "llama8b_hf",
          "qwen25_14b_prefill": "qwen25_14b_hf", "flux2": "flux2_diffusers", "zimage": "zimage_diffusers",
          "qwen3_8b": "qwen3_8b_hf", "qwen3_8b_prefill": "qwen3_8b_hf", "hunyuan_image": "hunyuan_image_diffusers",
          "gemma3_12b": "gemma3_12b_hf", "gemma3_12b_prefill": "gemma3_12b_hf",
          "hunyuan_video15": "hunyuan_video15_diffusers"}
WORKLOADS = {  # the workload yaml's shapes: 768x512x121 video, 1024x1024 image, one decode token
    "ltx2": dict(kind="infer", batch=1, video_tokens=6144, audio_tokens=128, text_tokens=256, context_tokens=0),
    "flux": dict(kind="infer", batch=1, video_tokens=4096, audio_tokens=0, text_tokens=512, context_tokens=0),
    "wan14b": dict(kind="infer", batch=1, video_tokens=6144, audio_tokens=0, text_tokens=512, context_tokens=0),
    "qwen_image": dict(kind="infer", batch=1, video_tokens=4096, audio_tokens=0, text_tokens=256, context_tokens=0),
    "hunyuan_video": dict(kind="infer", batch=1, video_tokens=6144, audio_tokens=0, text_tokens=256, context_tokens=0),
    "llama8b": dict(kind="decode", batch=1, video_tokens=0, audio_tokens=0, text_tokens=0, context_tokens=4096),
    "qwen3_moe": dict(kind="decode", batch=1, video_tokens=0, audio_tokens=0, text_tokens=0, context_tokens=4096),
    "gpt_oss": dict(kind="decode", batch=1, video_tokens=0, audio_tokens=0, text_tokens=0, context_tokens=4096),
    "sd35_large": dict(kind="infer", batch=1, video_tokens=4096, audio_tokens=0, text_tokens=333, context_tokens=0),
    "qwen25_14b": dict(kind="decode", batch=1, video_tokens=0, audio_tokens=0, text_tokens=0, context_tokens=4096),
    "mochi": dict(kind="infer", batch=1, video_tokens=6144, audio_tokens=0, text_tokens=256, context_tokens=0),
    "auraflow": dict(kind="infer", batch=1, video_tokens=4096, audio_tokens=0, text_tokens=256, context_tokens=0),
    "mistral7b": dict(kind="decode", batch=1, video_tokens=0, audio_tokens=0, text_tokens=0, context_tokens=4096),
    "mistral7b_prefill": dict(kind="infer", batch=1, video_tokens=0, audio_tokens=0, text_tokens=4096,
                              context_tokens=0),
    "llama8b_prefill": dict(kind="infer", batch=1, video_tokens=0, audio_tokens=0, text_tokens=4096, context_tokens=0),
    "qwen25_14b_prefill": dict(kind="infer", batch=1, video_tokens=0, audio_tokens=0, text_tokens=4096,
                               context_tokens=0),
    "flux2": dict(kind="infer", batch=1, video_tokens=4096, audio_tokens=0, text_tokens=512, context_tokens=0),
    "zimage": dict(kind="infer", batch=1, video_tokens=4096, audio_tokens=0, text_tokens=256, context_tokens=0),
    "qwen3_8b": dict(kind="decode", batch=1, video_tokens=0, audio_tokens=0, text_tokens=0, context_tokens=4096),
    "qwen3_8b_prefill": dict(kind="infer", batch=1, video_tokens=0, audio_tokens=0, text_tokens=4096, context_tokens=0),
    "hunyuan_image": dict(kind="infer", batch=1, video_tokens=4096, audio_tokens=0, text_tokens=256, context_tokens=0),
    "gemma3_12b": dict(kind="decode", batch=1, video_tokens=0, audio_tokens=0, text_tokens=0, context_tokens=4096),
    "gemma3_12b_prefill": dict(kind="infer", batch=1, video_tokens=0, audio_tokens=0, text_tokens=4096,
                               context_tokens=0),
    "hunyuan_video15": dict(kind="infer", batch=1, video_tokens=12288, audio_tokens=0, text_tokens=256,
                            context_tokens=0),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def host_rss() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    return out


def one_of(output: torch.Tensor, outcomes: list[torch.Tensor]) -> bool:
    """Whether `output` is bitwise one of the resident run's `outcomes` (on their device)."""
    return any(bitwise_equal(output.to(o.device), o) for o in outcomes)


# Runs written before "harness_device_bytes" held things of their own on the device, counted in
# each recording's torch peak and each row's: the copy stream's buffer (engine/measure/probes.py
# copy_stream_beside) and the resident reference's outputs; in a row's steps, one more step's
# whole output too (a causal LM prefill's with its new KV cache), alive beside the next step.
LEGACY_COPY_BYTES = 256 * 2**20


def legacy_harness_bytes(cfg: Any, workload: dict, outcomes: int) -> tuple[int, int]:
    """What a run without "harness_device_bytes" held on the device beside the module, (while it
    recorded, while it ran a row's steps): the copy buffer and `outcomes` reference outputs, each
    a causal LM's logits (bf16) or a diffusion transformer's prediction, shaped as its latent
    input; in a row, one more output and a prefill's KV cache."""
    from engine.modules.synthesize import on_meta

    module, inputs = on_meta(cfg, SimpleNamespace(**workload))
    cache = 0
    if "input_ids" in inputs:
        c = module.config
        tokens = inputs["input_ids"].numel()
        output = tokens * c.vocab_size * 2
        if workload.get("kind") != "decode":
            head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
            cache = c.num_hidden_layers * 2 * tokens * c.num_key_value_heads * head_dim * 2
    else:
        latents = inputs["hidden_states"]
        output = latents.numel() * latents.element_size()
    recording = LEGACY_COPY_BYTES + outcomes * output
    return recording, recording + output + cache


def timed(fn: Callable[[], Any], warmup: int, steps: int) -> tuple[list[float], list[float], Any]:
    """A synced loop's last `steps` steps (ms, CUDA events) and when each ended (Unix
    seconds, to set beside a log of the GPU's clocks): the host waits for each step's
    last kernel before the next, as reading the output does (the copy stream's prefetches
    go on across the wait, as they do there). Each step's output is let go before the next
    starts, as a loop that consumes it does: the peak measured is one step's, as predicted."""
    out = None
    times, ends = [], []
    torch.cuda.synchronize()
    for i in range(warmup + steps):
        out = None
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = fn()
        b.record()
        b.synchronize()
        if i >= warmup:
            times.append(a.elapsed_time(b))
            ends.append(time.time())
    return times, ends, out


# The recording's all-resident step this far from the plain module's is flagged: the hooks
# alone cost host-bound decode less (benchmarks/results/real-models-h100-2026-11-25.md).
DISTURBED = 0.25


def free_running(fn: Callable[[], Any], steps: int) -> float:
    """Mean step of `steps` steps launched back to back (no host sync between them), as a
    loop that never reads its output on the host runs."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(steps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / steps


def bench_model(key: str, args: argparse.Namespace, hw: Any) -> dict:
    cfg = OmegaConf.load(ROOT / "conf" / "model" / f"{MODELS[key]}.yaml")
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(args.model_set))
    device = torch.device("cuda")
    shape = {**WORKLOADS[key], **args.workload}
    wl = SimpleNamespace(**shape)
    result: dict[str, Any] = {"model": cfg.name, "model_set": args.model_set, "workload": shape, "rows": [],
                              "harness_device_bytes": 0}
    path = Path(args.dir) / f"{key}.safetensors"
    module = build_module(cfg)
    table = module_weights(module, cfg.name)
    result["params"] = sum(p.numel() for p in module.parameters())
    result["model_bytes"] = table.model_bytes
    if not path.exists():
        t0 = time.perf_counter()
        materialize(table, path, seed=0, device="cuda", order=list(table.weights))
        result["materialize_s"] = round(time.perf_counter() - t0, 1)
        log(f"{key}: wrote {path} in {result['materialize_s']} s")
    inputs = example_inputs(cfg, module, wl, device)

    # Resident reference: a second meta-built instance, every weight loaded to the device.
    with torch.no_grad():
        t0 = time.perf_counter()
        ref_module = load_resident(build_module(cfg), path, device)
        torch.cuda.synchronize()
        load_s = time.perf_counter() - t0
        kept: list[torch.Tensor] = []  # every resident step's output: its outcomes, compared after

        def resident_step() -> Any:
            out = ref_module(**inputs)
            kept.append(first_output(out).clone())
            return out
        times, _, out = timed(resident_step, args.warmup, args.steps)
        resident_ms = statistics.median(times)
        beside = copy_stream_beside(round(resident_ms * 1e6), device)

        def with_copies() -> Any:
            beside()
            return resident_step()
        copy_times = timed(with_copies, 1, args.steps)[0]
        slowdown = statistics.median(copy_times) / resident_ms - 1
        # Kept on the host, with nothing else of the reference's left on the device: the
        # recordings' and rows' torch peaks are the module's own.
        outcomes = [o.cpu() for o in distinct(kept)]
        del ref_module, out, kept, beside, with_copies
    gc.collect()
    torch.cuda.empty_cache()
    finite = all(bool(o.float().isfinite().all()) for o in outcomes)
    copies, _ = probe_copies(device)
    h2d_gbps = max(c["nbytes"] / c["ns"] for c in copies if c["dir"] == "h2d")
    result.update(resident_ms=resident_ms, resident_outcomes=len(outcomes), resident_load_s=round(load_s, 1),
                  slowdown_under_copies=slowdown,
                  h2d_gbps=h2d_gbps, reference_finite=finite, peak_resident_bytes=torch.cuda.max_memory_allocated())
    log(f"{key}: resident {resident_ms:.1f} ms, +{100 * slowdown:.1f}% beside copies, H2D {h2d_gbps:.1f} GB/s, "
        f"finite={finite}, {len(outcomes)} different output(s) over {args.warmup + 2 * args.steps + 1} steps")

    traces = {}  # one recording per kernel grouping: its kernels, and so its trace, differ
    for grouping in args.groupings:
        t0 = time.perf_counter()
        trace = engine.record(module, inputs, checkpoint=path, name=cfg.name, workload=shape,
                              grouping=grouping)
        if args.model_set:  # what the report builds to synthesize the same module
            trace = Trace({**trace.header, "model_set": args.model_set}, trace.weight_sizes, trace.records)
        traces[grouping] = trace
        suffix = "" if grouping == "block" else f"-{grouping}"
        write_trace(Path(args.out) / f"{key}{suffix}.trace.jsonl.gz", trace)
        stats = {"record_s": round(time.perf_counter() - t0, 1),
                 "recorded_compute_ms": sum(r.compute_ns for r in trace.records) / 1e6,
                 "recorded_host_ms": sum(r.host_ns for r in trace.records) / 1e6, "kernels": len(trace.records)}
        if grouping == args.groupings[0]:  # the figures the earlier results' json keep at the top
            result.update(stats)
        result.setdefault("recordings", {})[grouping] = stats
        log(f"{key}: recorded {len(trace.records)} kernels ({grouping}) in {stats['record_s']} s "
            f"({', '.join(f'{k} {v:.1f}' for k, v in trace.header['record_stages_s'].items())}): compute "
            f"{stats['recorded_compute_ms']:.1f} ms, host {stats['recorded_host_ms']:.1f} ms")
    trace = traces[args.groupings[0]]
    pred_all = predict(trace, hw, None, 2, "priority")
    result["predicted_resident_ms"] = pred_all["step_ms"]
    pipelined = trace.header.get("pipelined_step_ns")
    if pipelined and abs(pipelined / 1e6 / resident_ms - 1) > DISTURBED:
        # The recording's all-resident step (through the hooks) and the plain module's step
        # differ by the hooks' host cost only; far apart, the machine was busy while one ran.
        log(f"{key}: WARNING the recording timed its all-resident step at {pipelined / 1e6:.1f} ms against "
            f"{resident_ms:.1f} ms for the plain module: a disturbed recording; its predictions are suspect, "
            "run again")
        result["recording_disturbed"] = True

    # The API's default path once per --choose-by: eviction="auto" records the module at set-up (or
    # prices its census) and picks by simulation. The first one's figures keep the older keys.
    for choose_by in args.choose_by:
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            h = engine.offload(module, budget_mb=args.budgets[0] or None, example_inputs=inputs, checkpoint=path,
                               hardware=hw, grouping=args.auto_grouping, choose_by=choose_by)
        auto = {"auto_setup_s": round(time.perf_counter() - t0, 1), "auto_setup_stages_s": h.setup_s}
        with torch.no_grad():
            auto["auto_bitwise"] = all(one_of(first_output(module(**inputs)), outcomes) for _ in range(3))
        auto.update(auto_eviction=h.eviction, auto_lookahead=h.lookahead, auto_grouping=h.grouping,
                    auto_groupings_ms=(h.prediction or {}).get("groupings_ms"),
                    auto_predicted_ms=(h.prediction or {}).get("step_ms"))
        h.remove()
        if choose_by == args.choose_by[0]:
            result.update(auto)
        result.setdefault("auto_by", {})[choose_by] = auto
        stages = ", ".join(f"{k} {v:.1f}" for k, v in h.setup_s.items())
        log(f"{key} @ {args.budgets[0]}: eviction=auto grouping={args.auto_grouping} choose_by={choose_by} set-up "
            f"{auto['auto_setup_s']} s ({stages}; chose {h.grouping} / {auto['auto_eviction']} / "
            f"{auto['auto_lookahead']}, predicted {auto['auto_predicted_ms']:.1f} ms"
            f"{', ' + str(auto['auto_groupings_ms']) if auto['auto_groupings_ms'] else ''}), "
            f"bitwise={auto['auto_bitwise']}")
        gc.collect()
        torch.cuda.empty_cache()

    for budget, grouping, eviction, backend, ahead in [
            (b, g, e, k, la) for b in args.budgets for g in args.groupings for e in args.evictions
            for k in args.backends for la in args.lookahead]:
        trace = traces[grouping]
        try:
            pred = predict(trace, hw, round(budget * 1e6) if budget else None, ahead, eviction, backend=backend)
            synced_ms = predict(trace, hw, round(budget * 1e6) if budget else None, pred["lookahead"],
                                pred["eviction"], backend=backend, loop="synced")["step_ms"]
        except BelowFloorError as err:  # a candidate the budget cannot hold: no row, as tuning skips it
            log(f"{key} @ {budget} ({grouping}, {eviction} / {ahead}): skipped, {err}")
            continue
        torch.cuda.reset_peak_memory_stats()
        rss0 = host_rss()
        allocated = torch.cuda.memory_allocated()  # the inputs and the libraries' workspaces
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            h = engine.offload(module, budget_mb=budget or None, example_inputs=inputs, eviction=pred["eviction"],
                               lookahead=pred["lookahead"], checkpoint=path, backend=backend, grouping=grouping)
        setup_s = time.perf_counter() - t0
        h.executor.keep_steps = None  # every step's telemetry: the first (a cold pool's) peak counts
        copied = h.streamed.copied_bytes
        torch.cuda.reset_peak_memory_stats()  # the steps' peak: set-up copies each kernel in once, on its own
        with torch.no_grad():
            times, ends, out = timed(lambda: module(**inputs), args.warmup, args.steps)
            peak_torch = torch.cuda.max_memory_allocated()  # the timed steps': one output alive at a time
            output = first_output(out).cpu()
            del out
            timed_rows = h.telemetry()[-args.steps:]
            free_ms = free_running(lambda: module(**inputs), args.steps)
            free_relocations = sum(r["relocations"] for r in h.telemetry()[-args.steps:])
            if args.timeline:  # one more step with its kernels and copies timed on the device
                h.executor.time_steps = True
                module(**inputs)
                h.executor.time_steps = False
        rows = h.telemetry()
        free, total = torch.cuda.mem_get_info()
        # What the process holds beside torch's allocator and the pool, both as they are now.
        outside = total - free - torch.cuda.memory_reserved() - h.executor.backend.reserved_bytes()
        h2d = rows[-1]["h2d_bytes"]
        mean_h2d = statistics.mean(r["h2d_bytes"] for r in timed_rows)  # belady's bytes vary by step
        limit_ms = max(resident_ms * (1 + slowdown), mean_h2d / (h2d_gbps * 1e6))
        step = statistics.median(times)
        mean = statistics.mean(times)  # belady's steps differ: the prediction is their long-run mean
        counts = getattr(h.executor.backend, "map_counts", None)
        row = {"budget_mb": budget, "grouping": grouping, "backend": backend,
               "relocations": sum(r["relocations"] for r in timed_rows), "free_running_relocations": free_relocations,
               "vmm": counts() if counts else None, "eviction": pred["eviction"], "lookahead": pred["lookahead"], "step_ms": step,
               "free_running_ms": free_ms, "limit_ms": limit_ms,
               "over_limit": step / limit_ms, "predicted_ms": pred["step_ms"], "predicted_synced_ms": synced_ms,
               "mean_ms": mean, "times": times, "step_ends_unix": ends,
               "prediction_error": synced_ms / mean - 1, "candidates_ms": pred["candidates"],
               "h2d_bytes": h2d, "mean_h2d_bytes": mean_h2d, "host_copied_bytes": copied, "predicted_h2d_bytes": pred["h2d_bytes"], "setup_s": setup_s,
               "bitwise": one_of(output, outcomes),
               "max_abs_diff": min((output.float() - o.float()).abs().max().item() for o in outcomes),
               "peak_pool_bytes": max(r["peak_device_bytes"] for r in rows),
               "held_weight_bytes": max(r["held_device_bytes"] for r in rows),
               "backend_reserved_peak_bytes": h.executor.backend.reserved_peak_bytes(),
               "peak_torch_bytes": peak_torch, "allocated_before_setup": allocated,
               "predicted_peak_bytes": pred["peak_device_bytes"], "rss": host_rss(), "rss_before": rss0,
               # the process: pool + torch's allocations (activations, inputs, kept parameters) + the rest
               "process_peak_bytes": max(r["held_device_bytes"] for r in rows) + peak_torch + outside, "predicted_process_bytes": pred["peak_process_bytes"],
               "measured_timeline": h.executor.step_timeline() if args.timeline else None}
        result["rows"].append(row)
        log(f"{key} @ {budget} ({grouping}, {backend}): {pred['eviction']} lookahead {pred['lookahead']} {step:.1f} ms (mean {mean:.1f}, "
            f"limit {limit_ms:.1f}, x{step / limit_ms:.3f}), predicted {pred['step_ms']:.1f} ({100 * row['prediction_error']:+.1f}% "
            f"of the mean), H2D {row['mean_h2d_bytes'] / 1e9:.2f} GB a step (predicted {pred['h2d_bytes'] / 1e9:.2f}), set-up {setup_s:.1f} s, "
            f"bitwise={row['bitwise']} (max diff {row['max_abs_diff']:.3g}), process peak {row['process_peak_bytes'] / 1e9:.2f} GB "
            f"(predicted {row['predicted_process_bytes'] / 1e9:.2f})")
        h.remove()
        gc.collect()
        torch.cuda.empty_cache()

    if args.peer and hasattr(module, "enable_group_offload"):
        result["peer"] = peer_row(module, cfg, table, path, inputs, outcomes, args)
    return result


def peer_row(module: Any, cfg: Any, table: Any, path: Path, inputs: dict, outcomes: list[torch.Tensor],
             args: argparse.Namespace) -> dict:
    """diffusers block-level group offloading with streams, CPU weights viewing the mapping."""
    with Checkpoint(path, table) as ckpt:
        peer = build_module(cfg)
        peer.load_state_dict(ckpt.tensors(), assign=True, strict=False)
        t0 = time.perf_counter()
        peer.enable_group_offload(onload_device=torch.device("cuda"), offload_device=torch.device("cpu"),
                                  offload_type="block_level", num_blocks_per_group=1, use_stream=True)
        setup_s = time.perf_counter() - t0
        with torch.no_grad():
            times, _, out = timed(lambda: peer(**inputs), 1, max(2, args.steps // 2))
        row = {"step_ms": statistics.median(times), "setup_s": setup_s,
               "bitwise": one_of(first_output(out), outcomes), "rss": host_rss()}
        del peer, out
    gc.collect()
    torch.cuda.empty_cache()
    log(f"peer diffusers group offload: {row['step_ms']:.1f} ms, set-up {row['setup_s']:.1f} s")
    return row


def table_md(results: list[dict]) -> str:
    lines = ["| model | budget MB | backend | grouping / eviction / lookahead | synced step ms (median / mean) | limit ms | "
             "x limit | predicted synced ms | error (of the mean) | H2D GB a step (mean / predicted) | set-up s | bitwise | "
             "relocations (synced / free) | free-running ms (x limit, predicted, error) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        # measured: the plain module; predicted: the same weights all resident through our hooks
        lines.append(f"| {r['model']} | resident (plain module; predicted: through engine.offload) | - | - | "
                     f"{r['resident_ms']:.1f} | - | - | "
                     f"{r['predicted_resident_ms']:.1f} | {100 * (r['predicted_resident_ms'] / r['resident_ms'] - 1):+.1f}% "
                     f"| - | - | ref | - | - |")
        for row in r["rows"]:
            lines.append(f"| {r['model']} | {row['budget_mb'] or 'resident (engine.offload)'} | {row['backend']} | "
                         f"{row.get('grouping', 'block')} / {row['eviction']} / {row['lookahead']} | "
                         f"{row['step_ms']:.1f} / {row['mean_ms']:.1f} | "
                         f"{row['limit_ms']:.1f} | {row['over_limit']:.3f} | {synced_prediction(row):.1f} | "
                         f"{100 * row['prediction_error']:+.1f}% | {row['mean_h2d_bytes'] / 1e9:.2f} / "
                         f"{row['predicted_h2d_bytes'] / 1e9:.2f} | {row['setup_s']:.1f} | {row['bitwise']} | "
                         f"{row['relocations']} / {row.get('free_running_relocations', '-')} | {row['free_running_ms']:.1f} "
                         f"({row['free_running_ms'] / row['limit_ms']:.3f}, {row['predicted_ms']:.1f}, "
                         f"{100 * (row['predicted_ms'] / row['free_running_ms'] - 1):+.1f}%) |")
        if "peer" in r:
            p = r["peer"]
            lines.append(f"| {r['model']} | diffusers group offload | - | - | {p['step_ms']:.1f} | - | - | - | - | - | "
                         f"{p['setup_s']:.1f} | {p['bitwise']} | - | - |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="ltx2")
    ap.add_argument("--budgets", default="16000")
    ap.add_argument("--dir", default="/dev/shm", help="where the checkpoints are written (deleted after)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    ap.add_argument("--hardware", default="h100_calibrated")
    ap.add_argument("--lookahead", default="2",
                    help="kernels prefetched ahead (a comma list runs each), or auto (the simulator picks)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--peer", action="store_true")
    ap.add_argument("--backends", default="cuda", help="weight backends to run each budget on: cuda, vmm")
    ap.add_argument("--evictions", default="auto", help="eviction policies per budget (auto: the simulator's pick)")
    ap.add_argument("--groupings", default="block",
                    help="kernel groupings (block, leaf), each recorded once and run at every budget")
    ap.add_argument("--auto-grouping", default="block", choices=("block", "leaf", "auto"),
                    help="the grouping of the API's default path, run once at the first budget (auto: both "
                         "recorded, the faster kept)")
    ap.add_argument("--choose-by", default="recording",
                    help="what the API's default path simulates at set-up, a comma list runs each: recording, census")
    ap.add_argument("--timeline", action="store_true",
                    help="time one more step's kernels and copies per row (measured_timeline in the json)")
    ap.add_argument("--out", default="outputs/real_models")
    ap.add_argument("--workload", action="append", default=[], metavar="FIELD=INT",
                    help="a workload field for every model, over its default (e.g. video_tokens=16384)")
    ap.add_argument("--model-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a model config field over the yaml's (e.g. module.config.num_hidden_layers=24: fewer "
                         "of the same blocks, where the whole model's file would not fit the host)")
    args = ap.parse_args()
    if not 1 <= args.steps <= KEEP_STEPS:
        print(f"--steps {args.steps}: use 1 to {KEEP_STEPS} (the executor keeps the telemetry of its last "
              f"{KEEP_STEPS} steps)", file=sys.stderr)
        sys.exit(2)
    fields = {f.partition("=")[0]: f.partition("=")[2] for f in args.workload}
    bad = [k for k, v in fields.items() if k not in WORKLOADS["ltx2"] or k == "kind" or not v.isdigit()]
    if bad:
        print(f"--workload {bad[0]}=...: give FIELD=INT, FIELD one of "
              f"{', '.join(k for k in WORKLOADS['ltx2'] if k != 'kind')}", file=sys.stderr)
        sys.exit(2)
    args.workload = {k: int(v) for k, v in fields.items()}
    args.budgets = [float(b) for b in args.budgets.split(",")]
    args.backends = args.backends.split(",")
    args.evictions = args.evictions.split(",")
    args.groupings = args.groupings.split(",")
    args.choose_by = args.choose_by.split(",")
    args.lookahead = ["auto"] if args.lookahead == "auto" else [int(la) for la in args.lookahead.split(",")]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    hw = load_hardware(args.hardware)
    results = []
    for key in args.models.split(","):
        try:
            results.append(bench_model(key, args, hw))
        finally:
            if not args.keep:
                (Path(args.dir) / f"{key}.safetensors").unlink(missing_ok=True)
        (Path(args.out) / "real_models.json").write_text(json.dumps(
            {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%F"),
             "hardware_profile": args.hardware, "results": results}, indent=1, default=str))
    print(table_md(results))
    for line in ranking_md(results):
        print(line)


def ranking_md(results: list[dict]) -> list[str]:
    """Per model and budget with several configurations: the simulator's pick against the
    best measured, in a synced loop (the steps' mean; picked by the synced prediction) and
    free-running (steps back to back; picked by the free prediction)."""
    lines = []
    for r in results:
        for budget in sorted({row["budget_mb"] for row in r["rows"]}):
            rows = [row for row in r["rows"] if row["budget_mb"] == budget]
            if len(rows) < 2 or not budget:  # all resident (0): every configuration runs the same
                continue
            for key, what, predicted in (("mean_ms", "synced steps' mean", synced_prediction),
                                         ("free_running_ms", "free-running", lambda row: row["predicted_ms"])):
                pick = min(rows, key=predicted)
                best = min(rows, key=lambda row: row[key])
                place = sorted(row[key] for row in rows).index(pick[key]) + 1
                lines.append(f"{r['model']} at {budget:.0f}, {what}: {len(rows)} configurations; the simulator ranks "
                             f"{name(pick)} first ({pick[key]:.1f} ms, measured {place} of {len(rows)}), the best "
                             f"measured is {name(best)} ({best[key]:.1f} ms): the pick is "
                             f"{100 * (pick[key] / best[key] - 1):+.1f}%")
    return lines


def synced_prediction(row: dict) -> float:
    """The row's synced-loop prediction; rows measured before it existed (their steps
    synchronized the whole device) carry the free one."""
    return row.get("predicted_synced_ms", row["predicted_ms"])


def name(row: dict) -> str:
    return f"{row.get('grouping', 'block')}/{row['eviction']}/{row['lookahead']}/{row['backend']}"


if __name__ == "__main__":
    main()
