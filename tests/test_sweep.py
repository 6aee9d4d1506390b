"""Real `-m` sweeps: the summary, the Pareto plot and the optimizer's answer."""
import csv
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from engine.sweep import sweep_size


def _summary(tmp_path: Path) -> list[dict]:
    with open(tmp_path / "multirun" / "summary.csv") as f:
        return list(csv.DictReader(f))


def test_sweep_size_counts_the_grid():
    assert sweep_size(["+model=tiny", "budget=1,2,3", "weights.eviction=lru,belady"]) == 6
    assert sweep_size(["+model=tiny"]) == 1


def test_grid_sweep_writes_summary_pareto_and_winner(run_cli, tmp_path):
    r = run_cli("-m", "+model=tiny", "mode=simulate", "budget=1,2,null",
                "weights.eviction=lru,belady", "sim.timeline=false")
    assert r.returncode == 0, r.stderr
    rows = _summary(tmp_path)
    assert len(rows) == 6
    assert {row["eviction"] for row in rows} == {"lru", "belady"}
    step = {(row["eviction"], row["budget_mb"]): float(row["step_ms"]) for row in rows}
    md = (tmp_path / "multirun" / "summary.md").read_text()
    best = min(step.values())
    assert f"{best:.2f} ms predicted per step" in md
    assert (tmp_path / "multirun" / "pareto.png").stat().st_size > 10_000
    assert "[sweep] 6/6 points done" in r.stdout


def test_check_sweep_says_which_points_pass(run_cli, tmp_path):
    r = run_cli("-m", "+model=tiny", "mode=check", "budget=0.3,null", "sim.timeline=false")
    assert r.returncode == 0, r.stderr
    rows = {row["budget_mb"]: row for row in _summary(tmp_path)}
    assert rows["0.3"]["passed"] == "False" and "floor" in rows["0.3"]["failures"]
    assert rows[""]["passed"] == "True"


def test_failed_point_is_listed_not_fatal(run_cli, tmp_path):
    r = run_cli("-m", "+model=tiny", "mode=simulate", "budget=0.001,null", "sim.timeline=false")
    assert r.returncode == 0, r.stderr
    rows = _summary(tmp_path)
    assert len(rows) == 2
    assert any("under the floor" in (row["error"] or "") for row in rows)


def test_optuna_finds_the_smallest_budget_meeting_the_slo(run_cli, tmp_path):
    """Known by construction: step time falls as the budget grows; the SLO is
    the step time at one budget, so that budget is the answer."""
    budgets = [0.5, 1, 1.5, 2, 3, 4]  # tiny is 3.77 MB, its floor 0.46 MB
    steps = {}
    for b in budgets:
        r = run_cli("+model=tiny", "mode=simulate", f"budget={b}", "sim.timeline=false",
                    f"hydra.run.dir={tmp_path}/probe{b}")
        assert r.returncode == 0, r.stderr
        steps[b] = json.loads((tmp_path / f"probe{b}" / "report.json").read_text())["prediction"]["step_ms"]
    feasible = sorted(b for b in budgets if steps[b] <= steps[2])
    expected = feasible[0]
    r = run_cli("-m", "+search=min_budget", "+model=tiny", "hydra/sweeper/sampler=grid",
                f"hydra.sweeper.params.budget='choice({','.join(map(str, budgets))})'",
                f"hydra.sweeper.n_trials={len(budgets)}", f"slo.max_step_ms={steps[2]}",
                "sim.timeline=false")
    assert r.returncode == 0, r.stderr
    best = OmegaConf.load(tmp_path / "multirun" / "optimization_results.yaml")
    assert best.best_params.budget == expected
    md = (tmp_path / "multirun" / "summary.md").read_text()
    assert f"budget={expected}" in md.split("**Winner**")[1]


@pytest.mark.slow
def test_joblib_launcher_runs_points_in_parallel(run_cli, tmp_path):
    r = run_cli("-m", "+launch=local", "hydra.launcher.n_jobs=2", "+model=tiny", "mode=simulate",
                "budget=1,2,null", "sim.timeline=false")
    assert r.returncode == 0, r.stderr
    assert len(_summary(tmp_path)) == 3


@pytest.mark.slow
def test_ray_launcher_on_a_local_cluster(run_cli, tmp_path):
    pytest.importorskip("ray")
    pytest.importorskip("hydra_plugins.hydra_ray_launcher")
    r = run_cli("-m", "+launch=ray", "hydra.launcher.ray.init.num_cpus=2", "+model=tiny",
                "mode=simulate", "budget=1,null", "sim.timeline=false")
    assert r.returncode == 0, r.stderr
    assert len(_summary(tmp_path)) == 2
