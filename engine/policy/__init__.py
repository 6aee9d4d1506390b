"""Policy interfaces: the decisions both drivers (simulator and executor) ask for.

A policy owns decisions, a driver owns time and hardware (docs/DESIGN.md,
"one policy, two clocks"). Policies import neither torch nor simpy. Every answer is
logged as a `Decision`; given the same access order and config, the simulator
and the executor must produce identical decision logs, so a policy's answers
may depend only on the order of the questions, never on timing.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Mapping, Protocol


@dataclass(frozen=True)
class Decision:
    """One logged policy answer.

    action (weights):     "hit" | "fetch" | "prefetch" | "evict" | "hazard"
    action (activations): "keep" | "spill" | "miss" | "restore" | "release"
                          | "offload_group" | "wait_offload" | "reload_group"
    `position` is the access-order position the driver was at when it asked
    (for a hazard: the reader's position, the kernel that may still read the
    evicted weight; for activation decisions: the layer, the tensor's or the
    one the driver's on_layer_* call names);
    `detail` is the position a fetch/prefetch serves, the position an evict
    makes room for, the evicting position of a hazard, the size-class index
    of a spill, or the group's layer of a sync-dict group decision (-1 where
    nothing applies).
    """

    step: int
    position: int
    action: str
    target: str
    detail: int = -1


# How a driver runs its steps: "free", the host launches the next step without waiting
# (a loop that never reads its output); "synced", the host waits for each step's last
# kernel first (a loop that reads each output: a sampled token, a latent on the host).
LOOPS = ("free", "synced")


def waits_for_step(loop: str, step: int) -> bool:
    """Whether a driver's host waits for step `step`'s last kernel before it starts the next:
    a synced loop after every step; every loop after its first, the warm-up. The cold first
    step copies every weight in, and a host that queued the next steps meanwhile would have
    them run back to back at the GPU's pace, which a host-bound loop does not keep up."""
    return loop == "synced" or step == 0


KEEP_STEPS = 16  # steps of decisions and telemetry a long-running driver keeps (keep_last_steps)


def keep_last(items: list, keep: int) -> None:
    """Drop, in place, all but the last `keep` items (a step's telemetry, one per step)."""
    del items[:max(0, len(items) - keep)]


def keep_last_steps(log: list[Decision], keep: int | None) -> None:
    """Drop, in place, the decisions of all but the last `keep` steps logged
    (None keeps everything). Why: a driver that runs for hours logs thousands
    of decisions a step; kept forever they are a slow leak. Logs are in step order."""
    if keep is None or not log:
        return
    first = log[-1].step - keep + 1
    if log[0].step >= first:
        return
    del log[:bisect_left(log, first, key=lambda d: d.step)]


@dataclass(frozen=True)
class AccessOrder:
    """One step's kernels in launch order and the weights each reads.

    For training this is the forward kernels followed by the backward kernels
    (reverse order), so a weight appears twice per step. Steps repeat the same
    order cyclically, which is what lets Belady and the priority set plan.
    """

    kernels: tuple[str, ...]
    reads: tuple[tuple[str, ...], ...]
    sizes: Mapping[str, int]

    def __len__(self) -> int:
        return len(self.kernels)

    def kernel_bytes(self, position: int) -> int:
        return sum(self.sizes[w] for w in self.reads[position])


class WeightPolicy(Protocol):
    """Residency and prefetch for streamed weights (engine/policy/weights.py)."""

    log: list[Decision]

    def issue(self, position: int) -> list[Decision]:
        """Decisions for issuing the kernel at `position` (0..len(order)-1).

        Called once per kernel in launch order; wrapping to 0 starts a new
        step. The list is in the order the driver carries it out: evictions
        before the fetch they make room for, demand fetches for this kernel
        before prefetches for later ones.
        """
        ...


@dataclass
class StepCounters:
    """What one step's activation policy did; `pool_*` count this step's spills.

    The policy keeps one per step as it decides (`ActivationPolicy.history`);
    both drivers report these figures from it rather than counting again.
    """

    saved: int = 0  # saved tensors put to the policy: those of at least its min_tensor_bytes
    kept: int = 0  # saved tensors never spilled in the step
    spilled: int = 0  # pool hits and misses alike
    restored: int = 0
    spill_bytes: int = 0
    restore_bytes: int = 0
    pool_hits: int = 0
    pool_misses: int = 0
    peak_device_bytes: int = 0  # logical bytes of saved tensors on the device

    @classmethod
    def all_kept(cls, saved: int) -> StepCounters:
        """A step with no activation policy: every one of `saved` tensors stays."""
        return cls(saved=saved, kept=saved)


class ActivationPolicy(Protocol):
    """Keep-or-spill and restore for saved activations (activations.py, sync.py).

    The order of the questions within a step is engine/policy/schedule.py's.
    """

    log: list[Decision]
    history: list[StepCounters]  # one per finished step
    # Saved tensors under this many bytes never spill: the drivers hold them as they
    # are and never ask about them (engine/policy/schedule.py).
    min_tensor_bytes: int

    def on_save(self, tensor: str, nbytes: int, layer: int) -> list[Decision]:
        """Forward: autograd saved `tensor`. One save can make the policy spill
        older tensors too (a watermark crossed), so the answer is a list: the
        spills of older tensors first, oldest first, and last the new tensor's
        own answer, "keep", "spill" or "miss"."""
        ...

    def on_layer_start(self, phase: str, layer: int) -> list[Decision]:
        """`phase` ("fwd" | "bwd") is about to run `layer`: e.g. wait_offload
        for a sync-dict group that must be off the device before it."""
        ...

    def on_layer_end(self, phase: str, layer: int) -> list[Decision]:
        """`phase` finished `layer`: e.g. offload_group after its forward,
        reload_group after a later layer's backward."""
        ...

    def on_unpack(self, tensor: str) -> list[Decision]:
        """Backward needs `tensor`: restores to issue now (a demand restore of
        `tensor` itself first, when it is still off the device; then predictive
        ones for tensors backward needs soon), and last its "release"."""
        ...

    def on_step_end(self) -> None:
        """The step's backward is done: every saved tensor must have been
        released (raises otherwise); per-step state and counters reset."""
        ...

