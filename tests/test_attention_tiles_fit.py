"""benchmarks/attention_tiles_fit.py on the H200's tiles probe, on the CPU: each probed attention
point priced from the others. Counted in tiles (engine/compute.py, AttentionTiling), the held-out
points come out closer than at plain FLOP rates; the exact figures are the results file's
(benchmarks/results/attention-tiles-h200-2026-11-28.md)."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "data" / "traces" / "h200" / "probes-h200-2026-11-28-tiles-c.json"


def test_tiles_price_held_out_attention_points_closer_than_plain_flop_rates() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention_tiles_fit.py"), str(PROBE),
                           "--traces", str(ROOT / "data" / "traces" / "h200")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    error = {(op, table): (float(every), float(long.rstrip("%")) if long != "-" else None)
             for op, table, every, long in
             re.findall(r"^\| (\w+) \| (plain FLOPs|tiled) \| ([\d.]+)% \| ([\d.]+%|-) \|", done.stdout, re.M)}
    assert error[("attention", "tiled")] == (1.1, 0.6)  # as the results file gives them
    for op in ("attention", "attention_train", "attention_train_bwd"):
        (plain_all, plain_long), (tiled_all, tiled_long) = error[(op, "plain FLOPs")], error[(op, "tiled")]
        assert tiled_all < plain_all and tiled_long < plain_long / 2, (op, error)
    assert error[("attention_masked", "tiled")] == error[("attention_masked", "plain FLOPs")]  # not tiled
