"""benchmarks/peers.py end to end on the CPU with the tiny model (timings meaningless).

Checks what the table's verdicts rest on: our executor's rows and the nn.Module
wrapper the peers drive return the resident forward's outputs bit for bit, and
bench.json names the versions. diffusers/accelerate rows run only on a GPU.
"""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ("--model tiny --layers 4 --video-tokens 64 --audio-tokens 16 --text-tokens 8 --rank 4 "
         "--min-tensor-bytes 0 --steps 1 --warmup 1 --sync-layers 2 --spill-factors 1.5 --no-save-on-cpu")


def test_peers_bench_runs_on_cpu(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--device", "cpu", "--models", "tiny",
         "--budgets", "1", "--steps", "1", "--warmup", "1", "--tokens", "64", "--out", str(tmp_path),
         "--train-args", TRAIN],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert set(result["versions"]) == {"torch", "diffusers", "accelerate"}
    rows = {r["row"]: r for r in result["inference"][0]["rows"]}
    assert {"resident (compute floor)", "ours lru @1", "ours belady @1", "ours priority @1",
            "nn.Module resident (wrapper check)"} <= set(rows)
    for name, r in rows.items():
        assert "failed" not in r, (name, r)
        assert r["bitwise"] and r["max_abs_err"] == 0.0, name
    train = {r["row"]: r for r in result["training"]["rows"]}
    assert train["off"]["max_abs_grad_diff"] == 0.0 and len(train) >= 3
    assert done.stdout.rstrip().splitlines()[-1].startswith("(no-offload grad spread")
    assert "| ours priority @1 |" in done.stdout


def test_spec_module_follows_replaced_parameters() -> None:
    """An offloader that swaps in new Parameter objects in a pre-hook (accelerate does) is
    still what the forward reads: the output stays the spec forward's, bit for bit."""
    import torch
    from torch import nn

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from peers import shape, workload
    from spec_module import SpecModule

    from engine.models import forward, make_inputs
    from engine.models.run import DictSource
    from engine.models.seeded import random_weights

    spec = shape("tiny", 2, 16)
    weights = random_weights(spec, seed=0)
    inputs = make_inputs(spec, workload(16), seed=1)
    with torch.no_grad():
        ref = forward(spec, DictSource(spec, weights), inputs)
    module = SpecModule(spec, {n: torch.full_like(w, float("nan")) for n, w in weights.items()})
    linears = {id(m): m for m in module.modules() if isinstance(m, nn.Linear)}
    by_param = {}
    for name, (holder, attr, _) in module._where.items():
        by_param[id(getattr(holder, attr))] = name

    def swap(m: nn.Module, args: tuple) -> None:  # fresh Parameter objects with the real values
        for attr, p in list(m._parameters.items()):
            m._parameters[attr] = nn.Parameter(weights[by_param[id(p)]], requires_grad=False)
            by_param[id(m._parameters[attr])] = by_param[id(p)]

    hooked = [m for m in module.modules() if m._parameters and (id(m) in linears or m is not module)]
    for m in hooked + [module]:
        m.register_forward_pre_hook(swap)
    try:
        out = module(inputs)
    finally:
        module.close()
    assert all(torch.equal(out[k], ref[k]) for k in ref)
