"""The executor on a real GPU: capped pool, registered mapping, bitwise outputs, no host syncs.

Skipped cleanly without an NVIDIA GPU or without cuda-python's runtime bindings.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]
pytest.importorskip("cuda.bindings.runtime", reason="needs cuda-python (pip install cuda-python)")

from engine.errors import BelowFloorError, ExecutorError  # noqa: E402
from engine.executor import WeightExecutor, host_weights  # noqa: E402
from engine.executor.cuda import CudaBackend  # noqa: E402
from engine.policy.placement import POOL_CHUNK, pool_slack_bytes  # noqa: E402
from engine.models import forward, load_spec, make_inputs  # noqa: E402
from engine.models.run import DictSource  # noqa: E402
from engine.modes.spec_run import run_execute  # noqa: E402
from engine.policy import AccessOrder  # noqa: E402
from engine.policy.floor import floor  # noqa: E402
from engine.policy.weights import WeightResidency  # noqa: E402
from engine.weightfile import WeightFile, materialize  # noqa: E402

MiB = 1 << 20
WORKLOAD = dict(name="infer", kind="infer", batch=1, video_tokens=64, audio_tokens=16, text_tokens=8,
                context_tokens=0, lora_rank=0, steps=3, loop="free")


def chunks(cap: int) -> int:
    """The pool's effective cap: it reserves whole 32 MiB chunks."""
    return -(-cap // POOL_CHUNK) * POOL_CHUNK


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    spec = load_spec("tiny", SimpleNamespace(**WORKLOAD))
    path = materialize(spec, tmp_path_factory.mktemp("w") / "tiny.ptd", seed=1)
    wf = WeightFile(path, spec)
    inputs = make_inputs(spec, SimpleNamespace(**WORKLOAD), device="cuda", seed=2)
    with torch.no_grad():
        reference = forward(spec, DictSource(spec, {n: t.cuda() for n, t in wf.tensors().items()}), inputs)
    order = AccessOrder(tuple(k.name for k in spec.kernels), tuple(k.weights for k in spec.kernels),
                        {n: w.nbytes for n, w in spec.weights.items()})
    yield SimpleNamespace(spec=spec, wf=wf, path=path, inputs=inputs, reference=reference, order=order)
    wf.close()


def test_weights_over_the_free_device_memory_are_refused_before_any_pool(tmp_path):
    """Every weight resident (no budget) of a model larger than the GPU's free memory: one
    ConfigError naming the bytes and the budget to give, and no pool made. A budget far over
    the model holds only the model."""
    from engine.errors import ConfigError
    from engine.executor.runtime import make_backend

    free = torch.cuda.mem_get_info()[0]
    huge = AccessOrder(("a", "b"), (("a",), ("b",)), {"a": free, "b": free})
    with pytest.raises(ConfigError, match=r"the weights would hold .* GB free; give a budget under \d+ MB"):
        sparse = tmp_path / "sparse.bin"  # host weights mapped from a file with no data: nothing allocated
        with open(sparse, "wb") as f:
            f.truncate(2 * free)
        host = torch.from_file(str(sparse), shared=True, size=2 * free, dtype=torch.uint8)
        WeightExecutor(huge, {"a": host[:free], "b": host[free:]}, budget_bytes=None, backend="cuda")
    budget_over = WeightExecutor(AccessOrder(("a",), (("a",),), {"a": MiB}), {"a": torch.zeros(MiB, dtype=torch.uint8)},
                                 budget_bytes=10**15, backend="cuda")
    assert budget_over.backend.budget_bytes == MiB
    budget_over.close()
    with pytest.raises(ConfigError, match="give a budget under"):
        make_backend("cuda", 10**15, MiB)


def test_pool_pointers_wrap_without_a_copy():
    b = CudaBackend(64 * MiB, slack_bytes=0)
    block = b.alloc(3 * MiB)
    assert block.data.data_ptr() == block.address and block.data.device.type == "cuda"
    src = torch.randint(0, 255, (3 * MiB,), dtype=torch.uint8).pin_memory()
    b.wait_ready(b.copy_in(block, src))
    assert torch.equal(block.data.cpu(), src)
    b.free_after(block, b.mark())
    b.close()


def test_the_pool_refuses_over_its_cap():
    b = CudaBackend(64 * MiB, slack_bytes=0)
    b.alloc(48 * MiB)
    with pytest.raises(ExecutorError, match=r"cudaMallocFromPoolAsync\(50331648\).*cudaErrorMemoryAllocation"):
        b.alloc(48 * MiB)
    b.close()


def test_memory_is_reused_only_after_its_last_reader():
    b = CudaBackend(64 * MiB, slack_bytes=0)
    ones = torch.ones(48 * MiB, dtype=torch.uint8).pin_memory()
    twos = torch.full((48 * MiB,), 2, dtype=torch.uint8).pin_memory()
    a = b.alloc(48 * MiB)
    b.wait_ready(b.copy_in(a, ones))
    torch.cuda._sleep(200_000_000)  # the reader below runs late
    seen = a.data.clone()  # the last reader of a, on the compute stream
    b.free_after(a, b.mark())
    c = b.alloc(48 * MiB)  # must reuse a's memory (the cap leaves no other room) ...
    b.wait_ready(b.copy_in(c, twos))  # ... and overwrite it only after the reader
    torch.cuda.synchronize()
    assert c.address == a.address
    assert torch.equal(seen.cpu(), ones)
    b.close()


def test_register_failure_is_loud():
    b = CudaBackend(64 * MiB, slack_bytes=0)
    with pytest.raises(ExecutorError, match=r"cudaHostRegister.*weights.source=mmap"):
        b.register(4096, 4096)  # not a mapping of this process
    b.close()


@pytest.mark.parametrize("eviction", ["lru", "belady", "priority"])
def test_bitwise_outputs_and_parity_on_the_gpu(tiny, eviction):
    for lookahead in (0, 1, 2, 3):
        fl = floor(tiny.order, lookahead).bytes
        for budget in (fl, 2 * fl, None):
            ex = WeightExecutor(tiny.order, tiny.wf.tensors(), budget_bytes=budget, eviction=eviction,
                                lookahead=lookahead, backend="cuda")
            outs = []
            with torch.no_grad():
                for _ in range(3):
                    with ex.step():
                        outs.append(forward(tiny.spec, ex, tiny.inputs))
            for out in outs:
                for k in out:
                    assert torch.equal(out[k], tiny.reference[k]), (eviction, lookahead, budget, k)
            bare = WeightResidency(tiny.order, budget, eviction, lookahead)
            for _ in range(3):
                for i in range(len(tiny.order)):
                    bare.issue(i)
            assert ex.log == bare.log
            assert ex.backend.reserved_peak_bytes() <= chunks(ex.backend.cap_bytes)
            ex.close()


@pytest.mark.parametrize("source", ["mmap_registered", "pinned", "mmap"])
def test_sources_on_the_gpu(tiny, source):
    budget = floor(tiny.order, 2).bytes
    backend = CudaBackend(budget, slack_bytes=pool_slack_bytes(max(tiny.order.sizes.values())))
    host = host_weights(tiny.wf, source, backend)
    ex = WeightExecutor(tiny.order, host.tensors, budget_bytes=budget, backend=backend)
    with torch.no_grad():
        for _ in range(2):
            with ex.step():
                out = forward(tiny.spec, ex, tiny.inputs)
    assert all(torch.equal(out[k], tiny.reference[k]) for k in out)
    ex.close()
    host.close()


def test_steady_state_never_synchronizes_the_host(tiny):
    ex = WeightExecutor(tiny.order, tiny.wf.tensors(), budget_bytes=floor(tiny.order, 2).bytes,
                        backend="cuda")

    def step():
        with ex.step():
            for i in range(len(tiny.order)):
                ex.fetch(i)

    step()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing torch call raises
    try:
        step()
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ex.close()


def test_run_execute_on_the_gpu(tiny, tmp_path):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"weights": {"eviction": "belady", "lookahead": 2, "source": "mmap_registered",
                                        "file": str(tiny.path), "backend": "cuda"},
                            "workload": WORKLOAD, "budget": 1.0, "seed": 0})

    class Trace:
        def access_order(self):
            return tiny.order

    result = run_execute(cfg, tiny.spec, Trace(), tmp_path)
    assert result["outputs_match_reference"] is True
    assert result["pool_reserved_peak_bytes"] <= chunks(result["pool_cap_bytes"])
    assert (tmp_path / "telemetry.jsonl").is_file()


def test_run_execute_leaves_the_outputs_it_keeps_out_of_the_peak(tiny, tmp_path):
    """execute keeps each step's outputs to compare them with the reference, which a deployment
    does not: torch's measured peak is the same over two steps and over six."""
    from omegaconf import OmegaConf

    class Trace:
        def access_order(self):
            return tiny.order

    peaks = []
    for steps in (2, 6):
        cfg = OmegaConf.create({"weights": {"eviction": "belady", "lookahead": 2, "source": "mmap_registered",
                                            "file": str(tiny.path), "backend": "cuda"},
                                "workload": {**WORKLOAD, "steps": steps}, "budget": 1.0, "seed": 0})
        result = run_execute(cfg, tiny.spec, Trace(), tmp_path / str(steps))
        assert result["outputs_match_reference"] is True
        peaks.append(result["peak_torch_bytes"])
    assert peaks[0] == peaks[1] > 0


def _offload_matches(module, inputs, budget_mb, call=lambda m, i: m(**i) if isinstance(i, dict) else m(*i),
                     backend="cuda"):
    import engine

    with torch.no_grad():
        ref = call(module, inputs)
    h = engine.offload(module, budget_mb=budget_mb, example_inputs=inputs, backend=backend)
    with torch.no_grad():
        outs = [call(module, inputs) for _ in range(3)]
    rows = h.telemetry()
    h.remove()
    with torch.no_grad():
        restored = call(module, inputs)
    pick = (lambda o: o) if isinstance(ref, torch.Tensor) else (lambda o: o[0])
    assert all(torch.equal(pick(o), pick(ref)) for o in outs)
    assert torch.equal(pick(restored), pick(ref))
    return h, rows


def test_offload_a_plain_module_on_the_gpu():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.LayerNorm(32), torch.nn.GELU(),
                              *[torch.nn.Linear(32, 32) for _ in range(6)], torch.nn.Linear(32, 8)).cuda().eval()
    h, rows = _offload_matches(net, (torch.randn(2, 5, 8, device="cuda"),), budget_mb=0.015)
    assert all(r["peak_device_bytes"] <= h.executor.backend.cap_bytes for r in rows)
    assert rows[-1]["h2d_bytes"] > 0


@pytest.mark.parametrize("backend", ["cuda", "vmm"])
def test_reconfigure_gives_each_pool_back_on_the_gpu(backend):
    """Budgets streamed, bound and streamed again on one set-up: outputs bitwise the plain
    module's each time, and each executor's pool given back (the device's free memory after
    the last is what it was after the first)."""
    import engine

    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda().eval()
    x = torch.randn(4, 1024, device="cuda")
    with torch.no_grad():
        ref = net(x)
    # 33.6 MB of weights; the floors over the vmm backend's 2 MB granules: 18.9 MB at lookahead 1, 25.2 at 2
    h = engine.offload(net, budget_mb=20.0, example_inputs=(x,), eviction="lru", lookahead=1, backend=backend)
    free = []
    for budget, eviction, lookahead in [(20.0, "lru", 1), (26.0, "belady", 2), (None, "priority", 1),
                                        (26.0, "priority", 2)] * 2:
        h.reconfigure(budget_mb=budget, eviction=eviction, lookahead=lookahead)
        with torch.no_grad():
            assert all(torch.equal(net(x), ref) for _ in range(2))
        torch.cuda.synchronize()
        free.append(torch.cuda.mem_get_info()[0])
    assert abs(free[-1] - free[3]) < 4 * 2**20 and abs(free[4] - free[0]) < 4 * 2**20
    if backend == "vmm":  # 27 MB clears lookahead 4's floor by the weights' bytes (25.2), not by the granules (31.5)
        with pytest.raises(BelowFloorError):
            h.reconfigure(budget_mb=27.0, eviction="belady", lookahead=4)
        with torch.no_grad():
            assert torch.equal(net(x), ref) and h.lookahead == 2
    h.remove()
    with torch.no_grad():
        assert torch.equal(net(x), ref)


@pytest.mark.parametrize("backend, budget_mb", [("cuda", 8.0), ("vmm", 16.0)])
def test_offload_a_transformers_llama(backend, budget_mb):
    transformers = pytest.importorskip("transformers", reason="needs the models extra: pip install 'offload-engine[models]'")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg).cuda().eval()
    ids = torch.randint(0, 512, (2, 16), device="cuda")
    h, rows = _offload_matches(model, {"input_ids": ids}, budget_mb=budget_mb, call=lambda m, i: m(**i).logits,
                               backend=backend)
    assert rows[-1]["h2d_bytes"] > 0 and all(r["relocations"] == 0 for r in rows)
    assert all(r["peak_device_bytes"] <= budget_mb * 1e6 for r in rows)


def test_offload_a_diffusers_ltx_transformer():
    diffusers = pytest.importorskip("diffusers", reason="needs the models extra: pip install 'offload-engine[models]'")
    torch.manual_seed(0)
    model = diffusers.LTXVideoTransformer3DModel(
        in_channels=16, out_channels=16, num_attention_heads=4, attention_head_dim=32, cross_attention_dim=128,
        num_layers=3, caption_channels=64).cuda().eval()
    f, hh, ww = 2, 4, 4
    inputs = dict(hidden_states=torch.randn(1, f * hh * ww, 16, device="cuda"),
                  encoder_hidden_states=torch.randn(1, 7, 64, device="cuda"),
                  timestep=torch.tensor([500], device="cuda"),
                  encoder_attention_mask=torch.ones(1, 7, device="cuda"),
                  num_frames=f, height=hh, width=ww, return_dict=False)
    _offload_matches(model, inputs, budget_mb=4.0)


def test_count_launches_counts_each_kernels_launches_on_the_gpu(tiny):
    """The recorder's census (engine/measure/launches.py): every spec kernel launches at least
    one device operation, the forward's counts are the same step after step, and a LoRA step's
    backward and saved-tensor hook calls are counted too."""
    from engine.measure.clocks import CudaClock
    from engine.measure.timing import count_launches
    from engine.models.lora import init_lora

    spec, inputs = tiny.spec, tiny.inputs
    device = torch.device("cuda")
    weights = {n: t.to(device) for n, t in tiny.wf.tensors().items()}
    first, again = (count_launches(spec, DictSource(spec, weights), inputs, CudaClock(device)) for _ in range(2))
    assert min(first.forward) >= 1 and first.forward == again.forward and first.backward is None
    lora = init_lora(spec, 4, device=device)
    train = count_launches(spec, DictSource(spec, weights), inputs, CudaClock(device), lora=lora)
    assert len(train.backward) == len(spec.kernels) and sum(train.backward) > sum(train.forward) / 2
    assert sum(train.packs.values()) >= sum(len(k.saved) for k in spec.kernels)
