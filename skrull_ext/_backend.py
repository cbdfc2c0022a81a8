"""Selects the scheduler backend: the C++ core (``skrull_ext._C``) or the Python reference.

``SKRULL_IMPL`` = ``auto`` (default: C++ when built, else Python), ``cpp`` (raise if the
extension is missing) or ``python``.  The choice is made once at import and logged, so a
run's log always says which implementation produced its plans.
"""
from __future__ import annotations

import importlib
import logging
import os

logger = logging.getLogger("skrull_ext")

_VALID = ("auto", "cpp", "python")


def _select():
    impl = os.environ.get("SKRULL_IMPL", "auto").strip().lower() or "auto"
    if impl not in _VALID:
        raise ValueError(f"SKRULL_IMPL={impl!r} is not one of {_VALID}; unset it or pick one")
    if impl == "python":
        return "python", None
    try:
        # By module name, not ``from skrull_ext import _C``: this module is imported while the
        # package initialises, and the extension is a leaf (no edge back to the package).
        _C = importlib.import_module("skrull_ext._C")
    except ImportError as exc:
        if impl == "cpp":
            raise ImportError(
                "SKRULL_IMPL=cpp but the C++ extension skrull_ext._C is not built; "
                "reinstall with SKRULL_BUILD_EXTENSION=1 pip install -e . "
                "(needs a C++17 compiler) or set SKRULL_IMPL=python"
            ) from exc
        return "python", None
    return "cpp", _C


BACKEND, CPP = _select()
logger.info("skrull_ext scheduler backend: %s", BACKEND)
