"""Spawning a gloo process group for a test, with a hard timeout."""
from __future__ import annotations

import json
import os
import time

import torch.multiprocessing as mp


def spawn_and_collect(fn, world: int, tmp_dir, args=(), timeout: float = 240.0) -> list[dict]:
    """Runs ``fn(rank, world, store, out_dir, *args)`` on ``world`` processes.

    Each rank is expected to write ``<out_dir>/result_<rank>.json``; those dicts are
    returned in rank order.  Processes still running after ``timeout`` seconds are
    killed (only the ones started here) and ``TimeoutError`` is raised.
    """
    tmp_dir = str(tmp_dir)
    store = os.path.join(tmp_dir, "store")
    ctx = mp.start_processes(fn, args=(world, store, tmp_dir, *args), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{world} worker processes did not finish within {timeout} s")
    out = []
    for rank in range(world):
        with open(os.path.join(tmp_dir, f"result_{rank}.json")) as f:
            out.append(json.load(f))
    return out
