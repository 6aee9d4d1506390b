# After the buffer fixes: the GPU tests, and the checkpoint-buffer case on CUDA.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
T0=$(date +%s)
timeout 300 python3 -m pytest -q -m cuda -p no:cacheprovider tests/ 2>&1 | tail -4
echo "tests $(( $(date +%s) - T0 )) s"
python3 - <<'PY'
import tempfile, torch
from torch import nn
from safetensors.torch import save_file
import engine
from engine.modules.build import parameters_on_meta

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(256, 256) for _ in range(4))
        self.register_buffer("shift", torch.zeros(256))
    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x + self.shift

state = Net().state_dict(); state["shift"] = torch.arange(256.0)
path = tempfile.mktemp(suffix=".safetensors"); save_file({n: t.contiguous() for n, t in state.items()}, path)
x = torch.randn(4, 256, device="cuda")
plain = Net().cuda(); plain.load_state_dict(state)
with parameters_on_meta():
    net = Net()
for budget in (None, 0.6):
    h = engine.offload(net, budget_mb=budget, example_inputs=(x,), checkpoint=path, eviction="priority", lookahead=1)
    with torch.no_grad():
        print("cuda, budget", budget, "bound" if h.bound else "streamed", "buffer is the checkpoint's:",
              torch.equal(net.shift.cpu(), state["shift"]), "bitwise the plain module's:", torch.equal(net(x), plain(x)))
    h.remove()
PY
