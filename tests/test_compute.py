"""The compute model: kernel times by op and shape from a measured table (engine/compute.py)."""
from __future__ import annotations

from dataclasses import replace

import json
import math

import pytest
import torch
from omegaconf import OmegaConf

from engine.calibrate_kernels import fit_kernel_table, fit_pass_cost, write_kernel_table
from engine.compute import (BACKWARD, PASSES, TILE, TRAINING, AttentionTiling, PassCost, core_flops, features,
                            rate_keys, work)
from engine.kernel_time import ExecutionTimePredictor, KernelTable, Point, load_table, table_from_measurements
from engine.config import load_hardware
from engine.errors import ConfigError, TraceError
from engine.models import load_spec
from engine.models.synthesize import synthesize
from engine.trace import KernelRecord, read_trace
from tests.conftest import ROOT

FULL = ROOT / "data" / "traces" / "full"


def _roofline(**kw):
    return OmegaConf.create({"matmul_tflops": 500.0, "hbm_gbps": 2000.0, "kernel_table": None, **kw})


def test_an_exact_shape_takes_the_median_rate_of_its_measurements():
    f = features("linear", (64, 1024, 1024), 0)
    t = table_from_measurements([("linear", f, 1000, 10), ("linear", f, 1000, 20), ("linear", f, 1000, 40)], "t")
    assert t.rate("linear", f) == 1000 / 20


def test_between_two_points_the_rate_is_their_inverse_distance_mean_in_log_space():
    a, b = features("linear", (64, 1024, 1024), 0), features("linear", (256, 1024, 1024), 0)
    t = KernelTable({"linear": [Point(a, 100.0), Point(b, 400.0)]})
    mid = features("linear", (128, 1024, 1024), 0)  # one log2 unit from each
    assert t.rate("linear", mid) == pytest.approx(200.0)  # geometric mean
    near_a = features("linear", (80, 1024, 1024), 0)
    assert 100.0 < t.rate("linear", near_a) < 200.0


def test_an_op_the_table_lacks_falls_back_to_the_bare_ops_grid_then_to_the_roofline():
    t = KernelTable({"memory": [Point((20.0,), 1000.0)], "linear": [Point((6.0, 10.0, 10.0), 50.0)]})
    assert t.rate("norm", (20.0,)) == 1000.0  # the grid's memory pass
    assert t.rate("linear" + BACKWARD, (6.0, 10.0, 10.0)) == 50.0  # backward at the forward rate
    assert t.rate("attention", (5.0, 10.0, 10.0, 7.0)) is None
    p = ExecutionTimePredictor(_roofline())
    p.table = t
    assert p.kernel_ns("attention", 10**9, 10**6, (32, 1024, 1024, 128)) == 2000  # roofline: 1e9 / 500e3
    assert p.kernel_ns("linear", 2 * 64 * 1024 * 1024, 0, (64, 1024, 1024)) == round(2 * 64 * 1024 * 1024 / 50)


def test_a_matmul_kernel_without_a_shape_keeps_the_roofline():
    p = ExecutionTimePredictor(_roofline())
    p.table = KernelTable({"linear": [Point((6.0, 10.0, 10.0), 1.0)]})
    assert features("linear", (), 0) is None
    assert p.kernel_ns("linear", 10**9, 10**6) == 2000


RAN = {"rms_norm": 0.0004, "layer_norm": 0.0013, "pointwise": 0.0006}  # the kinds the tests' kernels run
COST = PassCost({**dict.fromkeys(PASSES, 0.0009), **RAN})


def _with(table: KernelTable) -> ExecutionTimePredictor:
    p = ExecutionTimePredictor(_roofline())
    p.table = table
    return p


def test_a_matmul_kernel_is_its_core_plus_its_passes():
    f = features("linear", (64, 1024, 1024), 0)
    p = _with(KernelTable({"linear": [Point(f, 50.0)]}, pass_cost=COST))
    flops = 2 * 64 * 1024 * 1024
    passes = (("pointwise", 10**6), ("rms_norm", 10**6))
    assert p.kernel_ns("linear", flops, 0, (64, 1024, 1024), passes=passes) == round(flops / 50 + 600 + 400)
    # a table fitted before passes holds them in its points: they are not added again
    old = _with(KernelTable({"linear": [Point(f, 50.0)]}))
    assert old.kernel_ns("linear", flops, 0, (64, 1024, 1024), passes=passes) == round(flops / 50)
    # the backward has no passes of its own
    assert p.kernel_ns("linear", flops, 0, (64, 1024, 1024), backward=True, passes=passes) == round(flops / 50)


def test_a_memory_kernel_is_its_own_recorded_time_else_the_sum_of_its_passes():
    recorded = (("layer_norm", 2 * 10**6), ("pointwise", 4 * 10**6))
    t = table_from_measurements([("norm", features("norm", (), 6 * 10**6, recorded), 6 * 10**6, 9000)], "t",
                                pass_cost=COST)
    p = _with(t)
    assert p.kernel_ns("norm", 0, 6 * 10**6, passes=recorded) == 9000
    plain = (("layer_norm", 2 * 10**6),)  # same bytes of layer norm, no modulation: another kernel
    assert p.kernel_ns("norm", 0, 2 * 10**6, passes=plain) == 2600
    assert p.kernel_ns("norm", 0, 8 * 10**6, passes=recorded * 2) == 2 * (2600 + 2400)


def test_the_roofline_moves_a_matmuls_passes_through_hbm():
    p = ExecutionTimePredictor(_roofline())
    assert p.kernel_ns("linear", 10**9, 10**6, passes=(("pointwise", 4 * 10**6),)) == 2000 + 2000


def test_the_pass_cost_fit_recovers_the_rates_the_norms_ran_at():
    def norm(passes):
        ns = round(COST.ns(passes))
        return KernelRecord("n", 0, "fwd", (), ns, 0, sum(b for _, b in passes), op="norm", passes=passes)

    mb = 1 << 24
    records = [norm((("rms_norm", 2 * mb), ("pointwise", 4 * mb))), norm((("rms_norm", 4 * mb),)),
               norm((("layer_norm", 2 * mb), ("pointwise", 4 * mb))), norm((("layer_norm", 6 * mb),)),
               norm((("rms_norm", 10),))]  # too small to say: its host's launches bound it
    fitted = fit_pass_cost(records, add_ns_per_byte=0.00033)
    assert fitted.ns_per_byte == pytest.approx({**dict.fromkeys(PASSES, 0.00033), **RAN}, rel=1e-4)
    # a kind no norm ran costs the grid's add
    only_rms = fit_pass_cost(records[1:2], add_ns_per_byte=0.00033)
    assert only_rms.ns_per_byte == pytest.approx({**dict.fromkeys(PASSES, 0.00033), "rms_norm": 0.0004}, rel=1e-4)
    assert fit_pass_cost(records[-1:], 0.00033) is None


def test_the_pass_cost_comes_from_the_probed_passes_where_there_are_any():
    mb = 1 << 24
    probed = [["rms_norm", 4096, 4096, 2 * mb, 2 * mb * 0.0005, "rms_norm"],
              ["rms_norm", 4096, 8192, 4 * mb, 4 * mb * 0.0007, "rms_norm_weight"],
              ["rms_norm", 4096, 2048, 2 * mb, 2 * mb * 0.0006, "per_head_rms"],
              ["layer_norm", 16384, 4096, 2 * mb, 2 * mb * 0.0004, "layer_norm"],
              ["broadcast", 256, 1024, mb // 8, 1e6, "modulate"],  # too small to say: launch-bound
              ["pointwise", 4096, 4096, 3 * mb, 3 * mb * 0.0003, "residual"],
              ["transposed_copy", 6144, 5120, 2 * mb, 2 * mb * 0.0019, "transposed_copy"]]
    norms = [KernelRecord("n", 0, "fwd", (), 1000, 0, 3 * mb, op="norm", passes=(("rms_norm", 2 * mb),))]
    cost = fit_pass_cost(norms, add_ns_per_byte=0.00033, probed=probed)
    # each kind's median over its probed points, whatever the recorded norms ran at; a kind no
    # probe ran at a size that says (broadcast here) costs the grid's add
    assert cost.ns_per_byte == pytest.approx({**dict.fromkeys(PASSES, 0.00033), "rms_norm": 0.0006,
                                              "layer_norm": 0.0004, "pointwise": 0.0003, "transposed_copy": 0.0019})
    only = fit_pass_cost(norms, 0.00033, probed[:1])
    assert only.ns_per_byte == pytest.approx({**dict.fromkeys(PASSES, 0.00033), "rms_norm": 0.0005})
    # without probed passes, the recorded norms decide (non-negative least squares)
    assert fit_pass_cost(norms, 0.00033).ns_per_byte["rms_norm"] == pytest.approx(1000 / (2 * mb), rel=1e-3)


def test_a_probe_files_grid_and_passes_enter_the_table_as_a_traces_header_would():
    mb = 1 << 24
    probe = {"linear": [[6144, 13824, 5120, 700_000]], "attention": [], "memory": [[3 * mb, 20_000]],
             "passes": [[kind, 4096, 5120, 8 * mb, 8 * mb * 0.0005, kind] for kind in ("rms_norm", "layer_norm")]}
    table = fit_kernel_table([], "probe only", [probe])
    f = features("linear", (6144, 13824, 5120), 0)
    assert table.exact_rate("linear", f) == pytest.approx(2 * 6144 * 13824 * 5120 / 700_000, rel=1e-6)
    assert table.pass_cost.ns_per_byte == pytest.approx(
        {**dict.fromkeys(PASSES, 20_000 / (3 * mb)), "rms_norm": 0.0005, "layer_norm": 0.0005}, rel=1e-4)
    # the recordings alone: the pass cost is the norms' fit, the probes' is another
    traces = [read_trace(FULL / "flux-full.jsonl.gz")]
    alone = fit_kernel_table(traces, "recorded").pass_cost
    assert alone == fit_pass_cost([r for t in traces for r in t.records],
                                  _largest_add(traces))
    assert fit_kernel_table(traces, "with probe", [probe]).pass_cost.ns_per_byte["rms_norm"] == pytest.approx(0.0005)


def _largest_add(traces) -> float:
    nbytes, ns = max(tuple(row) for t in traces for row in t.header["probes"]["compute"]["memory"])
    return ns / nbytes


def test_the_table_round_trips_through_its_file(tmp_path):
    t = table_from_measurements([("norm", (20.0,), 1 << 20, 500), ("linear", (0.0, 12.0, 12.0), 2 << 24, 44000)],
                                "unit", host=[("norm", 70_000), ("norm", 90_000), ("linear", 130_000)])
    path = tmp_path / "t.kernels.json"
    path.write_text(json.dumps(t.to_json()))
    back = load_table(str(path))
    assert back.points == t.points and back.host_ns == {"linear": 130_000, "norm": 80_000}
    assert back.pass_cost is None
    with_cost = KernelTable(t.points, "unit", pass_cost=COST)
    path.write_text(json.dumps(with_cost.to_json()))
    load_table.cache_clear()
    assert load_table(str(path)).pass_cost == COST
    assert back.source == "unit"


@pytest.mark.parametrize("content, says", [(None, "no file"), ("{", "not JSON"), ('{"format": "x"}', "not a kernel table")])
def test_a_bad_kernel_table_is_one_clear_error(tmp_path, content, says):
    path = tmp_path / f"bad{len(says)}.kernels.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=says):
        load_table(str(path))


def test_calibrate_fits_the_table_from_the_whole_model_recordings_and_the_profile_names_it(tmp_path):
    traces = [read_trace(p) for p in sorted(FULL.glob("*.jsonl.gz"))]
    profile = {"source": "test"}
    path = write_kernel_table(profile, traces, tmp_path / "h100_test.yaml")
    assert path == tmp_path / "h100_test.kernels.json" and profile["kernel_table"] == str(path.resolve())
    table = load_table(str(path))
    assert {"linear", "attention", "norm", "memory"} <= set(table.points)
    assert set(table.host_ns) >= {"linear", "attention", "norm"}
    assert table.pass_cost is not None
    # every recorded kernel is in the table (a matmul's core, less its passes), so each kernel
    # whose op, shape and passes are its own comes back as recorded
    p = _with(table)
    t = traces[0]
    for r in t.records[:200]:
        same = [q for q in t.records if (q.op, q.shape, q.io_bytes, q.passes) == (r.op, r.shape, r.io_bytes, r.passes)]
        if r.phase == "fwd" and len(same) == 1:
            ns = p.kernel_ns(r.op, r.flops, r.io_bytes, r.shape, passes=r.passes)
            assert ns == pytest.approx(r.compute_ns, rel=1e-5, abs=1), r.name


def test_old_recordings_without_op_and_shape_give_no_table(tmp_path):
    t = read_trace(ROOT / "data" / "traces" / "ltx2_infer.jsonl.gz")
    old = replace(t, header={k: v for k, v in t.header.items() if k != "probes"},
                  records=tuple(replace(r, op="", shape=(), passes=(), launches=0) for r in t.records))
    table = fit_kernel_table([old], "old")
    assert not table.points and not table.launches


def test_the_default_profile_predicts_the_recorded_whole_models_compute():
    """h100_pcie5 names the table fitted from data/traces/full: the synthesized step's
    compute is the recorded one's within 2%. Not exactly: matmul kernels of one shape
    with other epilogues (LTX-2's attn1.to_out adds gated, attn2.to_out not) share the
    median of their cores."""
    hw = load_hardware("h100_pcie5")
    for name, model, kind in (("ltx2-full", "ltx", "infer"), ("flux-full", "flux", "infer"),
                              ("llama8b-decode-full", "llama8b", "decode"), ("wan14b-full", "wan14b", "infer")):
        rec = read_trace(FULL / f"{name}.jsonl.gz")
        wl = OmegaConf.create(rec.header["workload"])
        syn = synthesize(load_spec(model, wl), wl, hw)
        predicted = sum(r.compute_ns for r in syn.records)
        recorded = sum(r.compute_ns for r in rec.records)
        assert math.isclose(predicted, recorded, rel_tol=0.02), (name, predicted, recorded)
        assert all(r.host_ns > 0 for r in syn.records)  # the table's host time per op


def test_a_training_steps_attention_takes_its_own_rates_else_the_inference_ones():
    """op + TRAINING keys a training step's attention (cuDNN's kernels off); a table probed
    before them prices it as before: the backward at its backward rate, else the forward's."""
    f = features("attention", (32, 4096, 4096, 128), 0)
    old = KernelTable({"attention_masked": [Point(f, 400.0)], "attention_masked" + BACKWARD: [Point(f, 300.0)]})
    assert old.rate("attention_masked" + TRAINING, f) == 400.0
    assert old.rate("attention_masked" + TRAINING + BACKWARD, f) == 300.0
    new = KernelTable({**old.points, "attention_masked" + TRAINING: [Point(f, 130.0)],
                       "attention_masked" + TRAINING + BACKWARD: [Point(f, 100.0)]})
    p = ExecutionTimePredictor(_roofline())
    p.table = new
    shape = (32, 4096, 4096, 128)
    flops = 4 * 32 * 4096 * 4096 * 128
    assert p.core_ns("attention_masked", shape) == round(flops / 400.0)
    assert p.core_ns("attention_masked", shape, training=True) == round(flops / 130.0)
    assert p.backward_core_ns("attention_masked", shape, training=True) == round(2 * flops / 100.0)
    # a linear is the same matmul in training: no training key
    lin = features("linear", (4096, 3072, 3072), 0)
    p.table = KernelTable({"linear": [Point(lin, 500.0)]})
    assert p.core_ns("linear", (4096, 3072, 3072), training=True) == p.core_ns("linear", (4096, 3072, 3072))
    assert rate_keys("attention_masked" + TRAINING + BACKWARD) == (
        "attention_masked_train_bwd", "attention_masked_bwd", "attention_masked_train", "attention_masked", "attention")


def test_the_training_attention_probe_enters_the_table_forward_and_backward():
    """A probe row [bh, lq, lk, d, forward ns, backward ns]: two points, the backward's work
    counted BACKWARD_FLOPS_FACTOR times as traces count it."""
    row = [32, 4096, 4096, 128, 2_000_000, 5_000_000]
    table = fit_kernel_table([], "probe only", [{"attention_masked_train": [row], "attention_train": []}])
    f = features("attention", tuple(row[:4]), 0)
    flops = 4 * 32 * 4096 * 4096 * 128
    assert table.exact_rate("attention_masked" + TRAINING, f) == pytest.approx(flops / 2_000_000)
    assert table.exact_rate("attention_masked" + TRAINING + BACKWARD, f) == pytest.approx(2 * flops / 5_000_000)
    assert "attention_train" not in table.points


def test_the_shipped_table_prices_masked_training_attention_slower_than_inference():
    """On the H100 a training step's masked attention runs the memory-efficient kernel, well
    under the cuDNN one inference takes (benchmarks/results/heldout-train-h100-2026-11-28.md)."""
    p = ExecutionTimePredictor(load_hardware("h100_pcie5"))
    shape = (24, 4352, 4352, 128)
    assert p.core_ns("attention_masked", shape, training=True) > 2 * p.core_ns("attention_masked", shape)
    assert p.backward_core_ns("attention_masked", shape, training=True) > 3 * p.backward_core_ns(
        "attention_masked", shape)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="times kernels on a CUDA device")
def test_the_training_attention_probe_times_each_point_forward_and_backward(monkeypatch):
    from engine.measure import compute as probe

    for name, value in (("HEADS", (8,)), ("TRAIN_SEQ", (256, 1024)), ("HEAD_DIMS", (64,)), ("DUTY", 1.0),
                        ("TRAIN_TILED_HEADS", ())):
        monkeypatch.setattr(probe, name, value)
    grid = probe.probe_attention_training(torch.device("cuda"))
    for op in ("attention_train", "attention_masked_train"):
        assert [row[:4] for row in grid[op]] == [[8, lq, lk, 64] for lq in (256, 1024) for lk in (256, 1024)]
        assert all(row[4] > 0 and row[5] > 0 for row in grid[op])
    table = fit_kernel_table([], "probe only", [grid])
    assert {"attention_train", "attention_train_bwd", "attention_masked_train",
            "attention_masked_train_bwd"} <= set(table.points)


def test_a_table_without_module_costs_prices_a_modules_host_by_its_launches(tmp_path) -> None:
    """A calibrated profile's kernel_launch_us is a whole spec kernel's host time (several launches
    and the model's Python): a real module's ops fall back to the table's host time per launch."""
    from engine.kernel_time import tables_dir

    table = json.loads((tables_dir() / "h200.kernels.json").read_text())
    bare = tmp_path / "h200-without-modules.kernels.json"  # as fitted from its spec recording alone
    bare.write_text(json.dumps({**table, "modules": None}))
    hw = OmegaConf.merge(load_hardware("h200"), {"kernel_table": str(bare)})
    p = ExecutionTimePredictor(hw)
    assert p.module_cost is None and hw.kernel_launch_us > 150
    per_launch = sorted(table["host_ns"][op] / table["launches"][op] for op in ("linear", "attention", "norm"))
    assert p.launch_host_ns() == pytest.approx(per_launch[1]) and 15_000 < per_launch[1] < 25_000
    assert p.module_host_ns(ops=10, dispatches=40) == round(10 * per_launch[1])
    roofline = ExecutionTimePredictor(OmegaConf.merge(hw, {"kernel_table": None}))
    assert roofline.launch_host_ns() == hw.kernel_launch_us * 1e3  # no table: the profile's figure


def test_attention_tile_work_counts_the_last_waves_idle_sms_and_the_padded_tiles():
    tiling = AttentionTiling(sms=4)
    full = (4, 2 * TILE, 2 * TILE, 64)  # 8 query tiles: two full waves over 4 SMs, keys on the tile
    assert tiling.work(full) == core_flops("attention", full)
    ragged = (4, 2 * TILE + 1, 2 * TILE + 1, 64)  # 12 query tiles: 3 waves, 3 key tiles
    assert tiling.work(ragged) == 4 * 3 * 4 * TILE * 3 * TILE * 64
    one_more_head = (5, 2 * TILE, 2 * TILE, 64)  # 10 tiles: a third wave, 2 of its 4 SMs idle
    assert tiling.work(one_more_head) == 4 * 3 * 4 * TILE * 2 * TILE * 64
    # a backward counted twice its forward's FLOPs counts twice its tile work
    flops = core_flops("attention", ragged)
    assert work("attention", 2 * flops, 0, ragged, tiling) == 2 * tiling.work(ragged)
    assert work("attention_masked", flops, 0, ragged, tiling) == flops  # the memory-efficient kernel: FLOPs
    assert work("attention", flops, 0, ragged, None) == flops  # a table without a tiling: FLOPs


def test_a_tiled_tables_attention_features_flag_lengths_off_the_tile():
    tiling = AttentionTiling(sms=132)
    aligned = features("attention", (32, 4096, 4096, 128), 0, tiling=tiling)
    assert aligned == (5.0, 12.0, 12.0, 7.0, 0.0, 0.0)
    assert features("attention", (32, 4096, 333, 128), 0, tiling=tiling)[4:] == (0.0, 0.5)
    assert features("attention", (32, 4429, 4429, 128), 0, tiling=tiling)[4:] == (0.5, 0.5)
    assert len(features("attention_masked", (32, 4429, 4429, 128), 0, tiling=tiling)) == 4
    assert len(features("attention", (32, 4429, 4429, 128), 0)) == 4  # untiled table: as before


def _tiled_probe(sms: int = 132) -> dict:
    """Attention on the tile at 900 FLOP/ns of tile work, off it at 600, over two head counts."""
    tiling = AttentionTiling(sms)
    rows = []
    for bh, n, rate in ((32, 4096, 900), (32, 8192, 900), (38, 4096, 900), (38, 8192, 900),
                        (32, 4429, 600), (32, 8525, 600), (38, 4429, 600), (38, 8525, 600)):
        rows.append([bh, n, n, 128, round(tiling.work((bh, n, n, 128)) / rate)])
    return {"attention": rows, "sms": sms}


def test_calibrate_counts_attention_in_tiles_where_the_probe_names_its_sms():
    table = fit_kernel_table([], "probe only", [_tiled_probe()])
    assert table.tiling == AttentionTiling(132)
    p = ExecutionTimePredictor(_roofline())
    p.table = table
    def rate(shape):
        return AttentionTiling(132).work(shape) / p.core_ns("attention", shape)

    # between probed lengths, one off the tile takes mostly the rate of lengths off the tile, one
    # on it mostly the rate on it
    assert 600 < rate((34, 6000, 6000, 128)) < 700
    assert 800 < rate((34, 6144, 6144, 128)) < 900
    assert fit_kernel_table([], "untiled", [{"attention": _tiled_probe()["attention"]}]).tiling is None
    with pytest.raises(TraceError, match="114 and 132 SMs"):
        fit_kernel_table([], "two GPUs", [_tiled_probe(), _tiled_probe(114)])


def test_a_tiled_table_round_trips_and_one_of_another_tile_is_refused(tmp_path):
    table = fit_kernel_table([], "probe only", [_tiled_probe()])
    path = tmp_path / "t.kernels.json"
    path.write_text(json.dumps(table.to_json()))
    load_table.cache_clear()
    loaded = load_table(str(path))
    assert loaded.tiling == AttentionTiling(132)
    shape = (38, 4429, 4429, 64)
    assert loaded.core_ns("attention", shape) == table.core_ns("attention", shape)
    other = tmp_path / "o.kernels.json"
    other.write_text(json.dumps({**table.to_json(), "attention_tiling": {"tile": 64, "sms": 132}}))
    with pytest.raises(ConfigError, match="tiles of 64 rows"):
        load_table(str(other))
    load_table.cache_clear()


def test_the_shipped_h200_table_prices_sd35s_joint_attention_as_probed():
    """SD3.5 Large's joint attention (38 heads of 64, 4096 + 333 tokens) ran 494 us on the H200
    (data/traces/h200/probes-h200-2026-11-28-tiles-c.json); the table before tiles priced it at 390."""
    p = ExecutionTimePredictor(load_hardware("h200"))
    assert p.core_ns("attention", (38, 4429, 4429, 64)) == pytest.approx(494_118, rel=0.01)
    # a length the probe skipped, off the tile, priced from its neighbours off the tile
    between = p.core_ns("attention", (38, 9549, 9549, 64))
    assert 1.9e6 < between < 2.2e6


def test_the_compute_probe_times_attention_off_the_tile_and_over_model_head_counts():
    from engine.measure import compute as probe

    shapes = probe.attention_shapes(masked=False)
    assert len(shapes) == len(set(shapes))
    assert any(lq % TILE for _bh, lq, _lk, _d in shapes) and {24, 38, 48} <= {s[0] for s in shapes}
    assert any(lq % TILE for _bh, lq, _lk, _d in probe.training_attention_shapes(masked=False))
    assert not any(s[1] % TILE and s[1] > 64 for s in probe.training_attention_shapes(masked=True))
    full = probe.full_mask_shapes()
    assert all(lq == lk for _bh, lq, lk, _d in full) and (32, 4096, 4096, 128) in full


def test_a_head_dims_probe_times_each_attention_grid_at_those_widths_alone():
    """--head-dims 256: the grids at 256 only (Gemma's heads), the tiles left to the main probe."""
    from engine.measure import compute as probe

    for shapes in (probe.attention_shapes(False, (256,)), probe.attention_shapes(True, (256,)),
                   probe.full_mask_shapes((256,)), probe.training_attention_shapes(False, (256,)),
                   probe.training_attention_shapes(True, (256,))):
        assert shapes and {d for *_, d in shapes} == {256}
    grid = len(probe.HEADS) * len(probe.SEQ) ** 2
    assert len(probe.attention_shapes(False, (256,))) == grid  # no tiled shapes
    assert len(probe.training_attention_shapes(False, (256,))) == len(probe.HEADS) * len(probe.TRAIN_SEQ) ** 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="times kernels on a CUDA device")
def test_the_tiles_probe_names_the_sms_and_times_each_shape(monkeypatch):
    from engine.measure import compute as probe

    for name, value in (("TILED_HEADS", (8,)), ("TILED_SEQ", (1000, 1024)), ("HEAD_DIMS", (64,)), ("DUTY", 1.0),
                        ("CROSS_HEADS", ()), ("MASKED_HEADS", (8,)), ("MASKED_Q", (1024,)), ("MASKED_K", (77,)),
                        ("TRAIN_TILED_HEADS", (8,)), ("TRAIN_TILED_SEQ", (1100,)), ("TRAIN_CROSS_Q", ())):
        monkeypatch.setattr(probe, name, value)
    grid = probe.probe_tiles(torch.device("cuda"))
    assert grid["sms"] == torch.cuda.get_device_properties(0).multi_processor_count
    assert [r[:4] for r in grid["attention"]] == [[8, 1000, 1000, 64], [8, 1024, 1024, 64]]
    assert [r[:4] for r in grid["attention_masked"]] == [[8, 1024, 77, 64]]
    assert [r[:4] for r in grid["attention_train"]] == [[8, 1100, 1100, 64]]
    assert all(v > 0 for rows in (grid["attention"], grid["attention_train"]) for r in rows for v in r[4:])
    assert fit_kernel_table([], "tiles", [grid]).tiling == AttentionTiling(grid["sms"])


def test_a_profile_without_tiles_says_it_prices_attention_off_the_tile_fast():
    untiled = ExecutionTimePredictor(load_hardware("h100_pcie5"))
    tiled = ExecutionTimePredictor(load_hardware("h200"))
    ragged = [("linear", (4429, 2432, 2432)), ("attention", (38, 4429, 4429, 64))]
    note = untiled.untiled_note(ragged)
    assert note and "4429 x 4429 tokens" in note and "--only attention_tiles" in note
    assert tiled.untiled_note(ragged) is None
    assert untiled.untiled_note([("attention", (32, 4096, 256, 128)), ("attention_masked", (32, 6144, 512, 128))]) is None
    assert "no kernel table" in ExecutionTimePredictor(_roofline()).untiled_note(ragged)


def test_a_profile_says_which_attention_heads_it_prices_from_another_width():
    """h100_pcie5's table holds attention 64 and 128 wide, h200's 256 too (--head-dims 256)."""
    narrow, wide = (ExecutionTimePredictor(load_hardware(h)) for h in ("h100_pcie5", "h200"))
    gemma = [("linear", (4096, 4096, 3840)), ("attention_full_mask", (16, 4096, 4096, 256))]
    note = narrow.head_width_note(gemma)
    assert note and "heads 256 wide" in note and "widths 64, 128 only" in note and "--head-dims 256" in note
    assert wide.head_width_note(gemma) is None
    assert narrow.head_width_note([("attention", (24, 4096, 4096, 128)), ("attention", (8, 64, 64, 96))]) is None
    assert narrow.table_notes(gemma) == [note]
    assert ExecutionTimePredictor(_roofline()).head_width_note(gemma) is None


def test_a_spec_synthesized_off_the_tile_on_an_untiled_profile_warns_once(caplog):
    workload = OmegaConf.create({**read_trace(FULL / "ltx2-full.jsonl.gz").header["workload"], "video_tokens": 4429})
    spec = load_spec("ltx", workload)
    with caplog.at_level("WARNING", logger="engine.trace"):
        synthesize(spec, workload, load_hardware("h100_pcie5"))
    assert len([r for r in caplog.records if "4429 x 4429 tokens is off the 128-token tile" in r.message]) == 1
    caplog.clear()
    with caplog.at_level("WARNING", logger="engine.trace"):
        synthesize(spec, workload, load_hardware("h200"))
    assert not any("tile" in r.message for r in caplog.records)


def test_causal_attention_is_priced_on_the_tiles_it_runs_at_flash_attentions_rates():
    """is_causal without a mask: the flash kernel runs the (query tile, key tile) pairs on and
    below the diagonal, (n + 1) / 2n of n x n; a tiled table prices the waves they run in, the
    longest first, each as long as its longest tile (a causal kernel within one wave takes the
    full one's time; a table without the tiling, which does not know the waves, the full
    attention's); either at the attention rates of its phase."""
    from engine.compute import CAUSAL_CTAS_PER_SM, causal_share

    assert causal_share((8, 4 * TILE, 4 * TILE, 128)) == 10 / 16
    assert causal_share((8, 1, 4096, 128)) == 1 / 32  # one query row: its first key tile
    assert causal_share((8, TILE + 1, TILE, 64)) == 1.0
    assert rate_keys("attention_causal" + TRAINING + BACKWARD) == (
        "attention_causal" + TRAINING + BACKWARD, "attention" + TRAINING + BACKWARD, "attention_causal" + BACKWARD,
        "attention" + BACKWARD, "attention_causal" + TRAINING, "attention" + TRAINING, "attention_causal", "attention")
    tiling = AttentionTiling(sms=2)
    slots = CAUSAL_CTAS_PER_SM * 2
    assert tiling.causal_ratio((slots, 4 * TILE, 4 * TILE, 64)) == (4 + 3 + 2 + 1) / 16  # a wave a query tile
    assert tiling.causal_ratio((1, slots * TILE, slots * TILE, 64)) == 1.0  # one wave: the diagonal's row
    tiled, untiled = (ExecutionTimePredictor(load_hardware(h)) for h in ("h200", "h100_pcie5"))
    for shape in ((32, 4096, 4096, 128), (24, 4429, 4429, 64)):
        ratio = tiled.table.tiling.causal_ratio(shape)
        assert 0.5 < ratio < 0.7
        assert tiled.core_ns("attention_causal", shape) == pytest.approx(tiled.core_ns("attention", shape) * ratio, abs=1)
        assert tiled.backward_core_ns("attention_causal", shape, training=True) == pytest.approx(
            tiled.backward_core_ns("attention", shape, training=True) * ratio, abs=1)
        assert untiled.core_ns("attention_causal", shape) == pytest.approx(untiled.core_ns("attention", shape), abs=1)


def test_attention_with_a_mask_along_the_queries_falls_back_to_masked_attentions_rates():
    """A table without full-mask points of a phase prices such attention as masked attention of
    that phase before its own of another phase: a training step's full mask runs the masked
    kernel, not the one inference picks for it; then the bare attention grid."""
    assert rate_keys("attention_full_mask" + TRAINING + BACKWARD) == (
        "attention_full_mask" + TRAINING + BACKWARD, "attention_masked" + TRAINING + BACKWARD,
        "attention_full_mask" + BACKWARD, "attention_masked" + BACKWARD, "attention_full_mask" + TRAINING,
        "attention_masked" + TRAINING, "attention_full_mask", "attention_masked", "attention")
    shape = (8, 256, 256, 64)
    table = KernelTable({"attention_masked": [Point(features("attention_masked", shape, 0), 50.0)]})
    assert table.rate("attention_full_mask", features("attention_full_mask", shape, 0)) == 50.0
    table = KernelTable({"attention_full_mask": [Point(features("attention_full_mask", shape, 0), 200.0)],
                         "attention_masked_train_bwd": [Point(features("attention_masked", shape, 0), 20.0)]})
    feats = features("attention_full_mask", shape, 0)
    assert table.rate("attention_full_mask", feats) == 200.0
    assert table.rate("attention_full_mask" + TRAINING + BACKWARD, feats) == 20.0


def test_an_op_probed_on_the_gpu_alone_replaces_its_points_timed_at_the_hosts_pace():
    """A probe grid lists the ops it timed on the GPU alone (GPU_ALONE); their points replace the
    same op's at the same shape from other grids, not other ops', and add where none was."""
    from engine.calibrate_kernels import probe_rows
    from engine.compute import GPU_ALONE

    old = {"attention_masked": [[32, 1, 4096, 128, 78_000], [8, 64, 4096, 128, 100_000]],
           "attention": [[32, 1, 4096, 128, 40_000]]}
    new = {"attention_masked": [[32, 1, 4096, 128, 23_800], [8, 4, 4096, 128, 89_000]],
           "attention": [[32, 1, 4096, 128, 30_000]], GPU_ALONE: ["attention_masked"]}
    rows = {(op, tuple(round(2 ** f) for f in feats)): ns for op, feats, _, ns in probe_rows([old, new], None)}
    assert rows[("attention_masked", (32, 1, 4096, 128))] == 23_800
    assert rows[("attention_masked", (8, 64, 4096, 128))] == 100_000 and rows[("attention_masked", (8, 4, 4096, 128))] == 89_000
    # attention was not timed alone in the new grid: both its points stand
    assert sum(op == "attention" for op, *_ in probe_rows([old, new], None)) == 2
