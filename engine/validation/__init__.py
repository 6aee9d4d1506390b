"""mode=validate: the simulator's prediction against the GPU's measurement, config by config.

The configurations come from the trace (`grid`): inference traces get
budgets (BUDGET_FRACTIONS of the model's bytes, up to where compute bounds the
step) x evictions x lookaheads, weights streamed through the executor, and every
weight resident; training traces get the LoRA step with
its weights resident under each activation policy (off, watermark at two
levels, sync dict with two layer counts), spilled by the ActivationOffloader,
and with its frozen weights streamed at the budgets x evictions (activations kept).
Half of them, in a checkerboard over the grid, are held out of the fit
(`held_out`): calibration may tune on the others only.

The measured side needs the GPU (measure.py `measure` for a spec model; a real
module's is engine/modes/module_validate.py) and is written as JSON (format
MEASUREMENTS, one file per trace, beside it: `measurements_path`); the report
(report.py `report`) needs only that JSON, a trace of the model (recorded or
synthesized) and a hardware profile, so it is rebuilt on any CPU from the shipped
measurements. The grid and the steps each row times: grid.py; the report drawn
(validate.png): plot.py.

Measured, per configuration (steps after one warm-up: at least TIMED_STEPS, then
until their median is known within 1% or SETTLE_MS or MAX_TIMED_STEPS is reached;
a step the host bounds moves by tens of percent from one to the next):
    step_ms            CUDA events around the step on the compute stream: the median of
                       the timed steps, or where the simulator's steps vary by design
                       (belady's copies cycle) their mean, as the prediction's
                       (engine.measure.spread.typical_step_ms; `report` takes it from
                       steps_ms: the cold first step, then the timed ones). The steps run
                       in batches; the host waits to read a batch's times, so the next
                       batch's first step starts on an idle GPU and is left out, a
                       warm-up again.
    stall_ms           inference: the compute stream waiting on weight copies,
                       timed by events around each fetch's waits (KernelStamps) in
                       STALL_STEPS steps after the timed ones (median);
                       training: the offloader's timed waits on restores/offloads, or
                       where the frozen weights stream, their waits as an inference's,
                       forward and backward (stamped_stall_ms); None in files measured
                       before those were timed
    peak_device_bytes  inference: the weight pool's used high-water; training: the
                       model's bytes (streamed: the pool's used high-water) plus the
                       allocator's high-water above what was allocated before the step
                       (saved activations and temporaries);
                       a real module's on a GPU: the pool's and torch's allocator's
                       high-water together (the file's "peak": PEAKS)
    reserve_releases,  inference: the CUDA pool's refusals of a block under the budget in the
    relocations        timed steps (POOL_EVENTS), answered by releasing its reserve or by
                       relocating; the driver places the pool's blocks, so the simulator does
                       not predict them and the report marks the rows
The file also says the backend the rows ran on ("backend"), which the prediction takes.
"""
from engine.validation.grid import (ALL_RESIDENT, BUDGET_FRACTIONS, LOOKAHEADS, MAX_TIMED_STEPS, SETTLE_MS, SIM_STEPS,
                                    STALL_STEPS, TIMED_STEPS, TRAIN_LOOKAHEAD, TRAIN_POLICIES, activations_config,
                                    budgets, grid, row_bytes, saved_bytes, training)
from engine.validation.measure import (NO_CUDA, fitting, inference_measurement, link_rates, measure, measured_row,
                                       measurements_header, stamped_stall_ms, time_inference_row,
                                       time_synced_steps, timed_enough)
from engine.validation.report import (MEASUREMENTS, PEAKS, POOL_EVENTS, TIE_Z, measurements_path, predict,
                                      read_measurements, report, report_md, write_measurements)

__all__ = ["ALL_RESIDENT", "BUDGET_FRACTIONS", "LOOKAHEADS", "MAX_TIMED_STEPS", "MEASUREMENTS", "NO_CUDA", "PEAKS",
           "POOL_EVENTS", "SETTLE_MS", "SIM_STEPS", "STALL_STEPS", "TIE_Z", "TIMED_STEPS",
           "TRAIN_LOOKAHEAD", "TRAIN_POLICIES", "activations_config", "budgets", "fitting", "grid",
           "inference_measurement", "link_rates", "measure", "measured_row", "measurements_header",
           "measurements_path", "predict", "read_measurements", "report", "report_md", "row_bytes",
           "saved_bytes", "stamped_stall_ms", "time_inference_row", "time_synced_steps", "timed_enough", "training",
           "write_measurements"]
