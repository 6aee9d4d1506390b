"""Hydra sweepers that run engine/search.py's searches through the configured launcher."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from engine import search


class _SearchSweeper(Sweeper):
    """Launcher set-up and the sweep directory, shared by the two searches."""

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)

    def points(self, base: list[str]) -> search.Points:
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        return search.Points(self.launcher, base, sweep_dir, self.validate_batch_is_legal)


class MinBudgetSweeper(_SearchSweeper):
    def __init__(self, resolution_mb: Optional[float]):
        if resolution_mb is not None and not resolution_mb > 0:
            raise search.SearchError(f"hydra.sweeper.resolution_mb={resolution_mb}; give a positive number of MB")
        self.resolution_mb = resolution_mb

    def sweep(self, arguments: List[str]) -> Any:
        if self.config.mode != "check":
            raise search.SearchError(f"+search=min_budget needs the SLO verdict of mode=check, not mode={self.config.mode}")
        points = self.points(search.user_overrides(arguments, "min_budget", ("budget",)))
        search.write_result(points.sweep_dir, search.min_budget(points, self.resolution_mb))
        return points.rows


class FastestPolicySweeper(_SearchSweeper):
    def __init__(self, max_grid: int, n_trials: int, seed: int, weights: Optional[Dict[str, str]],
                 activations: Optional[List[Dict[str, Any]]]):
        self.max_grid, self.n_trials, self.seed = max_grid, n_trials, seed
        self.weights, self.activations = weights, activations

    def sweep(self, arguments: List[str]) -> Any:
        cfg = self.config
        space = search.policy_space(
            dict(self.weights) if self.weights and cfg.budget is not None else None,
            [dict(a) for a in self.activations] if self.activations and cfg.workload.kind == "train_lora" else None)
        owned = sorted({o.partition("=")[0] for sub in space for o in sub})
        points = self.points(search.user_overrides(arguments, "fastest_policy", owned))
        search.write_result(points.sweep_dir,
                            search.fastest_policy(points, space, self.max_grid, self.n_trials, self.seed))
        return points.rows
