"""mode=simulate (the prediction) and mode=check (the prediction held against an SLO)."""
from __future__ import annotations

from typing import Any

from engine.choice import Choice
from engine.errors import ConfigError
from engine.job import Job, Outcome, plan_report
from engine.node import node_failures, node_prediction, replica_hardware
from engine.report import fmt_bytes, plan_md, table


def run_simulation(job: Job, allow_below_floor: bool, write_timeline: bool = True) -> Any:
    """The simulator's run of the job (a SimResult); writes the timeline unless a sweep
    runs (or `write_timeline` is false: see `timeline_files`)."""
    from sim import simulate

    cfg = job.cfg
    if job.simulated is not None and job.simulated[0] == allow_below_floor:
        result = job.simulated[1]  # weights=auto simulated this very run to choose it
    else:
        result = simulate(job.trace, cfg.weights, cfg.activations, replica_hardware(cfg),
                          budget_bytes=job.plan.budget_bytes, steps=cfg.workload.steps,
                          allow_below_floor=allow_below_floor, loop=cfg.workload.loop)
    if write_timeline:
        timeline_files(job, result)
    return result


def timeline_files(job: Job, result: Any, measured: list | None = None) -> None:
    """timeline.json and timeline.png of `result` (and `measured`, the executor's timed
    last step, beside it), unless sim.timeline says no (by default: in a sweep)."""
    from sim.timeline import plot_timeline, write_chrome_trace

    timeline = job.cfg.sim.timeline
    if timeline is None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        timeline = HydraConfig.get().mode != RunMode.MULTIRUN
    if timeline:
        try:
            write_chrome_trace(result, job.out_dir / "timeline.json", measured)
            plot_timeline(result, job.out_dir / "timeline.png", measured)
        except OSError as e:
            raise ConfigError(f"cannot write the timeline in {job.out_dir}: {e.strerror or e}; free space or "
                              "pick a writable hydra.run.dir (sim.timeline=false skips it)") from None


BOUND_BY = {"compute": "the GPU's compute",
            "copies": "the copies (the link)",
            "host": "the host (its work fills the step: a slower host lengthens it as much)"}


def prediction_md(pred: dict, job: Job) -> str:
    """The prediction table of the job's run (its eviction policy, its activations' pinned pool)."""
    cfg = job.cfg
    from sim.prediction import steps_vary

    lo, hi = pred["step_ms_range"]
    varies = steps_vary(pred)  # the decisions do not repeat (belady): say the long run
    rows = [
        ["step time" + (" (synced loop: the host waits for each step's end)" if cfg.workload.loop == "synced" else ""),
         f"{pred['step_ms']:.2f} ms (first step {pred['first_step_ms']:.2f} ms)"],
        *([["warm steps vary (the long run: simulate more with workload.steps=16)",
            f"mean {pred['mean_step_ms']:.2f} ms, {lo:.2f} to {hi:.2f} ms"]] if varies else []),
        ["compute", f"{pred['compute_ms']:.2f} ms"],
        ["stall (compute waiting on copies)", f"{pred['stall_ms']:.2f} ms"],
        ["host wait (compute waiting on the host's launches)", f"{pred['host_wait_ms']:.2f} ms"],
        ["host work (launches, hooks, fetches)", f"{pred['host_ms']:.2f} ms ({pred['host_ms'] / pred['step_ms']:.0%} "
                                                 "of the step)" if pred["step_ms"] else f"{pred['host_ms']:.2f} ms"],
        ["bound by", BOUND_BY[pred["bound_by"]]],
        ["overlap (copy time hidden)", f"{pred['overlap']:.1%}"],
        ["H2D / D2H per step", f"{fmt_bytes(pred['h2d_bytes'])} / {fmt_bytes(pred['d2h_bytes'])}"],
        ["peak device bytes (weights pool, saved activations)",
         f"{pred['peak_device_bytes']:,} ({fmt_bytes(pred['peak_device_bytes'])})"],
        ["peak process bytes (+ activations in flight, CUDA context)",
         f"{pred['peak_process_bytes']:,} ({fmt_bytes(pred['peak_process_bytes'])})"],
        ["device bytes at most (the weight pool at its cap, its slack included)",
         f"{pred['device_bound_bytes']:,} ({fmt_bytes(pred['device_bound_bytes'])})"],
        ["activations kept / spilled", f"{pred['kept']} / {pred['spilled']}"],
        ["pool hits / misses", f"{pred['pool_hits']} / {pred['pool_misses']}"],
        *([["pinned pool", _pool_md(cfg.activations.pool)]] if cfg.activations.mode != "off" else []),
        ["hazards", f"{len(pred['hazards'])}"],
    ]
    md = [f"## Prediction ({cfg.weights.eviction}, steady state)", "", table(["what", "predicted"], rows)]
    if job.choice is not None:
        md += ["", choice_md(job.choice)]
    if pred["hazards"]:
        md += ["", "Use-after-evict hazards (budget under the floor):", "",
               table(["time (ms)", "kernel", "weight", "evicted by"],
                     [[f"{h['time_ms']:.3f}", h["kernel"], h["weight"], h["evicted_by"]]
                      for h in pred["hazards"][:20]])]
        if len(pred["hazards"]) > 20:
            md.append(f"... and {len(pred['hazards']) - 20} more in report.json")
    return "\n".join(md)


def choice_md(choice: Choice) -> str:
    """What weights.eviction=auto / weights.lookahead=auto chose, beside every candidate, fastest
    first (the chosen one first among those its rounded figure ties)."""
    chosen = f"{choice.eviction}/{choice.lookahead}"
    ranked = sorted(choice.candidates_ms.items(), key=lambda kv: (kv[1], kv[0] != chosen))
    chose = "weights=auto" if len(choice.chose) == 2 else f"weights.{choice.chose[0]}=auto"
    return (f"{chose} chose {choice.eviction} at lookahead {choice.lookahead}, the fastest predicted "
            "(eviction/lookahead, long-run mean step): " + ", ".join(f"{c} {ms:.2f} ms" for c, ms in ranked)
            + " (pin them with weights.eviction=NAME weights.lookahead=N)")


def _pool_md(pool: Any) -> str:
    sizes, slabs = list(pool.class_sizes_mb), list(pool.slabs_per_class)
    pinned = round(sum(s * n for s, n in zip(sizes, slabs)) * 1e6)
    cap = f" (at most {fmt_bytes(round(pool.max_mb * 1e6))}: activations.pool.max_mb)" if pool.max_mb is not None else ""
    return f"{len(sizes)} size classes, {sum(slabs)} slabs, {fmt_bytes(pinned)}{cap}"


def prediction_report(job: Job, pred: dict, result: Any) -> dict:
    """The report of a simulated job: its head, the prediction, the decisions a step,
    and on a node of several GPUs its figures."""
    report = {**plan_report(job), "prediction": pred,
              "decisions_per_step": len(result.decisions) // job.cfg.workload.steps}
    if _on_a_node(job):
        report["node"] = node_prediction(job.cfg, pred, sum(job.trace.weight_sizes.values()))
    return report


def _on_a_node(job: Job) -> bool:
    node = job.cfg.node
    return node.gpus > 1 or node.pinned_budget_mb is not None or node.host_ram_mb is not None


def node_md(figures: dict, job: Job) -> str:
    node = job.cfg.node
    rows = [["replicas", f"{figures['gpus']} on {node.name} ({node.source})"],
            ["each replica's step", f"{figures['replica_step_ms']:.2f} ms"],
            ["node throughput", f"{figures['steps_per_s']:.2f} steps/s, H2D {figures['h2d_gbps']:.1f} GB/s in all"],
            ["host RAM (weights once if mapped, pinned pools)", fmt_bytes(figures["host_bytes"])
             + ("" if figures["host_ram_bytes"] is None else f" of {fmt_bytes(figures['host_ram_bytes'])}")],
            ["pinned host memory", fmt_bytes(figures["pinned_bytes"])
             + ("" if figures["pinned_budget_bytes"] is None else f" of {fmt_bytes(figures['pinned_budget_bytes'])}")]]
    return "## Node\n\n" + table(["what", "predicted"], rows)


def simulate_mode(job: Job) -> Outcome:
    result = run_simulation(job, job.cfg.sim.allow_below_floor)
    pred = result.prediction
    report = prediction_report(job, pred, result)
    md = plan_md(job.plan.as_dict()) + "\n\n" + prediction_md(pred, job)
    if "node" in report:
        md += "\n\n" + node_md(report["node"], job)
    return Outcome(report, md)


def slo_failures(job: Job, pred: dict) -> list[str]:
    """One line per SLO condition the prediction breaks."""
    slo, cfg, out = job.cfg.slo, job.cfg, []
    longest = pred["step_ms_range"][1]  # every warm step must meet it (belady's differ); >= the last step
    if slo.max_step_ms is not None and longest > slo.max_step_ms:
        which = "step time" if longest == pred["step_ms"] else "the longest warm step"
        out.append(f"{which} {longest:.2f} ms exceeds slo.max_step_ms={slo.max_step_ms}")
    if slo.min_overlap is not None and pred["overlap"] < slo.min_overlap:
        out.append(f"overlap {pred['overlap']:.3f} is under slo.min_overlap={slo.min_overlap}")
    if slo.max_stall_ms is not None and pred["stall_ms"] > slo.max_stall_ms:
        out.append(f"stall {pred['stall_ms']:.2f} ms exceeds slo.max_stall_ms={slo.max_stall_ms}")
    device = cfg.hardware.device_memory_mb * 1_000_000
    if slo.require_fits_device and pred["peak_process_bytes"] > device:
        out.append(f"peak process bytes {fmt_bytes(pred['peak_process_bytes'])} (weights "
                   f"{fmt_bytes(pred['peak_device_bytes'])}, activations and the CUDA context) exceed the "
                   f"{cfg.hardware.name}'s {fmt_bytes(device)}")
    elif slo.require_fits_device and pred["device_bound_bytes"] > device:
        out.append(f"the device may have to hold {fmt_bytes(pred['device_bound_bytes'])}: the process peak "
                   f"{fmt_bytes(pred['peak_process_bytes'])} with the weight pool at its cap (its slack against "
                   f"fragmentation, which the driver reserves as placement needs), over the {cfg.hardware.name}'s "
                   f"{fmt_bytes(device)}; lower the budget, or weights.backend=vmm (its slack is predicted)")
    if slo.require_above_floor and job.plan.below_floor:
        out.append(f"budget {cfg.budget} MB is under the floor "
                   f"{job.plan.floor.bytes / 1e6:.3f} MB ({' + '.join(job.plan.floor.kernels)})")
    if pred["hazards"]:
        first = pred["hazards"][0]
        out.append(f"{len(pred['hazards'])} use-after-evict hazards, first: {first['weight']} "
                   f"read by {first['kernel']} evicted by {first['evicted_by']}")
    return out


def check_mode(job: Job) -> Outcome:
    # Below the floor the check still simulates, to show why it fails.
    result = run_simulation(job, allow_below_floor=True)
    pred = result.prediction
    report = prediction_report(job, pred, result)
    failures = slo_failures(job, pred) + (node_failures(report["node"]) if "node" in report else [])
    report["check"] = {"passed": not failures, "failures": failures, "slo": job.cfg.slo.name}
    verdict = "PASS: every condition of slo=" + job.cfg.slo.name + " holds" if not failures else \
        "FAIL:\n" + "\n".join(f"- {f}" for f in failures)
    md = (plan_md(job.plan.as_dict()) + "\n\n" + prediction_md(pred, job)
          + ("\n\n" + node_md(report["node"], job) if "node" in report else "")
          + "\n\n## Check\n\n" + verdict)
    return Outcome(report, md, exit_code=1 if failures else 0,
                   notes=tuple(f"check failed: {f}" for f in failures))
