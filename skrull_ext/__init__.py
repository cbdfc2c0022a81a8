"""Skrull scheduling for long-context SFT: cost model, DACP/GDS scheduler, DACP attention.

Framework-agnostic (torch + numpy only). ``BACKEND`` says whether the scheduler's hot
loops run in the C++ core (``"cpp"``) or the pure-Python reference (``"python"``);
select with ``SKRULL_IMPL=auto|cpp|python``.
"""
from skrull_ext._backend import BACKEND

__all__ = ["BACKEND"]
__version__ = "0.1.0"
