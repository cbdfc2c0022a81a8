"""Fakes of the GPU libraries (flash-attn, Transformer Engine) and of CUDA streams.

They hold the libraries' contracts as read from their sources (signatures, return
values, in-place outputs, required arguments) and compute with torch on CPU in any dtype,
so the adapters are driven for real in CPU tests.  Install them only inside a test
(:func:`install` with pytest's ``monkeypatch``) or inside a spawned worker process
(:func:`install_in_process`); they never leak into other tests.
"""
from __future__ import annotations

import sys

from fakes import flash_attn as fake_flash
from fakes import transformer_engine as fake_te
from fakes.streams import FakeStreams

FLASH_VERSIONS = ("2.6.3", "2.7.0", "2.8.3")


def _modules(kind: str, version: str, log: list) -> dict:
    if kind == "flash":
        return fake_flash.modules(version)
    if kind == "te":
        return fake_te.modules(version, log)
    raise KeyError(kind)


def _reset_kernel_state(setattr_fn) -> None:
    """Fresh kernel caches, so no adapter built over a fake outlives the fake."""
    from skrull_ext.attention import choice, streams

    setattr_fn(choice, "_CACHE", {})
    setattr_fn(choice, "_LOGGED", set())
    setattr_fn(streams, "_STREAMS", {})


def install(monkeypatch, kind: str, version: str, log: list = None) -> dict:
    """Installs the fake package ``kind`` (``flash`` or ``te``) for one test."""
    mods = _modules(kind, version, log if log is not None else [])
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    _reset_kernel_state(monkeypatch.setattr)
    return mods


def install_streams(monkeypatch, log: list) -> FakeStreams:
    """Makes every device use recording fake streams (for one test)."""
    from skrull_ext.attention import streams

    fake = FakeStreams(log)
    monkeypatch.setattr(streams, "_PROVIDER", lambda device: fake)
    monkeypatch.setattr(streams, "_STREAMS", {})
    return fake


def install_in_process(kind: str, version: str, log: list = None) -> dict:
    """Same as :func:`install` for a spawned test worker (its own process, no undo)."""
    mods = _modules(kind, version, log if log is not None else [])
    sys.modules.update(mods)
    _reset_kernel_state(setattr)
    return mods


def uninstall_in_process(mods: dict) -> None:
    """Removes a worker's fake package and the kernels built over it."""
    for name in mods:
        sys.modules.pop(name, None)
    _reset_kernel_state(setattr)
