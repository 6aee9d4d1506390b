"""Real `-m` sweeps and searches: one line per point, a summary that answers the
question, exit codes, the Pareto front, and the searches' exactness."""
import csv
import json
import re
from pathlib import Path

import pytest

from engine.search import auto_resolution, bisect, budget_range, grid, policy_space
from engine.sweep import sweep_size
from engine.sweep_summary import pareto_front

POINT = re.compile(r"^\[\s*\d+(/(<=)?\d+)?\] ")


def _summary(tmp_path: Path) -> list[dict]:
    with open(tmp_path / "multirun" / "summary.csv") as f:
        return list(csv.DictReader(f))


def _point_lines(stdout: str) -> list[str]:
    return [ln for ln in stdout.splitlines() if POINT.match(ln)]


def test_sweep_size_counts_the_grid():
    assert sweep_size(["+model=tiny", "budget=1,2,3", "weights.eviction=lru,belady"]) == 6
    assert sweep_size(["+model=tiny"]) == 1


def test_grid_sweep_prints_one_line_per_point_and_names_the_fastest(run_cli, tmp_path):
    r = run_cli("-m", "model=tiny", "mode=simulate", "budget=1,2,null",
                "weights.eviction=lru,belady", "sim.timeline=false")
    assert r.returncode == 0, r.stderr
    lines = _point_lines(r.stdout)
    assert len(lines) == 6 and lines[0].startswith("[1/6]") and lines[-1].startswith("[6/6]")
    assert "## Plan" not in r.stdout and "| what" not in r.stdout  # the full reports stay in the point dirs
    assert len(r.stdout.splitlines()) <= 6 + 4
    rows = _summary(tmp_path)
    assert len(rows) == 6 and {row["eviction"] for row in rows} == {"lru", "belady"}
    best = min(float(row["step_ms"]) for row in rows)
    assert "Fastest: job" in r.stdout and f"{best:.2f} ms per step" in r.stdout
    assert "Pareto front" in (tmp_path / "multirun" / "summary.md").read_text()
    assert (tmp_path / "multirun" / "pareto.png").stat().st_size > 10_000
    for job in range(6):
        assert (tmp_path / "multirun" / str(job) / "report.md").read_text().startswith("# tiny / infer on")


def test_check_sweep_names_the_smallest_passing_budget(run_cli, tmp_path):
    r = run_cli("-m", "model=tiny", "mode=check", "budget=0.3,2,null", "weights=priority", "sim.timeline=false")
    assert r.returncode == 0, r.stderr
    rows = {row["budget_mb"]: row for row in _summary(tmp_path)}
    assert rows["0.3"]["passed"] == "False" and "floor" in rows["0.3"]["failures"]
    assert rows["2.0"]["passed"] == "True" and rows[""]["passed"] == "True"
    assert "Smallest budget that passes slo=default" in r.stdout and "budget 2 MB" in r.stdout
    lines = _point_lines(r.stdout)
    assert sum("PASS" in ln for ln in lines) == 2 and sum("FAIL: budget 0.3 MB" in ln for ln in lines) == 1


def test_check_sweep_where_no_point_passes_exits_1_with_the_closest(run_cli, tmp_path):
    r = run_cli("-m", "model=tiny", "mode=check", "budget=1,2", "slo.max_step_ms=0.01", "sim.timeline=false")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "No point meets slo=default (step <= 0.01 ms). Closest: job 1 (budget 2 MB" in r.stdout
    assert (tmp_path / "multirun" / "summary.md").is_file()


def test_failed_point_is_listed_not_fatal(run_cli, tmp_path):
    r = run_cli("-m", "model=tiny", "mode=simulate", "budget=0.001,null", "sim.timeline=false")
    assert r.returncode == 0, r.stderr
    rows = _summary(tmp_path)
    assert len(rows) == 2
    assert any("under the floor" in (row["error"] or "") for row in rows)
    assert any("error: budget 0.001 MB is under the floor" in ln for ln in _point_lines(r.stdout))


def test_a_plan_sweep_ranks_nothing_and_exits_0(run_cli, tmp_path):
    r = run_cli("-m", "model=tiny", "mode=plan", "weights.eviction=priority,lru")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Every point ran (mode=plan); none predicts a step time" in r.stdout and len(_summary(tmp_path)) == 2


def test_pareto_front_is_the_non_dominated_points():
    def row(job, budget, step, error=None):
        return {"job": job, "budget_mb": budget, "model_mb": 100.0, "step_ms": step, "error": error}

    rows = [row(0, 10, 50), row(1, 10, 40), row(2, 20, 45), row(3, 20, 30), row(4, 30, 30),
            row(5, None, 10), row(6, 40, 35), row(7, 5, 1, error="boom"), row(8, 50, 20)]
    front = pareto_front(rows)
    assert [r["job"] for r in front] == [1, 3, 8, 5]
    for r in rows:  # every other point is dominated by a front point
        if r in front or r["error"]:
            continue
        budget = r["budget_mb"] if r["budget_mb"] is not None else 100.0
        assert any((f["budget_mb"] or 100.0) <= budget and f["step_ms"] <= r["step_ms"] for f in front)


@pytest.mark.parametrize("answer", [1, 2, 37, 99, 100])
def test_bisection_finds_the_smallest_passing_point_in_log_steps(answer):
    asked = []

    def passes(k):
        asked.append(k)
        return k >= answer

    assert bisect(passes, 0, 100) == answer
    assert len(asked) <= 7 and 0 not in asked and 100 not in asked


def test_budget_range_brackets_the_floor_and_the_model():
    lo, hi = budget_range(469.852, 37752.3, 250)
    assert lo * 250 < 469.852 <= (lo + 1) * 250 and hi * 250 >= 37752.3 > (hi - 1) * 250
    assert auto_resolution(37752.3) == 250 and auto_resolution(3.77) == 0.025


def _search_answer(stdout: str) -> float:
    m = re.search(r"Smallest budget that meets slo=\S+ \(step <= [\d.]+ ms\): ([\d.]+) MB, to ([\d.]+) MB", stdout)
    assert m, stdout
    return float(m.group(1)), float(m.group(2))


@pytest.mark.slow
def test_min_budget_search_is_exact_and_reproducible(run_cli, tmp_path):
    """The answer passes, one resolution below it fails, and a second search agrees."""
    # the roofline profile: the tiny model's steps then follow its budget, not host time
    slo = ("slo.max_step_ms=3.3", "weights=priority", "sim.timeline=false", "hardware.kernel_table=null")
    r = run_cli("-m", "model=tiny", "+search=min_budget", *slo)
    assert r.returncode == 0, (r.stdout, r.stderr)
    answer, res = _search_answer(r.stdout)
    lines = _point_lines(r.stdout)
    assert lines[0].startswith("[1] everything resident") and len(lines) <= 9
    assert json.loads((tmp_path / "multirun" / "search.json").read_text())["answer_mb"] == answer
    again = run_cli("-m", "model=tiny", "+search=min_budget", *slo, f"hydra.sweep.dir={tmp_path}/again")
    assert _search_answer(again.stdout) == (answer, res)
    for budget, code in ((answer, 0), (round(answer - res, 6), 1)):
        check = run_cli("model=tiny", "mode=check", f"budget={budget}", *slo, f"hydra.run.dir={tmp_path}/c{budget}")
        assert check.returncode == code, (budget, check.stdout[-500:])


def test_min_budget_search_under_an_auto_lookahead_starts_at_the_smallest_lookaheads_floor(run_cli, tmp_path):
    """weights=auto runs a budget under lookahead 2's floor at lookahead 1: the search finds it."""
    r = run_cli("-m", "model=tiny", "+search=min_budget", "slo.max_step_ms=100", "sim.timeline=false",
                "hardware.kernel_table=null")
    assert r.returncode == 0, (r.stdout, r.stderr)
    answer, _ = _search_answer(r.stdout)
    assert 0.263424 <= answer < 0.461568  # the tiny model's floors at lookahead 1 and 2 (mode=plan)


def test_min_budget_search_that_nothing_meets_exits_1_with_the_closest_point(run_cli, tmp_path):
    r = run_cli("-m", "model=tiny", "+search=min_budget", "slo.max_step_ms=0.01", "sim.timeline=false")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "No budget meets slo=default (step <= 0.01 ms), not even everything resident. Closest: job 0" in r.stdout
    assert len(_point_lines(r.stdout)) == 1


@pytest.mark.parametrize("args, fragment", [
    (("budget=1,2",), "budget=1,2 sweeps values, but +search=min_budget chooses the points itself"),
    (("budget=3",), "+search=min_budget chooses budget itself; drop budget=3"),
    (("mode=simulate",), "needs the SLO verdict of mode=check"),
])
def test_min_budget_search_refuses_what_it_chooses(run_cli, tmp_path, args, fragment):
    r = run_cli("-m", "model=tiny", "+search=min_budget", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [lines[0]] and lines[0].startswith("error: ") and fragment in lines[0], r.stderr


def test_policy_space_is_the_weights_grid_times_each_activation_setup():
    space = policy_space({"weights.eviction": "lru,priority", "weights.lookahead": "range(1,4)"},
                         [{"activations": "off"}, {"activations": "sync", "activations.num_offload_layers": "1,2"}])
    points = grid(space)
    assert len(points) == 2 * 3 * (1 + 2) and len({tuple(p) for p in points}) == len(points)
    assert ["weights.eviction=priority", "weights.lookahead=3", "activations=sync",
            "activations.num_offload_layers=2"] in points
    assert grid(policy_space(None, [{"activations": "off"}])) == [["activations=off"]]
    assert policy_space(None, None) == []


def test_fastest_policy_search_runs_the_whole_grid(run_cli, tmp_path):
    r = run_cli("-m", "model=tiny", "budget=2", "+search=fastest_policy", "sim.timeline=false",
                'hydra.sweeper.weights={weights.eviction:"lru,priority",weights.lookahead:"1,2"}')
    assert r.returncode == 0, (r.stdout, r.stderr)
    rows = _summary(tmp_path)
    assert sorted((row["eviction"], row["lookahead"]) for row in rows) == [
        ("lru", "1"), ("lru", "2"), ("priority", "1"), ("priority", "2")]
    best = min(rows, key=lambda row: float(row["step_ms"]))
    assert f"Fastest within slo=default: job {best['job']} (budget 2 MB, {best['eviction']} lookahead" in r.stdout
    assert _point_lines(r.stdout)[0].startswith("[1/4]")


def test_fastest_policy_search_samples_a_large_space_with_optuna(run_cli, tmp_path):
    pytest.importorskip("optuna", reason="needs the optuna extra: pip install 'offload-engine[optuna]'")
    r = run_cli("-m", "model=tiny", "budget=2", "+search=fastest_policy", "sim.timeline=false",
                "hydra.sweeper.max_grid=4", "hydra.sweeper.n_trials=3")
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert len(_summary(tmp_path)) == 3 and len(_point_lines(r.stdout)) == 3
    assert "Optuna (TPE) sampled 3 of the 15 points" in r.stdout
    assert "objective" not in r.stdout and "alembic" not in r.stderr.lower()


def test_fastest_policy_search_with_nothing_to_choose_is_refused(run_cli):
    r = run_cli("-m", "model=tiny", "+search=fastest_policy")
    assert r.returncode == 2 and "has nothing to choose" in r.stderr


@pytest.mark.slow
def test_joblib_launcher_runs_points_in_parallel(run_cli, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher",
                        reason="needs the local extra: pip install 'offload-engine[local]'")
    r = run_cli("-m", "+launch=local", "hydra.launcher.n_jobs=2", "model=tiny", "mode=simulate",
                "budget=1,2,null", "sim.timeline=false")
    assert r.returncode == 0, r.stderr
    assert len(_summary(tmp_path)) == 3


@pytest.mark.slow
def test_ray_launcher_on_a_local_cluster(run_cli, tmp_path):
    pytest.importorskip("ray", reason="needs the ray extra: pip install 'offload-engine[ray]'")
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="needs the ray extra")
    r = run_cli("-m", "+launch=ray", "hydra.launcher.ray.init.num_cpus=2", "model=tiny",
                "mode=simulate", "budget=1,null", "sim.timeline=false")
    assert r.returncode == 0, r.stderr
    assert len(_summary(tmp_path)) == 2


def test_an_execute_points_step_is_the_measured_one_with_the_prediction_beside_it(tmp_path):
    from engine.sweep_summary import point_row

    job = tmp_path / "0"
    job.mkdir()
    report = {"config": {"model": "ltx", "mode": "execute", "budget_mb": 8000, "eviction": "priority", "lookahead": 1},
              "floor_bytes": 268_476_416, "model_bytes": 37_752_782_848,
              "prediction": {"step_ms": 560.02, "stall_ms": 175.3, "overlap": 0.686, "h2d_bytes": 30_022_828_032},
              "measurement": {"step_ms": 554.41, "h2d_bytes": 30_022_828_032}}
    (job / "report.json").write_text(json.dumps(report))
    row = point_row(job)
    assert row["step_ms"] == 554.41 and row["predicted_step_ms"] == 560.02 and row["stall_ms"] is None
    report["config"]["mode"] = "simulate"
    del report["measurement"]
    (job / "report.json").write_text(json.dumps(report))
    assert point_row(job)["step_ms"] == point_row(job)["predicted_step_ms"] == 560.02


def test_a_sweep_over_recordings_names_each_points_trace(tmp_path):
    """A module recorded once per grouping, both recordings swept (`trace=A,B`): the summary
    says which recording each point replays, and only when there is more than one."""
    from engine.sweep_summary import Answer, point_row, write_summary

    rows = []
    for job, (trace, step) in enumerate((("rec-block/trace.jsonl", 250.0), ("rec-leaf/trace.jsonl", 240.0))):
        d = tmp_path / str(job)
        d.mkdir()
        (d / "report.json").write_text(json.dumps({
            "config": {"model": "flux_diffusers", "trace": trace, "mode": "simulate", "budget_mb": 12000,
                       "eviction": "priority", "lookahead": 2},
            "floor_bytes": 10**9, "model_bytes": 2 * 10**10, "prediction": {"step_ms": step}}))
        rows.append(point_row(d))
    assert [r["trace"] for r in rows] == ["rec-block/trace.jsonl", "rec-leaf/trace.jsonl"]
    write_summary(tmp_path, rows, Answer(), None)
    header = next(ln for ln in (tmp_path / "summary.md").read_text().splitlines() if ln.startswith("| job"))
    assert "| trace " in header
    write_summary(tmp_path, rows[:1], Answer(), None)
    header = next(ln for ln in (tmp_path / "summary.md").read_text().splitlines() if ln.startswith("| job"))
    assert "trace" not in header
