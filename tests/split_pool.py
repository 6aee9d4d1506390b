"""A host arena whose free space splits on cue: training steps that relocate (the tests of
engine/executor/training.py and engine/modules/training.py)."""
from __future__ import annotations

from engine.errors import PlacementError
from engine.executor.cpu import CpuBackend


class SplitPool(CpuBackend):
    """Host arena that, from each of the allocation counts in `at` on, refuses one
    block as a fragmented pool does (a placement failure under the budget) and again
    after the released reserve, so the runtime relocates; it poisons every block it is
    given back (0xFF bytes: NaN as bf16 and fp32), so a view that outlives its block
    shows in the results."""

    at: tuple = ()

    def __init__(self, cap_bytes: int, granule: int = 1):
        super().__init__(cap_bytes, granule)
        self.calls = 0
        self.next = list(self.at)
        self.state = "placing"  # -> "refused" -> "released" -> "relocating" -> "placing"

    def alloc(self, nbytes: int):
        self.calls += 1
        if (self.state == "placing" and self.next and self.calls >= self.next[0]) or self.state == "released":
            if self.state == "placing":
                self.next.pop(0)
            self.state = "refused" if self.state == "placing" else "relocating"
            raise PlacementError(f"injected: the pool's free space is split (call {self.calls})")
        return super().alloc(nbytes)

    def defragment(self) -> None:
        super().defragment()
        self.state = {"refused": "released", "relocating": "placing"}.get(self.state, self.state)

    def free_after(self, block, mark) -> None:
        super().free_after(block, mark)
        block.data.fill_(0xFF)
