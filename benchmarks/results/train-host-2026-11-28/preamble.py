"""The host's time from a training step's first stamp to its first kernel, on the CPU: a FLUX
config with every block at toy width. argv: double blocks, single blocks, train|infer."""
import time, contextlib, sys, torch
import engine, engine.modules.record as rec
from engine.measure.timing import KernelStamps
import diffusers, peft
marks = []
orig_gc = rec.paused_gc
@contextlib.contextmanager
def gc_mark():
    with orig_gc():
        marks.append(["enter", time.perf_counter_ns()])
        yield
orig_fetch = KernelStamps.fetch
def fetch(self, i):
    if i == 0:
        marks.append(["fetch0", time.perf_counter_ns()])
    return orig_fetch(self, i)
rec.paused_gc = gc_mark
KernelStamps.fetch = fetch
nl, ns = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
m = diffusers.FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=nl, num_single_layers=ns,
     attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6), guidance_embeds=True)
inputs = dict(hidden_states=torch.randn(1, 16, 8), encoder_hidden_states=torch.randn(1, 4, 32),
              pooled_projections=torch.randn(1, 16), timestep=torch.tensor([0.5]),
              img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(4, 3), guidance=torch.tensor([1.0]), return_dict=False)
training = sys.argv[3] == "train"
if training:
    m.add_adapter(peft.LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v", "ff.net.2", "proj_out"]))
    m.enable_gradient_checkpointing()
h = engine.offload(m, budget_mb=1.0, example_inputs=inputs, training=training, backend="cpu",
                   loss_fn=(lambda out: out[0].float().pow(2).mean()) if training else None)
pre = [(b[1] - a[1]) / 1e6 for a, b in zip(marks, marks[1:]) if a[0] == "enter" and b[0] == "fetch0"]
print("training" if training else "inference", "preamble ms per step:", [round(p, 2) for p in pre])
