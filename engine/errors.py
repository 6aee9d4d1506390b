"""Typed errors. The CLI turns each into one line on stderr and exit code 2.

Every message names the problem and the fix; no caller should need a traceback
to act on one of these.
"""
from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on bad input or an unsafe request."""

    exit_code = 2


class ConfigError(EngineError, ValueError):
    """A configuration that cannot be run as given."""


class BelowFloorError(ConfigError):
    """The budget is under the floor, the advised minimum: the largest pair of adjacent
    kernels' weights (the hard minimum: under it a hazard is certain) plus the
    lookahead's headroom (between the two, prefetches run short but nothing breaks)."""

    def __init__(self, budget_bytes: int, floor_bytes: int, pair_bytes: int, kernels: tuple[str, str],
                 resident_bytes: int = 0):
        self.budget_bytes = budget_bytes
        self.floor_bytes = floor_bytes
        self.pair_bytes = pair_bytes
        self.kernels = kernels
        need_mb = -(-floor_bytes // 1_000_000)
        resident = (f", plus {resident_bytes / 1e6:.3f} MB of small weights this backend keeps resident"
                    if resident_bytes else "")
        super().__init__(
            f"budget {_mb(budget_bytes)} MB is under the floor of {floor_bytes / 1e6:.3f} MB (the weights of "
            f"{kernels[0]} + {kernels[1]}, {(pair_bytes - resident_bytes) / 1e6:.3f} MB, plus the lookahead's "
            f"prefetches{resident}); use "
            f"budget={need_mb} or more. Hazards are certain only under {pair_bytes / 1e6:.3f} MB; "
            "mode=simulate sim.allow_below_floor=true shows what happens below the floor")


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.0f}" if nbytes >= 10_000_000 else f"{nbytes / 1e6:.3f}"


class TraceError(EngineError, ValueError):
    """A trace file that is not a valid trace of this format."""


class WeightFileError(EngineError, ValueError):
    """A weight file that does not match the model spec."""


class ExecutorError(EngineError, RuntimeError):
    """The executor cannot start or continue (pool, registration, divergence, concurrency)."""


class PlacementError(ExecutorError):
    """The pool refused a block the budget allows: its free bytes are split into
    pieces too small (fragmentation). The runtime releases the pool's unused reserve
    and retries, then relocates its resident blocks and retries; this reaches the
    user only if the last retry fails too."""
