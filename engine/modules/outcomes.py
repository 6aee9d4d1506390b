"""The plain module's outputs, and each offloaded step's output compared with them.

A forward whose own kernels are not deterministic (Llama decode's logits on some inputs) gives
more than one output for the same inputs: an offloaded step is right when it is bitwise one of
them. The offloaded steps are compared on the device as they come, so the loop neither waits for
the host nor keeps its outputs past their step; a step that matches none still passes when it
lies within the plain outputs' own spread (a finite sample of such a forward need not hold every
outcome), the rule engine/modes/spec_run.py applies to the spec models.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.executor.setup import bitwise_equal

CHUNK_ELEMENTS = 1 << 22  # elements compared at a time: the comparison's temporaries stay small


def distinct(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The bitwise-different outputs among `outputs`, in order."""
    kept: list[torch.Tensor] = []
    for out in outputs:
        if not any(bitwise_equal(out, k) for k in kept):
            kept.append(out)
    return kept


def _compare(out: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """On the device, without waiting for it: whether `out` differs from `ref` in any bit, and
    the largest elementwise |out - ref|; None where the dtype or shape differs."""
    if out.dtype != ref.dtype or out.shape != ref.shape:
        return None
    a, b = out.detach().contiguous().reshape(-1), ref.reshape(-1)
    differs, diffs = [], []
    for i in range(0, max(a.numel(), 1), CHUNK_ELEMENTS):
        x, y = a[i:i + CHUNK_ELEMENTS], b[i:i + CHUNK_ELEMENTS]
        differs.append(torch.ne(x.view(torch.uint8), y.view(torch.uint8)).any())
        if not (x.is_floating_point() or x.is_complex()):
            x, y = x.float(), y.float()
        diffs.append(torch.sub(x, y).abs().amax().float() if x.numel() else torch.zeros((), device=x.device))
    if len(differs) == 1:
        return differs[0], diffs[0]
    return torch.stack(differs).any(), torch.stack(diffs).amax()


def _distance(diff: float) -> float:
    """A difference as a distance: NaN (an output NaN where the other is not) is infinitely far."""
    return math.inf if math.isnan(diff) else diff


@dataclass(frozen=True)
class Verdict:
    """The offloaded steps against the plain outputs: each step's bitwise match, how many
    different outputs the plain steps gave and how far apart (`spread`), the unmatched steps'
    distance from the nearest, and whether the run passes."""

    bitwise: list[bool]
    outcomes: int
    plain_steps: int
    spread: float
    unmatched_diff: float

    @property
    def passed(self) -> bool:
        return all(self.bitwise) or (self.spread > 0 and self.unmatched_diff <= self.spread)

    def text(self) -> str:
        """One line for the report."""
        steps = len(self.bitwise)
        own = (f" (its own {self.plain_steps} steps gave {self.outcomes} different outputs, "
               f"up to {self.spread:.3g} apart)" if self.outcomes > 1 else "")
        if all(self.bitwise):
            return f"True{own}"
        matched = sum(self.bitwise)
        if self.passed:
            return (f"True in {matched} of {steps} steps{own}; the other {steps - matched} lie within "
                    f"{self.unmatched_diff:.3g} of one, inside that spread")
        return (f"False: {steps - matched} of {steps} steps match none of the plain module's "
                f"{self.outcomes} output{'s' if self.outcomes > 1 else ''}, the farthest "
                f"{self.unmatched_diff:.3g} from the nearest{own}")

    def summary(self) -> dict:
        return {"outcomes": self.outcomes, "plain_steps": self.plain_steps, "spread": self.spread,
                "unmatched_max_diff": self.unmatched_diff, "passed": self.passed}


class Comparison:
    """The outputs of the plain module's `steps` steps (`outputs`: one a step, or already
    distinct), kept distinct on their device, and each offloaded step's output compared with
    them as it comes (`add`); `verdict` waits once."""

    def __init__(self, outputs: list[torch.Tensor], steps: int) -> None:
        self.plain_steps = steps
        self.outcomes = distinct(outputs)
        pairs = [_compare(x, y) for i, x in enumerate(self.outcomes) for y in self.outcomes[:i]]
        self.spread = max((math.inf if p is None else _distance(p[1].item()) for p in pairs), default=0.0)
        self._steps: list[list[tuple[torch.Tensor, torch.Tensor] | None]] = []

    @property
    def held_bytes(self) -> int:
        """The device bytes the kept outputs hold."""
        return sum(o.numel() * o.element_size() for o in self.outcomes)

    def add(self, out: torch.Tensor) -> None:
        self._steps.append([_compare(out, ref) for ref in self.outcomes])

    def verdict(self) -> Verdict:
        bitwise, unmatched = [], 0.0
        for step in self._steps:
            found = [(bool(p[0].item()), _distance(p[1].item())) for p in step if p is not None]
            match = any(not differs for differs, _ in found)
            bitwise.append(match)
            if not match:
                unmatched = max(unmatched, min((d for _, d in found), default=math.inf))
        return Verdict(bitwise, len(self.outcomes), self.plain_steps, self.spread, unmatched)
