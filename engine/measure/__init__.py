"""mode=record's measuring parts: one step of a spec-built model, timed kernel by kernel.

What is measured, and how (CUDA events on the GPU; `CpuClock` gives the same
path perf_counter timestamps for the cpu backend and CPU tests):

- **Kernels** (timing.py). `KernelStamps` wraps the weight source that
  `engine.models.forward` fetches from once per spec kernel, before its math:
  it stamps the compute stream before and after each fetch. Kernel i ran from
  the stamp after fetch i to the stamp before fetch i+1; the time between the
  two stamps of one fetch is the compute stream waiting for that fetch's
  copies (the stall). Before each timed step the stream is held by a spin
  kernel while the host queues the step, so stamps measure the GPU, not gaps
  where the host was late. Per-kernel times are medians over `TIMED_STEPS`
  steps after `WARMUP_STEPS`.
- **Backward (LoRA training step)** (timing.py). Saved-tensor hooks log what
  each forward kernel saves (bytes of each distinct storage; frozen weights
  and adapters are weights, not activations) and stamp the stream when the
  backward first unpacks a kernel's tensors. The time from one such stamp to
  the next is split over the backward records it covers in proportion to
  their predicted times (ExecutionTimePredictor): autograd runs nodes, not
  spec kernels.
- **Host costs.** perf_counter around each kernel's host work (the forward's
  Python and launches) and around each fetch of a streamed forward.
- **Launches** (launches.py, CUDA only). One more step under torch.profiler, a
  mark where each kernel starts (backward: at its first unpack): the CUDA
  launches of each record, and the tensors each forward kernel hands the
  saved-tensor hooks (the simulator's launch queue and hook costs).
- **Copies** (probes.py, CUDA only). A streamed forward through the
  WeightExecutor at the configured budget: each weight copy is timed on the
  copy stream and kept in its kernel's record (`copies`). Probes: pinned H2D
  and D2H copies by size, both directions at once, pool allocation latency,
  and the recorded step's time while a stream of H2D copies runs beside it.

- **Spread** (spread.py). How well timed steps know their median: the module
  recorder times its all-resident steps until it is known, and the reports set
  the steps a median is taken over beside it.

`build_trace` (timing.py) turns a timed step into a trace; the header carries
the probes and host figures under "probes" (probes.PROBES_DOC), from which
`engine.calibrate` fits a hardware profile. engine/modes/record.py runs it all.
"""
