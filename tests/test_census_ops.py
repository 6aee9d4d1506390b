"""benchmarks/census_ops.py's reading of a timed forward, on the CPU: each matmul-bound op as
the census counts its core."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_timed_ops_become_the_cores_the_census_counts() -> None:
    from census_ops import timed_cores

    bf16 = "bfloat16"
    case = {"ops": [
        {"op": "aten.addmm.default", "ns": 100, "tensors": [
            ["in", [3072], [1], bf16], ["in", [4096, 3072], [3072, 1], bf16], ["in", [3072, 12288], [1, 3072], bf16],
            ["out", [4096, 12288], [12288, 1], bf16]]},
        {"op": "aten.mm.default", "ns": 50, "tensors": [
            ["in", [2, 256, 64], [16384, 64, 1], bf16], ["in", [64, 128], [1, 64], bf16],
            ["out", [512, 128], [128, 1], bf16]]},
        {"op": "aten._scaled_dot_product_flash_attention.default", "ns": 70, "tensors": [
            ["in", [1, 24, 4608, 128], [1, 1, 1, 1], bf16]] * 3},
        {"op": "aten._scaled_dot_product_efficient_attention.default", "ns": 80, "tensors": [
            ["in", [1, 24, 4352, 128], [1, 1, 1, 1], bf16]] * 3 + [["in", [1, 1, 4352, 4352], [1, 1, 1, 1], bf16]]},
        {"op": "aten._scaled_dot_product_cudnn_attention.default", "ns": 90, "tensors": [
            ["in", [2, 8, 1024, 64], [1, 1, 1, 1], bf16], ["in", [2, 8, 512, 64], [1, 1, 1, 1], bf16],
            ["in", [2, 8, 512, 64], [1, 1, 1, 1], bf16]]},
        {"op": "aten.add.Tensor", "ns": 9, "tensors": [["in", [4], [1], bf16], ["out", [4], [1], bf16]]}]}
    assert timed_cores(case) == [("linear", (4096, 12288, 3072), 100), ("linear", (512, 128, 64), 50),
                                 ("attention", (24, 4608, 4608, 128), 70),
                                 ("attention_full_mask", (24, 4352, 4352, 128), 80),
                                 ("attention", (16, 1024, 512, 64), 90)]
