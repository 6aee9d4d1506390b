"""Host launch time of small CUDA ops before and after one torch.profiler session (CPU+CUDA),
and GPU time of a matmul chain, in one process. argv[1]: a label."""
import os, sys, time, statistics, torch
x = torch.zeros(1024, device="cuda")
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
def host_us(n=20000):
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n):
        x.add_(1.0)
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host
def gpu_ms():
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(50):
        a @ a
    e.record(); torch.cuda.synchronize(); return s.elapsed_time(e)
for _ in range(3): host_us(2000); gpu_ms()
before = [host_us() for _ in range(5)]; gb = [gpu_ms() for _ in range(5)]
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as p:
    for _ in range(100): x.add_(1.0)
    torch.cuda.synchronize()
after = [host_us() for _ in range(5)]; ga = [gpu_ms() for _ in range(5)]
time.sleep(2)
later = [host_us() for _ in range(5)]
print(f"{sys.argv[1]:>24}: host us/launch before {statistics.median(before):.2f}, after profiler {statistics.median(after):.2f}, "
      f"2 s later {statistics.median(later):.2f}; 50 matmuls {statistics.median(gb):.2f} -> {statistics.median(ga):.2f} ms")
