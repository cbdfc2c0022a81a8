"""Save and resume: model, optimizer, iteration (LR schedule), sampler position, RNG.

Layout (Megatron's legacy naming)::

    <dir>/latest_checkpointed_iteration.txt
    <dir>/iter_0000100/mp_rank_00/model_optim_rng.pt   # one per TP rank
    <dir>/iter_0000100/rng/rank_00000.pt               # one per global rank

Parameters and optimizer state are identical on every DP and CP rank (gradients are
all-reduced over DP x CP), so the DP-0/CP-0 rank of each TP rank writes its shard.  The LR
schedule is a pure function of the iteration, so the iteration is its whole state.  RNG
states are per rank.  The tracker file is written last (after a barrier), atomically: a
crash mid-save leaves the previous checkpoint as the latest.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointMeta:
    """Who this rank is, for file naming and for deciding who writes the shared state."""

    rank: int = 0
    world_size: int = 1
    tp_rank: int = 0
    writes_model: bool = True

    @classmethod
    def from_parallel_state(cls) -> "CheckpointMeta":
        from megatron.core import parallel_state as ps

        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(),
                   tp_rank=ps.get_tensor_model_parallel_rank(),
                   writes_model=ps.get_data_parallel_rank(with_context_parallel=True) == 0)


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _model_file(root: str, iteration: int, tp_rank: int) -> str:
    return os.path.join(iteration_dir(root, iteration), f"mp_rank_{tp_rank:02d}",
                        "model_optim_rng.pt")


def _rng_file(root: str, iteration: int, rank: int) -> str:
    return os.path.join(iteration_dir(root, iteration), "rng", f"rank_{rank:05d}.pt")


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state = {"torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if state["tracker"]:
        tensor_parallel.get_cuda_rng_tracker().set_states(dict(state["tracker"]))


def _atomic_save(obj: Any, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_checkpoint(root: str, trainer, meta: CheckpointMeta,
                    config: Optional[dict[str, Any]] = None) -> str:
    """Writes ``trainer``'s state at its current iteration; collective over the world.

    Args:
        root: ``--save`` directory.
        trainer: :class:`megatron.skrull.training.Trainer`.
        meta: This rank's identity.
        config: JSON-able run description stored for compatibility checks (``model`` key
            is compared on load).

    Returns:
        The iteration directory.
    """
    it = trainer.iteration
    if meta.writes_model:
        _atomic_save({"format_version": FORMAT_VERSION, "iteration": it,
                      "model": trainer.model.state_dict(),
                      "optimizer": trainer.optimizer.state_dict(),
                      "sampler": trainer.sampler.state_dict(),
                      "config": config or {}}, _model_file(root, it, meta.tp_rank))
    _atomic_save(_rng_state(), _rng_file(root, it, meta.rank))
    if dist.is_initialized():
        dist.barrier()
    if meta.rank == 0:
        tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(it))
        os.replace(tmp, os.path.join(root, TRACKER))
        logger.info("saved checkpoint of iteration %d to %s", it, root)
    if dist.is_initialized():
        dist.barrier()
    return iteration_dir(root, it)


def latest_iteration(root: str) -> Optional[int]:
    """Iteration named by ``root``'s tracker file; ``None`` when there is no checkpoint."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise ValueError(f"{path} holds {text!r}, not an iteration number; fix or delete it")
    return int(text)


def load_checkpoint(root: str, trainer, meta: CheckpointMeta,
                    config: Optional[dict[str, Any]] = None, *, finetune: bool = False,
                    load_optim: bool = True, load_rng: bool = True) -> Optional[int]:
    """Restores ``trainer`` from ``root``'s latest checkpoint.

    Megatron's fine-tuning flags: ``finetune`` loads the model weights only and keeps the
    trainer at iteration 0 (fresh optimizer, sampler and RNG); ``load_optim=False`` /
    ``load_rng=False`` skip the optimizer / RNG state.

    Returns:
        The resumed iteration, or ``None`` (trainer untouched) when ``root`` has no
        checkpoint -- Megatron's behaviour, so ``--save X --load X`` restart loops work.

    Raises:
        ValueError: The checkpoint's model config differs from ``config['model']``.
    """
    it = latest_iteration(root)
    if it is None:
        logger.warning("no checkpoint in %s (no %s): starting from scratch", root, TRACKER)
        return None
    state = torch.load(_model_file(root, it, meta.tp_rank), map_location="cpu",
                       weights_only=False)
    saved_model = state.get("config", {}).get("model")
    if config and saved_model is not None and saved_model != config.get("model"):
        diff = sorted(k for k in saved_model if saved_model.get(k) != config["model"].get(k))
        raise ValueError(f"checkpoint {iteration_dir(root, it)} was saved with different model "
                         f"flags ({', '.join(diff)}); resume with the flags it was saved with")
    trainer.model.load_state_dict(state["model"])
    if finetune:
        logger.info("--finetune: model weights of iteration %d loaded, starting at 0", it)
        return 0
    if load_optim:
        trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.sampler.load_state_dict(state["sampler"])
    trainer.iteration = int(state["iteration"])
    rng = _rng_file(root, it, meta.rank)
    if load_rng and os.path.isfile(rng):
        _set_rng_state(torch.load(rng, map_location="cpu", weights_only=False))
    elif load_rng:
        logger.warning("%s missing (different world size?): RNG not restored", rng)
    return it
