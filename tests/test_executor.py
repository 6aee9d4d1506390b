"""The executor on the cpu backend: bitwise outputs, decision parity, the cap, and every loud failure."""
from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from engine.errors import BelowFloorError, ExecutorError
from engine.executor import WeightExecutor, host_weights, make_backend
from engine.executor.cpu import CpuBackend
from engine.models import forward, load_spec
from engine.modes.execute import comparison, comparison_md
from engine.modes.spec_run import run_execute
from engine.policy import AccessOrder
from engine.policy.floor import floor
from engine.policy.weights import WeightResidency

STEPS = 3


def run_steps(tiny, ex: WeightExecutor, steps: int = STEPS) -> list[dict]:
    outs = []
    with torch.no_grad():
        for _ in range(steps):
            with ex.step():
                outs.append(forward(tiny.spec, ex, tiny.inputs))
    return outs


def bare_log(order: AccessOrder, budget: int | None, eviction: str, lookahead: int, steps: int = STEPS):
    policy = WeightResidency(order, budget, eviction, lookahead)
    for _ in range(steps):
        for i in range(len(order)):
            policy.issue(i)
    return policy.log


@pytest.mark.parametrize("eviction", ["lru", "belady", "priority"])
@pytest.mark.parametrize("lookahead", [0, 1, 2, 3])
def test_bitwise_outputs_parity_and_cap(tiny, eviction, lookahead):
    fl = floor(tiny.order, lookahead).bytes
    for budget in (fl, fl + 40_000, 2 * fl, None):
        ex = WeightExecutor(tiny.order, tiny.wf.tensors(), budget_bytes=budget, eviction=eviction,
                            lookahead=lookahead, backend="cpu")
        outs = run_steps(tiny, ex)
        for out in outs:
            assert out.keys() == tiny.reference.keys()
            for k in out:
                assert torch.equal(out[k], tiny.reference[k]), (eviction, lookahead, budget, k)
        assert ex.log == bare_log(tiny.order, budget, eviction, lookahead)  # decision parity
        cap = budget if budget is not None else tiny.spec.model_bytes
        assert ex.backend.reserved_peak_bytes() <= cap
        assert all(row["peak_device_bytes"] <= cap for row in ex.telemetry())
        ex.close()


def test_telemetry_counts_match_the_log(tiny):
    budget = 2 * floor(tiny.order, 2).bytes
    ex = WeightExecutor(tiny.order, tiny.wf.tensors(), budget_bytes=budget, eviction="belady", lookahead=2,
                        backend="cpu")
    run_steps(tiny, ex)
    rows = ex.telemetry()
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        step = [d for d in ex.log if d.step == r["step"]]
        assert r["hits"] == sum(d.action == "hit" for d in step)
        assert r["fetches"] == sum(d.action == "fetch" for d in step)
        assert r["prefetches"] == sum(d.action == "prefetch" for d in step)
        assert r["evictions"] == sum(d.action == "evict" for d in step)
        assert r["h2d_bytes"] == sum(tiny.order.sizes[d.target] for d in step if d.action in ("fetch", "prefetch"))
        assert r["step_ms"] > 0
        assert 0 < r["peak_resident_bytes"] <= budget
    # all resident: nothing is copied after the first step
    ex = WeightExecutor(tiny.order, tiny.wf.tensors(), budget_bytes=None, backend="cpu")
    run_steps(tiny, ex)
    assert [r["h2d_bytes"] for r in ex.telemetry()] == [tiny.spec.model_bytes, 0, 0]


@pytest.mark.parametrize("source", ["pinned", "mmap_registered", "mmap", "pageable"])
def test_every_host_source_gives_the_same_outputs(tiny, source):
    budget = floor(tiny.order, 2).bytes
    backend = CpuBackend(budget)
    host = host_weights(tiny.wf, source, backend)
    assert bool(backend.registered) == (source == "mmap_registered")
    ex = WeightExecutor(tiny.order, host.tensors, budget_bytes=budget, backend=backend)
    out = run_steps(tiny, ex, steps=2)[-1]
    assert all(torch.equal(out[k], tiny.reference[k]) for k in out)
    ex.close()
    host.close()
    assert backend.registered == {}  # unregistered on close


def test_telemetry_keeps_every_step_up_to_keep_steps_then_the_last_ones(tiny):
    """A step's telemetry stays until `keep_steps` later steps have run: the first step's
    (a cold pool's peak) is there through the first `keep_steps` steps."""
    ex = WeightExecutor(tiny.order, tiny.wf.tensors(), budget_bytes=None, eviction="priority", lookahead=2,
                        backend="cpu", keep_steps=5)
    for n in range(1, 12):
        with ex.step():
            for i in range(len(tiny.order)):
                ex.fetch(i)
        assert [r["step"] for r in ex.telemetry()] == list(range(max(0, n - 5), n))
    ex.close()


def test_below_floor_fails_at_init_with_the_exact_minimum(tiny):
    fl = floor(tiny.order, 2).bytes
    with pytest.raises(BelowFloorError, match=rf"use budget={-(-fl // 10**6)} or more") as err:
        WeightExecutor(tiny.order, tiny.wf.tensors(), budget_bytes=fl - 1, backend="cpu")
    assert err.value.floor_bytes == fl
    assert f"{fl / 1e6:.3f} MB" in str(err.value)


def executor(tiny, **kw) -> WeightExecutor:
    kw.setdefault("budget_bytes", 2 * floor(tiny.order, 2).bytes)
    return WeightExecutor(tiny.order, tiny.wf.tensors(), backend="cpu", **kw)


def test_out_of_order_fetch_names_the_first_divergent_kernel(tiny):
    ex = executor(tiny)
    with pytest.raises(ExecutorError, match=r"schedule divergence at kernel position 2: expected "
                                            rf"{tiny.order.kernels[2]}, got {tiny.order.kernels[3]} \(position 3\)"):
        with ex.step():
            ex.fetch(0)
            ex.fetch(1)
            ex.fetch(3)
    with pytest.raises(ExecutorError, match="stopped after an earlier failure"):
        with ex.step():
            pass


def test_wrong_weights_for_a_kernel_diverge(tiny):
    ex = executor(tiny)
    with pytest.raises(ExecutorError, match=r"divergence at kernel position 0: expected proj_in, got weights"):
        with ex.step():
            ex.fetch(0, names=["proj_in.weight"])


def test_a_step_that_stops_early_or_runs_long_diverges(tiny):
    ex = executor(tiny)
    with pytest.raises(ExecutorError, match=rf"the step ended after 5 of {len(tiny.order)} kernels"):
        with ex.step():
            for i in range(5):
                ex.fetch(i)
    ex = executor(tiny)
    with pytest.raises(ExecutorError, match="past the end of the step"):
        with ex.step():
            for i in list(range(len(tiny.order))) + [0]:
                ex.fetch(i)


def test_fetch_outside_a_step_and_by_name(tiny):
    ex = executor(tiny)
    with pytest.raises(ExecutorError, match="fetch outside a step"):
        ex.fetch(0)
    ex = executor(tiny)
    with pytest.raises(ExecutorError, match=f"expected {tiny.order.kernels[0]}, got kernel blocks.0.ada"):
        with ex.step():
            ex.fetch_next("blocks.0.ada")


def test_concurrent_execute_fails_at_once(tiny):
    ex = executor(tiny)
    inside, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def first() -> None:
        with ex.step():
            ex.fetch(0)
            inside.set()
            release.wait(10)
            for i in range(1, len(tiny.order)):
                ex.fetch(i)

    t = threading.Thread(target=first)
    t.start()
    assert inside.wait(10)
    with pytest.raises(ExecutorError, match="concurrent execute"):
        with ex.step():
            pass
    with pytest.raises(ExecutorError, match="another thread"):
        ex.fetch(1)  # from this thread, into the other thread's step
    release.set()
    t.join(10)
    assert not errors and len(ex.steps) == 1


def test_arena_refuses_over_the_cap_and_double_frees():
    arena = CpuBackend(1000)
    a = arena.alloc(600)
    with pytest.raises(ExecutorError, match="host arena refused 500 bytes: 600 in use of a cap of 1000"):
        arena.alloc(500)
    arena.free_after(a, arena.mark())
    arena.alloc(500)
    with pytest.raises(ExecutorError, match="freed twice"):
        arena.free_after(a, None)


def test_an_arena_smaller_than_the_budget_fails_loudly(tiny):
    budget = 2 * floor(tiny.order, 2).bytes
    ex = WeightExecutor(tiny.order, tiny.wf.tensors(), budget_bytes=budget, backend=CpuBackend(budget // 2))
    with pytest.raises(ExecutorError, match="host arena refused"):
        run_steps(tiny, ex, steps=1)


def test_host_tensors_must_match_the_order(tiny):
    host = dict(tiny.wf.tensors())
    host.pop("proj_in.bias")
    with pytest.raises(ExecutorError, match="no host tensor for weight proj_in.bias"):
        WeightExecutor(tiny.order, host, budget_bytes=None, backend="cpu")
    host["proj_in.bias"] = torch.zeros(3, dtype=torch.bfloat16)
    with pytest.raises(ExecutorError, match="proj_in.bias is 6 bytes on the host"):
        WeightExecutor(tiny.order, host, budget_bytes=None, backend="cpu")
    with pytest.raises(ExecutorError, match="weights.backend='tpu'"):
        make_backend("tpu", 10, 1)


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 64), min_size=2, max_size=7),
       reads=st.lists(st.lists(st.integers(0, 6), max_size=3), min_size=2, max_size=10),
       extra=st.integers(0, 200), lookahead=st.integers(0, 3),
       eviction=st.sampled_from(["lru", "belady", "priority"]))
def test_any_order_runs_with_parity_under_the_cap(sizes, reads, extra, lookahead, eviction):
    names = [f"w{i}" for i in range(len(sizes))]
    order = AccessOrder(tuple(f"k{i}" for i in range(len(reads))),
                        tuple(tuple(dict.fromkeys(names[j % len(names)] for j in r)) for r in reads),
                        {n: 4 * s for n, s in zip(names, sizes)})
    host = {n: torch.arange(order.sizes[n] // 4, dtype=torch.float32) + i for i, n in enumerate(names)}
    budget = floor(order, lookahead).bytes + extra
    ex = WeightExecutor(order, host, budget_bytes=budget, eviction=eviction, lookahead=lookahead, backend="cpu")
    for _ in range(3):
        with ex.step():
            for i in range(len(order)):
                got = ex.fetch(i)
                assert all(torch.equal(got[w], host[w]) for w in order.reads[i])
    assert ex.log == bare_log(order, budget, eviction, lookahead)
    assert ex.backend.reserved_peak_bytes() <= budget


def cfg(tiny, **weights):
    base = {"eviction": "belady", "lookahead": 2, "source": "mmap_registered", "file": None, "backend": "cpu"}
    return OmegaConf.create({"weights": {**base, **weights}, "workload": tiny.workload, "budget": 1.0, "seed": 0})


class _Trace:
    def __init__(self, order):
        self.order = order

    def access_order(self):
        return self.order


def test_run_execute_on_the_host_backend(tiny, tmp_path):
    c = cfg(tiny, file=str(tiny.path))
    result = run_execute(c, tiny.spec, _Trace(tiny.order), tmp_path)
    assert result["outputs_match_reference"] is True
    assert result["steps"] == 3 and result["budget_bytes"] == 1_000_000
    assert result["peak_device_bytes"] <= 1_000_000
    assert result["weight_hits"] > 0 and result["h2d_bytes"] > 0
    assert result["relocations"] == result["warm_relocations"] == 0  # a byte counter never fragments
    rows = [json.loads(line) for line in (tmp_path / "telemetry.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and {"step_ms", "h2d_bytes", "peak_device_bytes"} <= rows[0].keys()


STEPS_MS = [30.0, 10.0, 10.1, 9.9, 10.0]  # a run's steps, the first filling the pool


@pytest.mark.parametrize("warm, says", [(0, "only the first step includes"), (2, "the measured step includes")])
def test_the_report_says_whether_the_measured_step_holds_relocations(warm, says):
    """The median is over the steps after the first: a relocation there is in the measured step."""
    md = comparison_md([], {"backend": "cuda", "steps": 5, "steps_ms": STEPS_MS, "relocations": 3,
                            "warm_relocations": warm, "reserve_releases": 3})
    assert f"3 relocations, {warm} of them in the steps the median is taken over" in md and says in md
    assert "5 steps (the first fills the pool; the table shows the median of the rest: 4 steps, 9.9-10.1 ms" in md
    assert "releasing the pool's unused reserve" not in md  # each release was followed by a relocation


def test_the_report_names_the_warm_mean_where_the_policys_steps_vary():
    """belady's copies cycle: the table's step is the warm steps' mean, and a line says so."""
    md = comparison_md([], {"backend": "cuda", "steps": 5, "steps_ms": STEPS_MS, "steps_vary": True},
                       (84.56, 103.2))
    assert "the table shows the mean of the warm ones: 4 steps, 9.9-10.1 ms" in md
    assert ("- the policy's steps differ by design (predicted 84.56 to 103.20 ms): the step time, predicted and "
            "measured, is the mean of the warm steps (all but the first two), not the median") in md


def test_the_report_counts_the_refusals_the_released_reserve_answered():
    md = comparison_md([], {"backend": "cuda", "steps": 5, "steps_ms": STEPS_MS, "relocations": 1,
                            "warm_relocations": 0, "reserve_releases": 3})
    assert "- 2 pool refusals under the budget answered by releasing the pool's unused reserve" in md
    assert "- 1 relocations" in md
    assert "reserve" not in comparison_md([], {"backend": "cuda", "steps": 5, "steps_ms": STEPS_MS, "relocations": 0,
                                               "reserve_releases": 0})


def test_a_training_step_on_the_cpu_compares_weights_not_its_saves():
    """The spec declares the GPU's saves; the CPU's kernels save others: shown, not compared."""
    pred = {"mean_step_ms": 10.0, "h2d_bytes": 100, "weight_hits": 8, "d2h_bytes": 100, "pool_hits": 4}
    meas = {"backend": "cpu", "step_ms": 50.0, "h2d_bytes": 140, "weight_hits": 9, "spill_bytes": 140,
            "pool_hits": 3, "steps": 3, "steps_ms": STEPS_MS[:3]}
    rows = {r["key"]: r for r in comparison(pred, meas, training=True)}
    assert rows["weight_hits"]["relative_error"] == pytest.approx(0.125)
    assert all(rows[k]["relative_error"] is None for k in ("step_ms", "h2d_bytes", "spill_bytes", "pool_hits"))
    md = comparison_md(list(rows.values()), meas)
    assert md.count("the CPU's saves") == 5 and "the spec declares what the GPU's kernels save" in md
    inference = {r["key"]: r for r in comparison(pred, {**meas, "spill_bytes": None}, training=False)}
    assert inference["h2d_bytes"]["relative_error"] == pytest.approx(0.4)  # weights alone: exact on the CPU


def test_run_execute_materializes_small_models_and_refuses_big_ones(tiny, tmp_path):
    result = run_execute(cfg(tiny), tiny.spec, _Trace(tiny.order), tmp_path)
    assert result["outputs_match_reference"] is True and result["weights_file"] is None
    big = load_spec("ltx", SimpleNamespace(**tiny.workload))
    big_order = AccessOrder(tuple(k.name for k in big.kernels), tuple(k.weights for k in big.kernels),
                            {n: w.nbytes for n, w in big.weights.items()})
    c = cfg(tiny)
    c.budget = None
    with pytest.raises(ExecutorError, match="mode=materialize out=PATH"):
        run_execute(c, big, _Trace(big_order), tmp_path)


def test_run_execute_refuses_a_trace_of_another_model(tiny, tmp_path):
    order = AccessOrder(tiny.order.kernels[::-1], tiny.order.reads[::-1], tiny.order.sizes)
    with pytest.raises(ExecutorError, match="schedule divergence at kernel position 0"):
        run_execute(cfg(tiny, file=str(tiny.path)), tiny.spec, _Trace(order), tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_run_execute_without_a_gpu_says_what_to_do(tiny, tmp_path):
    with pytest.raises(ExecutorError, match=r"no CUDA device; use mode=simulate \(or weights.backend=cpu"):
        run_execute(cfg(tiny, backend="cuda", file=str(tiny.path)), tiny.spec, _Trace(tiny.order), tmp_path)


def test_a_timed_step_marks_every_kernel_and_copy(tiny):
    budget = floor(tiny.order, 2).bytes
    ex = WeightExecutor(tiny.order, tiny.wf.tensors(), budget_bytes=budget, eviction="lru", backend="cpu")
    with torch.no_grad():
        with ex.step():
            forward(tiny.spec, ex, tiny.inputs)
        with ex.step(timed=True):
            forward(tiny.spec, ex, tiny.inputs)
    spans = ex.step_timeline()
    kernels = [s for s in spans if s[0] == "compute"]
    copies = [s for s in spans if s[0] == "h2d"]
    assert [k[1] for k in kernels] == list(tiny.order.kernels)
    last = [d for d in ex.log if d.step == 1]
    assert [c[1] for c in copies] == [d.target for d in last if d.action in ("fetch", "prefetch")]
    assert all(0 <= a <= b for _, _, a, b in spans)
    assert all(k1[3] <= k2[2] for k1, k2 in zip(kernels, kernels[1:]))  # in order, apart
    with pytest.raises(ExecutorError, match="was not timed"):
        ex.step_timeline(0)
    ex.close()


def test_a_step_matches_when_it_equals_any_outcome_of_a_non_deterministic_resident_forward(monkeypatch) -> None:
    """The all-resident forward is run again only while a step's outputs match no outcome seen:
    a model whose own kernels have two outcomes is not called different, a wrong output is."""
    import engine.modes.execute as execute
    import engine.modes.spec_run as spec_run

    a, b = {"y": torch.tensor([1.0, 2.0])}, {"y": torch.tensor([1.0, 2.5])}
    runs = iter([a, a, b, a, a, a, a, a])
    monkeypatch.setattr(spec_run, "forward", lambda *args: next(runs))
    spec = SimpleNamespace(weights={})
    got = spec_run.resident_outcomes(spec, {}, {}, torch.device("cpu"), a, [a, a], 4)  # no rerun
    assert (got.match, got.bitwise, got.count, got.spread) == (True, True, 1, 0.0)
    got = spec_run.resident_outcomes(spec, {}, {}, torch.device("cpu"), a, [a, b, a], 4)
    assert (got.match, got.bitwise, got.count, got.spread) == (True, True, 2, 0.5)
    wrong = {"y": torch.tensor([9.0, 2.0])}
    got = spec_run.resident_outcomes(spec, {}, {}, torch.device("cpu"), a, [wrong], 4)
    assert (got.match, got.bitwise, got.count) == (False, False, 1)
    # a third outcome the reruns never gave: within the two seen outcomes' spread it passes, beyond it not
    between, beyond = {"y": torch.tensor([1.0, 2.25])}, {"y": torch.tensor([1.0, 2.75])}
    runs = iter([b] + [a] * 8)
    got = spec_run.resident_outcomes(spec, {}, {}, torch.device("cpu"), a, [between], 4)
    assert (got.match, got.bitwise, got.count, got.spread) == (True, False, 2, 0.5)
    runs = iter([b] + [a] * 8)
    got = spec_run.resident_outcomes(spec, {}, {}, torch.device("cpu"), a, [{"y": torch.tensor([1.0, 3.5])}], 4)
    assert not got.match and got.count == 2
    runs = iter([b] + [a] * 8)
    assert spec_run.resident_outcomes(spec, {}, {}, torch.device("cpu"), a, [beyond], 4).match  # 0.25 from b
    md = execute.comparison_md([], {"outputs_match_reference": True, "outputs_bitwise": False, "reference_outcomes": 3,
                                    "reference_outcomes_spread": 0.0557, "backend": "cuda", "steps": 3,
                                    "steps_ms": STEPS_MS[:3]})
    assert "outputs within the spread (not bitwise equal to any) of the all-resident forward's 3 different" in md
    assert "they differ by up to 0.0557" in md
    md = execute.comparison_md([], {"outputs_match_reference": True, "reference_outcomes": 2, "backend": "cuda",
                                    "steps": 3, "steps_ms": STEPS_MS[:3]})
    assert "outputs bitwise equal, step by step, to one of the all-resident forward's 2 different outputs" in md
