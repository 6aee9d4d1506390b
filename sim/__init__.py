"""The SimPy model of GPU offloading: link, pool, compute stream, launcher."""
from sim.simulator import SimResult, drive, simulate

__all__ = ["SimResult", "drive", "simulate"]
