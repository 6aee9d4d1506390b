"""Experiment: restored activations allocated on the compute stream (no record_stream) vs as shipped."""
import os, sys
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import torch
from engine.executor import activations as A

variant = sys.argv[1]
if variant == "compute-alloc":
    def restore(self, shape, stride, dtype, src, after):
        s = self.restore_stream
        out = torch.empty_strided(shape, stride, dtype=dtype, device=self.device)  # on the compute stream
        s.wait_stream(self._compute())  # its memory may be freed by compute work issued so far
        if after is not None:
            s.wait_event(after)
        with torch.cuda.stream(s):
            A._bytes(out).copy_(src, non_blocking=True)
        return out, s.record_event()
    def use(self, tensor, event):
        return self.wait(event)
    A._CudaCopies.restore = restore
    A._CudaCopies.use = use
sys.argv = ["train_bench.py"] + sys.argv[2:]
import train_bench
train_bench.main()
