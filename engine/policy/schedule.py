"""The step's question schedule: in which order a driver asks an activation policy.

Both drivers (the simulator's launcher, the executor's offloader) and the pool
sizing ask through `StepSchedule`, so the policy hears the same questions in
the same order from each of them:

1. at a layer boundary (the phase or the layer changes): the previous layer's
   "layer_end", then the new layer's "layer_start" (layer -1, outside the
   blocks, has neither);
2. before a kernel runs: an "unpack" for each saved tensor it needs first;
3. after it ran: a "save" for each tensor it saved;
4. at the step's end: the last layer's "layer_end", then "step_end".

A saved tensor under the policy's `min_tensor_bytes` never spills, so it is
not asked about at all: the driver holds it as it is and frees it when
backward has used it (`StepSchedule.asks`, `KernelQuestions.held`). A real model saves hundreds of such
tensors a step (norm statistics, biases, small-sequence branches); asking
about each cost the hooks most of their host time.

The weight policy's issue(position) for a kernel comes after its boundary's
questions and before its unpacks (sim/launcher.py; in the executor,
KernelTracking enters the kernel's layer before the weights are fetched).

A question is a tuple, so it can be recorded and put again to a bare policy:
("save", name, nbytes, layer) | ("unpack", name) | ("layer_start" | "layer_end",
phase, layer) | ("step_end",).
"""
from __future__ import annotations

from typing import Iterable, NamedTuple, Protocol, Sequence

from engine.policy import ActivationPolicy, Decision

Question = tuple


class SavedLike(Protocol):
    """A tensor a kernel saves (engine.models.spec.SavedTensor)."""

    name: str
    nbytes: int
    layer: int


class KernelLike(Protocol):
    """What the schedule reads of one kernel (engine.trace.KernelRecord)."""

    phase: str  # "fwd" | "bwd"
    layer: int
    needs: Sequence[str]
    saved: Sequence[SavedLike]


class KernelQuestions(NamedTuple):
    """One kernel's questions, in order: `boundary` and `unpacks` before it runs, `saves` after;
    `held`: the tensors it needs that were held unasked (under min_tensor_bytes)."""

    boundary: list[Question]
    unpacks: list[Question]
    saves: list[Question]
    held: list[str]


class StepSchedule:
    """The questions of one step, as the driver reaches each point of it (module docstring).

    A driver that walks kernel records calls `kernel(rec)` for each and `end()`
    once; one driven by autograd's hooks calls `enter`, `unpack` and `save` as
    it meets them (`save` only where `asks`), then `end()`. `min_tensor_bytes`
    is the policy's (ActivationPolicy.min_tensor_bytes; 0 asks about every tensor).
    """

    def __init__(self, min_tensor_bytes: int = 0) -> None:
        self.boundary: tuple[str, int] | None = None  # (phase, layer) the driver is in
        self.min_tensor_bytes = min_tensor_bytes
        self._held: set[str] = set()  # this step's saved tensors held unasked

    def asks(self, nbytes: int) -> bool:
        """Whether a saved tensor of `nbytes` is put to the policy (else held as it is)."""
        return nbytes >= self.min_tensor_bytes

    def enter(self, phase: str, layer: int) -> list[Question]:
        """The driver is in `phase` of `layer`: the boundary's questions (none if it already was)."""
        if self.boundary == (phase, layer):
            return []
        out = self._end_layer()
        if layer >= 0:
            out.append(("layer_start", phase, layer))
        self.boundary = (phase, layer)
        return out

    @staticmethod
    def unpack(name: str) -> Question:
        return ("unpack", name)

    @staticmethod
    def save(name: str, nbytes: int, layer: int) -> Question:
        return ("save", name, nbytes, layer)

    def kernel(self, rec: KernelLike) -> KernelQuestions:
        boundary = self.enter(rec.phase, rec.layer)
        saves = []
        for s in rec.saved:
            if self.asks(s.nbytes):
                saves.append(self.save(s.name, s.nbytes, s.layer))
            else:
                self._held.add(s.name)
        unpacks = [self.unpack(n) for n in rec.needs if n not in self._held]
        return KernelQuestions(boundary, unpacks, saves, [n for n in rec.needs if n in self._held])

    def end(self) -> list[Question]:
        """The step is over: the last layer's end, then "step_end"; the next step starts afresh."""
        out = self._end_layer()
        self.boundary = None
        self._held = set()
        return out + [("step_end",)]

    def _end_layer(self) -> list[Question]:
        if self.boundary is not None and self.boundary[1] >= 0:
            return [("layer_end", *self.boundary)]
        return []


def step_questions(records: Iterable[KernelLike], min_tensor_bytes: int) -> list[Question]:
    """Every question one step of kernel records puts to a policy of `min_tensor_bytes`, in order."""
    schedule = StepSchedule(min_tensor_bytes)
    out: list[Question] = []
    for rec in records:
        q = schedule.kernel(rec)
        out += q.boundary + q.unpacks + q.saves
    return out + schedule.end()


_METHODS = {"save": "on_save", "unpack": "on_unpack", "layer_start": "on_layer_start",
            "layer_end": "on_layer_end"}


def ask(policy: ActivationPolicy, question: Question) -> list[Decision]:
    """Put one question to `policy`; its answers (none for step_end)."""
    kind, *args = question
    if kind == "step_end":
        policy.on_step_end()
        return []
    return getattr(policy, _METHODS[kind])(*args)


def replay(policy: ActivationPolicy, questions: Sequence[Question]) -> list[Decision]:
    """Every answer a bare policy gives to `questions`, in order."""
    out: list[Decision] = []
    for q in questions:
        out += ask(policy, q)
    return out
