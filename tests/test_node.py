"""Several GPUs of one host in the simulator: each replica's share of the node's
links, the node's host memory, the check that refuses a node over its limits,
and a sweep over node shapes."""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from engine.config import NodeConfig, load_hardware
from engine.node import node_failures, node_prediction, replica_hardware

ROOT = Path(__file__).resolve().parents[1]


def _cfg(**node):
    return OmegaConf.create({"hardware": OmegaConf.to_container(load_hardware("h100_pcie5")),
                             "node": {**OmegaConf.to_container(OmegaConf.structured(NodeConfig)),
                                      "name": "n", "source": "test", **node},
                             "weights": {"source": "mmap_registered"},
                             "activations": {"mode": "off", "pool": {"class_sizes_mb": [], "slabs_per_class": []}}})


def test_replicas_share_the_nodes_path_evenly():
    cfg = _cfg(gpus=2, shared_h2d_gbps=60.0, shared_d2h_gbps=200.0)
    hw = replica_hardware(cfg)
    assert hw.h2d_gbps == 30.0 and hw.mmap_registered_gbps == 30.0 and hw.pageable_gbps == 7.1
    assert hw.d2h_gbps == 54.2  # its own link is the narrower
    assert hw.duplex_gbps == pytest.approx(min(87.6, 30.0 + 54.2))
    assert hw.small_copy_gbps == pytest.approx([g * 30 / 54.4 for g in cfg.hardware.small_copy_gbps])
    assert replica_hardware(_cfg(gpus=2)) is cfg.hardware or replica_hardware(_cfg(gpus=2)).h2d_gbps == 54.4
    assert replica_hardware(_cfg(gpus=1, shared_h2d_gbps=100.0)).h2d_gbps == 54.4


def test_the_weight_file_is_held_once_and_pools_once_a_replica():
    pred = {"step_ms": 500.0, "h2d_bytes": 20e9}
    mapped = node_prediction(_cfg(gpus=4, pinned_budget_mb=30_000), pred, model_bytes=40_000_000_000)
    assert mapped["host_weight_bytes"] == 40e9 and mapped["pinned_bytes"] == 40e9
    assert mapped["steps_per_s"] == 8.0 and mapped["h2d_gbps"] == 160.0
    assert node_failures(mapped) == ["4 replicas pin 40.00 GB of host memory, over node.pinned_budget_mb (30.00 GB)"]
    cfg = _cfg(gpus=4, host_ram_mb=100_000)
    cfg.weights.source = "pinned"
    copied = node_prediction(cfg, pred, model_bytes=40_000_000_000)
    assert copied["host_weight_bytes"] == copied["pinned_bytes"] == 160e9
    assert "need 160.00 GB of host RAM" in node_failures(copied)[0]


def test_a_node_in_simulate_and_check(run_cli, tmp_path):
    # the roofline profile keeps the tiny model link-bound (with the kernel table it is host-bound)
    r = run_cli("+model=tiny", "budget=2", "node=h200x2", "node.shared_h2d_gbps=0.2", "sim.timeline=false",
                "hardware.kernel_table=null")
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    node = report["node"]
    assert node["gpus"] == 2 and node["host_weight_bytes"] == report["model_bytes"]
    assert node["replica_step_ms"] == report["prediction"]["step_ms"] and "## Node" in r.stdout
    one = run_cli("+model=tiny", "budget=2", "sim.timeline=false", "hardware.kernel_table=null",
                  "hydra.run.dir=" + str(tmp_path / "one"))
    single = json.loads((tmp_path / "one" / "report.json").read_text())
    assert "node" not in single and single["prediction"]["step_ms"] < node["replica_step_ms"]
    bad = run_cli("+model=tiny", "budget=2", "node=h200x2", "node.pinned_budget_mb=1", "mode=check",
                  "sim.timeline=false")
    assert bad.returncode == 1 and "check failed: 2 replicas pin" in bad.stderr
    assert one.returncode == 0


def test_a_sweep_over_node_shapes_names_the_most_steps_a_second(run_cli, tmp_path):
    r = run_cli("-m", "+model=tiny", "node=single,h200x2", "budget=2", "sim.timeline=false")
    assert r.returncode == 0, r.stderr
    assert "Most steps a second: job 1" in r.stdout and "2 replica(s) on h200x2" in r.stdout
    rows = list(csv.DictReader((tmp_path / "multirun" / "summary.csv").open()))
    assert [row["gpus"] for row in rows] == ["1", "2"]


def test_execute_refuses_replicas_that_would_pin_more_than_the_node_allows(run_cli, tmp_path):
    r = run_cli("+model=tiny", "mode=execute", "budget=2", "weights.backend=cpu", "node=h200x2",
                "node.pinned_budget_mb=1", "workload.video_tokens=64", "workload.audio_tokens=16",
                "workload.text_tokens=8")
    assert r.returncode == 2 and "2 replicas pin" in r.stderr and "raise the node's limit" in r.stderr
    assert not (tmp_path / "run" / "telemetry.jsonl").exists()


def test_each_replicas_pool_is_cut_to_its_share_of_the_nodes_pinned_budget(run_cli, tmp_path):
    """tiny: 3.77 MB of registered weights, a 64.5 MB exact pool a replica; 83.77 MB for
    the node leaves each of 2 replicas 40 MB, and the spills past it miss."""
    r = run_cli("+model=tiny", "workload=train_lora", "activations=sync", "activations.num_offload_layers=2",
                "budget=2", "node=h200x2", "node.pinned_budget_mb=83.773248", "mode=check", "sim.timeline=false")
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert "(at most 40.0 MB: activations.pool.max_mb)" in r.stdout
    assert report["prediction"]["pool_misses"] > 0
    node = report["node"]
    assert node["pinned_budget_bytes"] - 4e6 < node["pinned_bytes"] <= node["pinned_budget_bytes"]
    bad = run_cli("+model=tiny", "workload=train_lora", "activations=sync", "activations.num_offload_layers=2",
                  "budget=2", "node=h200x2", "node.pinned_budget_mb=3", "sim.timeline=false")
    assert bad.returncode == 2 and "leaves no pinned memory for the activation pools" in bad.stderr


def test_torchrun_runs_a_replica_a_process_each_in_its_own_directory(tmp_path):
    """`torchrun --nproc-per-node 2 -m engine ... mode=execute`: two replicas at once, each
    with its report (the node's prediction beside its own measurement) under /rank<RANK>."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "engine",
                        "+model=tiny", "mode=execute", "budget=2", "weights.backend=cpu", "node=h200x2",
                        "workload.video_tokens=64", "workload.audio_tokens=16", "workload.text_tokens=8",
                        f"hydra.run.dir={tmp_path}/run${{replica:}}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    reports = [json.loads((tmp_path / "run" / f"rank{k}" / "report.json").read_text()) for k in range(2)]
    assert all(rep["node"]["gpus"] == 2 and rep["measurement"]["steps"] >= 1 for rep in reports)
