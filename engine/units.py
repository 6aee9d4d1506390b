"""Units shared by configs, policies, drivers and reports.

Budgets and memory sizes in the config are decimal megabytes, as GPU memory is
quoted; copy sizes in hardware profiles and probes are binary mebibytes.
"""
from __future__ import annotations

MB = 1_000_000
MIB = 1 << 20


def budget_bytes(budget_mb: float | None) -> int | None:
    """A budget in MB as bytes; None (everything resident) stays None."""
    return None if budget_mb is None else int(round(budget_mb * MB))
