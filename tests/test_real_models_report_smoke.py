"""benchmarks/real_models_report.py on a kept GPU run, on the CPU.

The run (benchmarks/results/real-2026-11-26/run12: the diffusers LTX-2 at 16000 and 12000, pool
and vmm, lookahead 2) was measured with its recording's header as it is; replayed unedited, each
row's prediction is the simulator's golden below, to the 0.1 ms the table shows. On the GPU
real_models.py printed 520.7, 520.0, 528.0 and 529.1 ms beside it, before a copy slowed only
the part of a kernel it overlaps (sim/compute.py)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "results" / "real-2026-11-26" / "run12"


def test_the_report_replays_a_run_as_it_was_predicted() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "real_models_report.py"), str(RUN)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((RUN / "real_models.json").read_text())["results"][0]["rows"]
    printed = [float(m) for m in re.findall(r"^\| run12 \|.*/.*\| ([\d.]+) \| [+-][\d.]+% \|$", done.stdout, re.M)]
    assert len(printed) == len(rows) == 4
    assert printed == [522.7, 522.7, 528.0, 528.9]
    assert "4 rows: mean |error|" in done.stdout
    # Each row beside its steps' fastest and slowest; three of the four predictions land inside them.
    spans = re.findall(r"^\| run12 \|.*\| [\d.]+ \| ([\d.]+-[\d.]+) \| [\d.]+ \| [+-][\d.]+% \|$", done.stdout, re.M)
    assert spans == [f"{min(r['times']):.1f}-{max(r['times']):.1f}" for r in rows]
    assert "inside the measured steps' range in 3 of 4 rows that kept them" in done.stdout


def test_a_bad_set_is_one_line() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "real_models_report.py"), str(RUN),
                           "--set", "host_syncs=[99]"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr


def test_an_output_is_bitwise_one_of_the_resident_outcomes() -> None:
    """real_models.py keeps each different output of the resident steps (a forward whose own
    kernels are not deterministic has more than one) and calls a row right when it is one."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from real_models import distinct, one_of

    a, b = torch.tensor([1.0, 2.0], dtype=torch.bfloat16), torch.tensor([1.0, 2.015625], dtype=torch.bfloat16)
    outcomes = distinct([a, a.clone(), b, a, b.clone()])
    assert len(outcomes) == 2 and outcomes[0] is a and outcomes[1] is b
    assert one_of(b.clone(), outcomes) and not one_of(torch.tensor([1.0, 2.03125], dtype=torch.bfloat16), outcomes)


def test_the_report_names_the_rows_the_host_bounds() -> None:
    """The shipped H200 module rows: Llama-3.1-8B decode with every weight resident is the host's
    step, as the simulator finds it; the summary of the other eleven leaves it out and names it."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "real_models_report.py"),
                           str(ROOT / "data" / "traces" / "h200" / "modules"), "--hardware", "h200"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"^the 11 rows the GPU or the link bounds \(as predicted\): mean \|error\| [\d.]+%, max [\d.]+%; "
                     r"the host bounds modules llama3.1-8b-hf at 0 MB \([+-][\d.]+%\)$", done.stdout, re.M), done.stdout


def test_the_harness_bytes_come_out_of_an_older_recording_once() -> None:
    """A recording real_models.py made while it held its own buffers on the device: the report
    takes them out of its torch peak, and not again where restamp_harness.py took them already."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from real_models_report import without_harness

    from engine.trace import read_trace

    trace = read_trace(next(RUN.glob("*.trace.jsonl.gz")))
    trace = type(trace)({**trace.header, "activation_peak_bytes": 1_000_000}, trace.weight_sizes, trace.records)
    taken = without_harness(trace, 300_000)
    assert taken.header["activation_peak_bytes"] == 700_000 and taken.header["harness_device_bytes"] == 300_000
    assert without_harness(taken, 300_000).header == taken.header
    assert without_harness(trace, 0) is trace


def test_an_older_run_held_the_copy_buffer_and_its_reference_outputs() -> None:
    """What an older run of real_models.py held beside a causal LM: the copy buffer, each
    reference output's logits, and in a row one more output, a prefill's with its KV cache."""
    pytest.importorskip("transformers", reason="needs the models extra: pip install 'offload-engine[models]'")
    from omegaconf import OmegaConf

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from real_models import LEGACY_COPY_BYTES, legacy_harness_bytes

    cfg = OmegaConf.load(ROOT / "conf" / "model" / "mistral7b_hf.yaml")
    cfg.module.config.num_hidden_layers = 2
    shape = dict(batch=1, video_tokens=0, audio_tokens=0)
    decode = {**shape, "kind": "decode", "text_tokens": 0, "context_tokens": 64}
    prefill = {**shape, "kind": "infer", "text_tokens": 64, "context_tokens": 0}
    logits = 32000 * 2
    assert legacy_harness_bytes(cfg, decode, 2)[0] == LEGACY_COPY_BYTES + 2 * logits
    assert legacy_harness_bytes(cfg, decode, 1)[1] == LEGACY_COPY_BYTES + 2 * logits
    cache = 2 * 2 * 64 * 8 * 128 * 2  # layers x (keys, values) x tokens x key-value heads x head dim x bf16
    assert legacy_harness_bytes(cfg, prefill, 1)[1] == LEGACY_COPY_BYTES + 2 * 64 * logits + cache
