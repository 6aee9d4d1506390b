"""How long engine.offload's choice of policy and lookahead takes, and priority's anchors.

    python benchmarks/choice_speed.py [--budget 16000]

On the spec LTX-2's synthesized trace (+model=ltx, 1,708 kernels, h100_pcie5): the
simulations `engine.modules.offload.predict` runs to choose the eviction at lookahead 2,
then to choose the lookahead too (lookahead="auto"), with their count and wall time. Then
`anchors` on 2,000 single-weight kernels of random sizes (the leaves of many shapes that
ANCHOR_GAIN keeps from pinning one weight after another).
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hydra import compose, initialize_config_dir  # noqa: E402

from engine.config import load_hardware, register  # noqa: E402
from engine.models import build_spec  # noqa: E402
from engine.modules.offload import predict  # noqa: E402
from engine.policy import AccessOrder  # noqa: E402
from engine.policy.eviction import anchors  # noqa: E402
from engine.models.synthesize import synthesize  # noqa: E402
from engine.units import budget_bytes  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=16000)
    args = ap.parse_args()
    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["model=ltx", f"budget={args.budget}"])
    trace = synthesize(build_spec(cfg.model, cfg.workload), cfg.workload, cfg.hardware)
    hw = load_hardware("h100_pcie5")
    for lookahead in (2, "auto"):
        t = time.perf_counter()
        p = predict(trace, hw, budget_bytes(args.budget), lookahead, "auto")
        print(f"lookahead={lookahead}: picks {p['eviction']}/{p['lookahead']} ({p['step_ms']:.2f} ms) after "
              f"{len(p['candidates'])} simulations in {time.perf_counter() - t:.1f} s", flush=True)
    random.seed(0)
    sizes = {f"w{i}": random.randint(1, 10**6) for i in range(2000)}
    order = AccessOrder(tuple(f"k{i}" for i in range(2000)), tuple((w,) for w in sizes), sizes)
    t = time.perf_counter()
    chosen, _ = anchors(order, sum(sizes.values()) // 2, 2)
    print(f"anchors on 2,000 kernels of random sizes: {len(chosen)} in {1e3 * (time.perf_counter() - t):.0f} ms")


if __name__ == "__main__":
    main()
