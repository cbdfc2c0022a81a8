"""Shared helpers of the Megatron-side tests: spawning gloo workers and tiny configs."""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import traceback
from typing import Any, Callable, Sequence

import torch

TINY_FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--num-query-groups", "2", "--swiglu", "--normalization", "RMSNorm",
    "--disable-bias-linear", "--seq-length", "96", "--global-batch-size", "6",
    "--lr", "3e-3", "--train-iters", "20", "--skrull-bucket-size", "256",
    "--device", "cpu", "--mock-num-samples", "64", "--log-interval", "1",
]


def tiny_config(extra: Sequence[str] = (), world_size: int = 1):
    """A RunConfig of the 2-layer, hidden-64 test model (``extra`` flags override)."""
    from megatron.skrull.arguments import parse_args

    return parse_args(list(TINY_FLAGS) + list(extra), world_size=world_size)


def drop_flag(flags: Sequence[str], name: str) -> list[str]:
    """``flags`` without every ``name VALUE`` pair (e.g. to give a flag's other spelling)."""
    out = list(flags)
    while name in out:
        at = out.index(name)
        del out[at:at + 2]
    return out


def _entry(fn: Callable, rank: int, world: int, tmp: str, args: tuple) -> None:
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        fn(rank, world, tmp, *args)
    except BaseException:
        with open(os.path.join(tmp, f"error_rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, tmp_path, *args: Any, timeout: float = 240) -> None:
    """Runs ``fn(rank, world_size, tmp_dir, *args)`` in ``world_size`` spawned processes.

    Each process joins a gloo group through a file store in ``tmp_path``.  Raises with the
    workers' tracebacks when one fails or the timeout passes.
    """
    tmp = str(tmp_path)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, tmp, args))
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    for p in procs:
        p.join(max(1.0, (deadline - datetime.datetime.now()).total_seconds()))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    errors = []
    for r in range(world_size):
        path = os.path.join(tmp, f"error_rank{r}.txt")
        if os.path.exists(path):
            errors.append(f"rank {r}:\n{open(path).read()}")
    if hung or errors or any(p.exitcode != 0 for p in procs):
        raise AssertionError(f"workers failed (hung: {len(hung)}, exit codes "
                             f"{[p.exitcode for p in procs]}):\n" + "\n".join(errors))


def single_and_world(tmp_path_factory, single: Callable, worker: Callable, world: int = 4,
                     timeouts: tuple[float, float] = (200, 400)) -> tuple[Any, list[Any]]:
    """Runs ``single`` in one process and ``worker`` in ``world``; returns what they saved.

    ``single`` writes ``single.pt`` and each worker rank ``out{rank}.pt`` into its tmp dir.
    """
    one, many = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("world")
    spawn(single, 1, one, timeout=timeouts[0])
    spawn(worker, world, many, timeout=timeouts[1])
    load = lambda path: torch.load(path, weights_only=False)  # noqa: E731
    return (load(os.path.join(one, "single.pt")),
            [load(os.path.join(many, f"out{r}.pt")) for r in range(world)])
