"""Fake ``wandb`` (the calls Megatron-LM's and our writer make): ``init``, ``log``, ``finish``.

Faithful to wandb's signatures where the writer relies on them: ``init(dir=, name=,
project=, entity=, config=, mode=)`` returns a run; ``log(data, step=)``; ``finish()``.
Everything is recorded in :data:`CALLS` for the test to read; nothing touches the network.
"""
from __future__ import annotations

import importlib.machinery
import sys
import types

CALLS: list = []


def install() -> types.ModuleType:
    """Puts this fake in ``sys.modules['wandb']`` (a spawned worker's own process)."""
    module = sys.modules[__name__]
    wandb = types.ModuleType("wandb")
    wandb.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    wandb.init, wandb.log, wandb.finish = module.init, module.log, module.finish
    wandb.CALLS = CALLS
    sys.modules["wandb"] = wandb
    return wandb


def init(*, dir=None, name=None, project=None, entity=None, config=None, mode=None, **kw):
    if kw:
        raise TypeError(f"unexpected wandb.init arguments {sorted(kw)}")
    CALLS.append(("init", dict(dir=dir, name=name, project=project, entity=entity,
                               mode=mode, config_keys=sorted(config or {}))))
    return types.SimpleNamespace(dir=dir, name=name, project=project)


def log(data, step=None, commit=None):
    CALLS.append(("log", dict(data), step))


def finish(exit_code=None):
    CALLS.append(("finish",))
