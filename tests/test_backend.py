"""Backend selection (``SKRULL_IMPL``) and the ``skrull_ext._C`` binding contract."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import skrull_ext
from skrull_ext import _backend
from skrull_ext.scheduler import SchedulerConfig, schedule

ROOT = Path(__file__).resolve().parents[1]


def _hide_extension(monkeypatch):
    """Makes ``from skrull_ext import _C`` fail as if the extension were never built."""
    monkeypatch.setitem(sys.modules, "skrull_ext._C", None)
    monkeypatch.delattr(skrull_ext, "_C", raising=False)


def test_cpp_required_but_missing_raises_clear_import_error(monkeypatch):
    _hide_extension(monkeypatch)
    monkeypatch.setenv("SKRULL_IMPL", "cpp")
    with pytest.raises(ImportError, match=r"SKRULL_IMPL=cpp .*not built.*SKRULL_IMPL=python"):
        _backend._select()


def test_auto_falls_back_to_python_when_missing(monkeypatch):
    _hide_extension(monkeypatch)
    monkeypatch.setenv("SKRULL_IMPL", "auto")
    assert _backend._select() == ("python", None)


def test_cpp_missing_in_a_fresh_interpreter(tmp_path):
    """A copy of the package without the built .so, imported with SKRULL_IMPL=cpp."""
    shutil.copytree(ROOT / "skrull_ext", tmp_path / "skrull_ext",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    env = dict(os.environ, SKRULL_IMPL="cpp", PYTHONPATH=str(tmp_path))
    # An editable install (pip install -e) maps skrull_ext to the source tree through a
    # meta-path finder that would win over PYTHONPATH: drop it so the copy is imported.
    prelude = ("import sys; sys.meta_path = [f for f in sys.meta_path "
               "if '__editable__' not in getattr(f, '__module__', '')]; ")
    run = subprocess.run([sys.executable, "-c", prelude + "import skrull_ext"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "SKRULL_IMPL=cpp but the C++ extension skrull_ext._C is not built" in run.stderr
    env["SKRULL_IMPL"] = "auto"
    run = subprocess.run(
        [sys.executable, "-c", prelude + "import skrull_ext; print(skrull_ext.BACKEND)"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "python", run.stderr


def test_python_forces_reference(monkeypatch):
    monkeypatch.setenv("SKRULL_IMPL", "python")
    assert _backend._select() == ("python", None)
    monkeypatch.setenv("SKRULL_IMPL", " Python ")  # case and blanks are forgiven
    assert _backend._select() == ("python", None)


@pytest.mark.parametrize("value", ["c++", "fast", "1"])
def test_bad_values_rejected(monkeypatch, value):
    monkeypatch.setenv("SKRULL_IMPL", value)
    with pytest.raises(ValueError, match="SKRULL_IMPL"):
        _backend._select()


def test_schedule_backend_cpp_without_extension(monkeypatch):
    monkeypatch.setattr(_backend, "CPP", None)
    with pytest.raises(ImportError, match="not built"):
        schedule([10, 20], SchedulerConfig(dp_size=1, cp_size=2, bucket_size=64), backend="cpp")


def test_ci_uses_cpp():
    """CI builds the extension: the C++ backend must really be the one under test there."""
    if os.environ.get("CI", "").lower() != "true" and os.environ.get("SKRULL_REQUIRE_CPP") != "1":
        pytest.skip("only enforced in CI (CI=true or SKRULL_REQUIRE_CPP=1)")
    assert skrull_ext.BACKEND == "cpp"


# ---- the _C binding contract ---------------------------------------------------------

@pytest.fixture()
def ext():
    return pytest.importorskip("skrull_ext._C", reason="C++ extension not built")


def test_cpp_selected_when_required(ext, monkeypatch):
    monkeypatch.setenv("SKRULL_IMPL", "cpp")
    assert _backend._select() == ("cpp", ext)


def test_binding_accepts_any_array_like(ext):
    lengths = [300, 20, 5000]
    costs = [3.0, 0.2, 50.0]
    comm = np.zeros(3, dtype=np.float32)
    want = ext.gds_schedule(np.array(lengths), np.array(costs), np.zeros(3), 0.0, 2, 2, 4096, 2)
    got = ext.gds_schedule(lengths, np.array(costs)[::-1][::-1], comm, 0.0, 2, 2, 4096, 2)
    assert got == want
    assert isinstance(got, list) and isinstance(got[0][0], tuple)
    dist, local = got[0][0]
    assert isinstance(dist, list) and isinstance(local, list) and len(local) == 2


def test_binding_rejects_bad_input(ext):
    z = np.zeros(3)
    ok = (np.array([1, 2, 3]), np.ones(3), z, 0.0, 1, 2, 64, 0, 0.0)
    ext.gds_schedule(*ok)

    def call(i, value):
        args = list(ok)
        args[i] = value
        return ext.gds_schedule(*args)

    with pytest.raises(ValueError, match="1-D"):
        call(0, np.ones((3, 1), dtype=np.int64))
    with pytest.raises(ValueError, match="costs has 2 entries"):
        call(1, np.ones(2))
    with pytest.raises(ValueError, match="not finite"):
        call(1, np.array([1.0, np.nan, 1.0]))
    with pytest.raises(ValueError, match="length 0"):
        call(0, np.array([1, 0, 3]))
    with pytest.raises(ValueError, match="rollback code 3"):
        call(7, 3)
    with pytest.raises(ValueError, match="dp_size must be >= 1"):
        call(4, 0)
    with pytest.raises(ValueError, match="cannot fit even when distributed"):
        call(0, np.array([1, 200, 3]))
    with pytest.raises(IndexError, match="out of range"):
        ext.dacp_place(np.array([5, 6]), np.ones(2), np.array([0, 2]), 2, 64, 0)
    with pytest.raises(ValueError, match="use dacp_best"):
        ext.dacp_place(np.array([5, 6]), np.ones(2), np.array([0, 1]), 2, 64, 2)
    with pytest.raises(ValueError, match="m must be >= 1"):
        ext.interleave(np.arange(4), 0)
