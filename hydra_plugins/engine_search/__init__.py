"""The sweepers behind `+search=min_budget` and `+search=fastest_policy` (engine/search.py).

Hydra instantiates sweepers only from the `hydra_plugins` package and imports every
module here when it starts, so this file registers their configs and imports nothing heavy.
"""
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class MinBudgetSweeperConf:
    _target_: str = "hydra_plugins.engine_search.sweepers.MinBudgetSweeper"
    # The answer is the smallest passing multiple of this; null: a round number near the
    # model's size / 128 (250 MB for LTX-2), so the bisection runs about 8 points.
    resolution_mb: Optional[float] = None


@dataclass
class FastestPolicySweeperConf:
    _target_: str = "hydra_plugins.engine_search.sweepers.FastestPolicySweeper"
    max_grid: int = 200  # a larger space is sampled by Optuna instead of run whole
    n_trials: int = 60  # points Optuna runs on a larger space
    seed: int = 0  # Optuna's sampler seed: the same points for the same command
    weights: Optional[Dict[str, str]] = None  # key -> values (a,b,c or range(...)), when a budget is given
    activations: Optional[List[Dict[str, Any]]] = field(default_factory=list)  # training: one dict per set-up


ConfigStore.instance().store(group="hydra/sweeper", name="min_budget", node=MinBudgetSweeperConf,
                             provider="offload-engine")
ConfigStore.instance().store(group="hydra/sweeper", name="fastest_policy", node=FastestPolicySweeperConf,
                             provider="offload-engine")
