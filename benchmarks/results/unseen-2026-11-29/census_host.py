"""Why the all-resident Mistral-7B decode ran 56.8 ms through engine.offload against the plain
module's 32.4 in one process (call 2): a host-bound plain decode step timed before one launch census
(engine.measure.launches.Census: torch.profiler around a step), right after it and 5 s later, in
three processes: TEARDOWN_CUPTI as the census sets it (at run time), set before the process
started, and "0". Each line: median of 30 synced steps (ms, perf_counter around step + sync)."""
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))


def child() -> None:
    import torch
    from omegaconf import OmegaConf

    from engine.measure.launches import Census
    from engine.modules.build import llama_inputs

    cfg = OmegaConf.load(ROOT / "conf" / "model" / "mistral7b_hf.yaml")
    cfg.module.config.num_hidden_layers = 8
    import transformers
    c = transformers.MistralConfig(**{k: v for k, v in OmegaConf.to_container(cfg.module.config).items()
                                      if k != "_target_"})
    with torch.device("cuda"):
        module = transformers.MistralForCausalLM(c).to(torch.bfloat16)
    wl = SimpleNamespace(kind="decode", batch=1, context_tokens=4096, text_tokens=0)
    inputs = llama_inputs(module, wl, torch.device("cuda"), torch.bfloat16)

    def step_ms(n: int = 30) -> float:
        out = []
        for _ in range(n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            module(**inputs)
            torch.cuda.synchronize()
            out.append((time.perf_counter() - t) * 1e3)
        return statistics.median(out)

    with torch.no_grad():
        step_ms(10)
        before = step_ms()
        with Census(True) as census:
            census.mark(0)
            module(**inputs)
        after = step_ms()
        time.sleep(5)
        later = step_ms()
    print(f"{os.environ.get('LABEL')}: before {before:.2f} ms, after the census {after:.2f} ms, 5 s later "
          f"{later:.2f} ms ({len(census.counts)} mark, {sum(census.counts.values())} launches)", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        child()
        sys.exit(0)
    for label, env in [("as the census sets it", {}), ("TEARDOWN_CUPTI=1 at start", {"TEARDOWN_CUPTI": "1"}),
                       ("TEARDOWN_CUPTI=0", {"TEARDOWN_CUPTI": "0"}), ("as the census sets it, again", {})]:
        e = {k: v for k, v in os.environ.items() if k != "TEARDOWN_CUPTI"}
        subprocess.run([sys.executable, __file__, "child"], env={**e, **env, "LABEL": label}, timeout=120)
