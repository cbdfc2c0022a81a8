"""Save and resume through ``megatron.core.dist_checkpointing`` (``--ckpt-format torch_dist``).

Layout (Megatron's)::

    <dir>/latest_checkpointed_iteration.txt      # tracker, written last (tmp + rename)
    <dir>/iter_0000100/                          # one torch_dist checkpoint per save
        metadata.json  .metadata  common.pt  __<rank>_<n>.distcp

What one checkpoint holds:

* ``model``: the GPT model's ``sharded_state_dict()`` -- global tensors with their TP
  sharding, so a checkpoint saved at one TP/CP/DP layout loads at another;
* ``optimizer``: the mcore optimizer's ``sharded_state_dict(model_sd)`` (the distributed
  optimizer saves ``fully_reshardable``, which reshards over DP x CP); a plain
  ``torch.optim`` optimizer is mapped onto the model's sharded tensors with mcore's own
  ``optim_state_to_sharding_state``;
* ``opt_param_scheduler`` (when the schedule has state), ``iteration``, ``data`` (the
  sampler: iteration and consumed samples, so the data position resumes exactly);
* ``rng_state``: one ``ShardedObject`` per global rank, restored when the layout matches;
* ``skrull``: the run's model flags and layout, compared on load (another model: error).

Crash safety: a save writes a fresh ``iter_*`` directory and only then (after a barrier)
replaces the tracker, so a killed save leaves the previous checkpoint as the latest.  On
load, a newest checkpoint that cannot be read is reported in ONE log line and the previous
complete one is used instead.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron.skrull import errors, optimizer_state
from megatron.skrull.cpu_compat import cpu_checkpoint_io, cuda_to_cpu

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0  # Megatron-LM's current checkpoint_version
_ITER_DIR = re.compile(r"^iter_(\d{7})$")


class CheckpointError(ValueError):
    """Bad ``--load`` input (missing directory, another model): one message, exit 2."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointMeta:
    """This rank's place in the layout (names its RNG shard, checks the layout on load)."""

    rank: int = 0
    world_size: int = 1
    tp_size: int = 1
    cp_size: int = 1
    device: str = "cpu"
    pp_size: int = 1

    @classmethod
    def from_parallel_state(cls, device: Any = "cpu") -> "CheckpointMeta":
        from megatron.core import parallel_state as ps

        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(),
                   tp_size=ps.get_tensor_model_parallel_world_size(),
                   cp_size=ps.get_context_parallel_world_size(),
                   device=torch.device(device).type,
                   pp_size=ps.get_pipeline_model_parallel_world_size())

    @property
    def layout(self) -> dict[str, int]:
        layout = {"world_size": self.world_size, "tp": self.tp_size, "cp": self.cp_size}
        if self.pp_size > 1:  # (kept out at PP = 1: earlier checkpoints compare equal)
            layout["pp"] = self.pp_size
        return layout


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """Megatron's ``--finetune``, ``--no-load-optim``, ``--no-load-rng``."""

    finetune: bool = False
    load_optim: bool = True
    load_rng: bool = True


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> Optional[int]:
    """Iteration named by ``root``'s tracker file; ``None`` when there is none."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} holds {text!r}, not an iteration number; fix or "
                              "delete it")
    return int(text)


def is_complete(path: str) -> bool:
    """A torch_dist checkpoint is complete once its ``metadata.json`` is written (last)."""
    return os.path.isfile(os.path.join(path, "metadata.json"))


def candidate_iterations(root: str) -> list[int]:
    """Iterations to try, newest first: the tracker's, then older complete checkpoints."""
    latest = read_tracker(root)
    if latest is None:
        return []
    older = sorted((int(m.group(1)) for m in map(_ITER_DIR.match, os.listdir(root)) if m),
                   reverse=True)
    return [latest] + [it for it in older
                       if it < latest and is_complete(iteration_dir(root, it))]


def _write_tracker(root: str, iteration: int) -> None:
    tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER))


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPT model under mcore's DDP / Float16Module wrappers (``.module``)."""
    while hasattr(model, "module"):
        model = model.module
    return model


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


def _optimizer_sharded(optimizer, model_sd: dict, is_loading: bool) -> dict:
    """The optimizer's sharded state dict.

    mcore optimizers build it themselves; the distributed optimizer is asked for
    ``fully_reshardable`` (canonical per-parameter state tensors), the sharding
    that loads at any DP x CP size.  A plain ``torch.optim`` optimizer goes through the
    same helpers mcore's ``FP32Optimizer`` uses.
    """
    if hasattr(optimizer, "sharded_state_dict"):
        if is_loading:
            _init_mcore_state(optimizer)
        return optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map, optim_state_to_sharding_state)

    params = [p for g in optimizer.param_groups for p in g["params"]]
    if is_loading:  # the state must exist to receive the loaded tensors
        for p in params:
            if not optimizer.state[p]:
                optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                      "exp_avg": torch.zeros_like(p),
                                      "exp_avg_sq": torch.zeros_like(p)}
    state = optimizer.state_dict()
    steps = {float(s["step"]) for s in state["state"].values() if "step" in s}
    optim_state_to_sharding_state(state, get_param_id_to_sharded_param_map(model_sd, params),
                                  exclude_keys="step")
    state["common_step"] = steps.pop() if len(steps) == 1 else 0.0
    return state


def _init_mcore_state(optimizer) -> None:
    """Gives a fresh mcore optimizer Adam state (and a step) to receive the loaded tensors.

    The distributed optimizer's ``state_dict`` asserts one common ``step`` over its state,
    which a never-stepped optimizer lacks (Megatron-LM loads into a stepped one).
    """
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(opt, "optimizer", None)
        if inner is None or getattr(opt, "init_state_fn", None) is None:
            continue
        opt.init_state_fn(inner, getattr(opt, "config", None))
        for state in inner.state.values():
            state.setdefault("step", torch.zeros((), dtype=torch.float32))


def _distributed_optimizer_load(opt, state: dict) -> None:
    """Loads one ``DistributedOptimizer``'s state, with its Adam ``step`` kept aside.

    Without Apex or Transformer Engine, mcore (0.16) keeps torch Adam's per-parameter
    ``step`` in the inner optimizer's state, but ``load_parameter_state_from_fully_
    reshardable`` copies only the tensor states and then asks every inner state key
    (``step`` included) of the source: a ``KeyError``.  Megatron-LM runs with TE or Apex
    and never takes this path; here (and on any GPU install without them) we load the
    non-tensor state, take ``step`` out while the tensors are copied, and put it back.
    """
    if state.get("param_state_sharding_type") != "fully_reshardable":
        opt.load_state_dict(state)
        return
    param_state = state.pop("param_state")
    del state["param_state_sharding_type"]
    opt.load_state_dict(state)  # param groups, step, grad scaler
    inner = opt.optimizer.state
    steps = {p: s.pop("step") for p, s in inner.items() if "step" in s}
    try:
        opt.load_parameter_state_from_fully_reshardable(param_state)
    finally:
        # mcore hands every parameter the same ``step`` tensor; torch's Adam increments
        # each parameter's ``step`` in place, so a shared one would count N times a step.
        for p, step in steps.items():
            inner[p]["step"] = step.clone()


def _optimizer_load(optimizer, state: dict) -> None:
    if hasattr(optimizer, "sharded_state_dict"):
        chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
        if not any(hasattr(o, "load_parameter_state_from_fully_reshardable") for o in chained):
            optimizer.load_state_dict(state)
            return
        parts = [state] if len(chained) == 1 else [v for _, v in sorted(state.items())]
        for opt, part in zip(chained, parts):
            if hasattr(opt, "load_parameter_state_from_fully_reshardable"):
                _distributed_optimizer_load(opt, part)
            else:
                opt.load_state_dict(part)
        if len(chained) > 1:
            optimizer._synchronize_steps()
        return
    step = torch.tensor(float(state.pop("common_step")), dtype=torch.float32)
    for param_state in state["state"].values():
        param_state["step"] = step.clone()
    optimizer.load_state_dict(state)


def _scheduler(trainer):
    """mcore's ``OptimizerParamScheduler`` (``trainer.scheduler``) or a stateless schedule."""
    return getattr(trainer, "scheduler", None) or getattr(trainer, "schedule", None)


def _rng_sharded(meta: CheckpointMeta, state: Any):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject("rng_state", state, (meta.world_size,), (meta.rank,), replica_id=0)


def _saved_parts(config: Optional[dict]) -> dict[str, bool]:
    """Which optional parts a save writes (``--no-save-optim`` / ``--no-save-rng``)."""
    ckpt = (config or {}).get("checkpoint") or {}
    return {"optimizer": not ckpt.get("no_save_optim"), "rng": not ckpt.get("no_save_rng")}


def _state(trainer, meta: CheckpointMeta, config: Optional[dict], *, is_loading: bool,
           opts: LoadOptions = LoadOptions(), saved_layout: Optional[dict] = None) -> dict:
    """What is saved (or requested on load); ``opts`` drops the parts not to load."""
    model_sd = _unwrap(trainer.model).sharded_state_dict()
    state: dict[str, Any] = {"model": model_sd, "checkpoint_version": CHECKPOINT_VERSION}
    saves = _saved_parts(config)
    if not is_loading or not opts.finetune:
        state["iteration"] = trainer.iteration
        state["data"] = trainer.sampler.state_dict()
        if opts.load_optim if is_loading else saves["optimizer"]:
            state["optimizer"] = _optimizer_sharded(trainer.optimizer, model_sd, is_loading)
            if hasattr(_scheduler(trainer), "state_dict"):
                state["opt_param_scheduler"] = _scheduler(trainer).state_dict()
        if (opts.load_rng and saved_layout == meta.layout) if is_loading else saves["rng"]:
            state["rng_state"] = _rng_sharded(meta, _rng_state())
    if not is_loading:
        state["skrull"] = {"model": (config or {}).get("model"), "layout": meta.layout,
                           "saved": saves}
    return state


def save_checkpoint(root: str, trainer, meta: CheckpointMeta,
                    config: Optional[dict[str, Any]] = None) -> str:
    """Writes ``trainer``'s state at its iteration to ``root``; collective over the world.

    Args:
        root: ``--save`` directory.
        trainer: :class:`megatron.skrull.training.Trainer`.
        meta: This rank's place in the layout.
        config: ``dataclasses.asdict(RunConfig)``; its ``model`` part is checked on load.

    Returns:
        The iteration directory.
    """
    from megatron.core import dist_checkpointing

    it = trainer.iteration
    path = iteration_dir(root, it)
    if meta.rank == 0:
        os.makedirs(root, exist_ok=True)
        if read_tracker(root) == it and is_complete(path):
            logger.info("checkpoint of iteration %d already in %s", it, root)
        elif os.path.isdir(path):  # left by a save that was killed: never the latest
            shutil.rmtree(path)
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    if read_tracker(root) == it and is_complete(path):
        return path
    with cpu_checkpoint_io(meta.device), cuda_to_cpu(meta.device):
        dist_checkpointing.save(_state(trainer, meta, config, is_loading=False), path,
                                sharded_strategy=("torch_dist", 1))
    dist.barrier()  # every shard and metadata.json is on disk before the tracker names it
    if meta.rank == 0:
        _write_tracker(root, it)
        logger.info("saved checkpoint of iteration %d to %s", it, path)
    dist.barrier()
    return path


def _check_saved_parts(path: str, saved: dict, opts: LoadOptions) -> None:
    """A checkpoint saved without its optimizer / RNG state loads only when told not to
    load them (Megatron-LM exits with the same advice)."""
    if opts.finetune:
        return
    if opts.load_optim and saved.get("optimizer") is False:
        raise CheckpointError(f"--load {path} was saved with --no-save-optim (no optimizer "
                              "state): resume with --no-load-optim (a fresh optimizer) or "
                              "--finetune")
    if opts.load_rng and saved.get("rng") is False:
        raise CheckpointError(f"--load {path} was saved with --no-save-rng (no RNG state): "
                              "resume with --no-load-rng or --finetune")


# A padding rule, not the model: the checkpoint's padded vocabulary wins (vocab.py).
_NOT_THE_MODEL = ("make_vocab_size_divisible_by",)


def _check_compatible(path: str, config: Optional[dict],
                      opts: LoadOptions = LoadOptions()) -> Optional[dict]:
    """Saved layout; raises :class:`CheckpointError` when the model flags differ."""
    from megatron.core.dist_checkpointing import load_common_state_dict

    saved = load_common_state_dict(path).get("skrull", {})
    _check_saved_parts(path, saved.get("saved") or {}, opts)
    want, have = (config or {}).get("model"), saved.get("model")
    if have is not None:  # flags added since it was saved (e.g. RoPE scaling) at their default
        have = {**_model_defaults(), **have}
    diff = sorted(k for k in (have or {}) if k not in _NOT_THE_MODEL
                  and want is not None and have.get(k) != want.get(k))
    if diff:
        raise CheckpointError(
            f"--load {path} is a checkpoint of another model (differs in "
            + ", ".join(f"{k}: saved {have[k]!r}, now {want.get(k)!r}" for k in diff)
            + "); resume with the flags it was saved with or point --load elsewhere")
    return saved.get("layout")


def _check_data_position(path: str, trainer) -> None:
    """The sampler's resume rules (same data, global batch size or batch-size schedule, seed)
    as one :class:`CheckpointError` before anything is loaded (not an unreadable checkpoint:
    every older one would fail alike)."""
    import copy

    from megatron.core.dist_checkpointing import load_common_state_dict

    saved = load_common_state_dict(path).get("data")
    sampler = getattr(trainer.sampler, "sampler", trainer.sampler)  # PlannedBatches wraps it
    if saved is None or not hasattr(sampler, "load_state_dict"):
        return
    try:
        copy.deepcopy(sampler).load_state_dict(saved)
    except ValueError as exc:
        raise CheckpointError(f"--load {path}: {exc}") from None


def _model_defaults() -> dict[str, Any]:
    from megatron.skrull.arguments import ModelArgs

    return {f.name: f.default for f in dataclasses.fields(ModelArgs)
            if f.default is not dataclasses.MISSING}


# OptimizerParamScheduler.state_dict() keys, with the flags that set them here.
_SCHEDULE_FLAGS = {
    "max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-iters",
    "lr_decay_steps": "--lr-decay-iters, default --train-iters",
    "lr_decay_style": "--lr-decay-style", "start_wd": "--weight-decay",
    "end_wd": "--weight-decay", "wd_incr_steps": "--train-iters",
    "wd_incr_style": "weight decay increment style",
}


def _check_schedule(path: str, scheduler) -> None:
    """Megatron's rule: without ``--override-opt_param-scheduler`` or ``--use-checkpoint-
    opt_param-scheduler`` the flags' LR schedule must be the checkpoint's (mcore's
    ``OptimizerParamScheduler.load_state_dict`` asserts it; this says which flags differ
    before anything is loaded or written)."""
    from megatron.core.dist_checkpointing import load_common_state_dict

    chosen = any(getattr(scheduler, f"{who}_opt_param_scheduler", False)
                 for who in ("override", "use_checkpoint"))
    if chosen or not hasattr(scheduler, "state_dict"):
        return
    saved, now = load_common_state_dict(path).get("opt_param_scheduler"), scheduler.state_dict()
    diff = [f"{key} ({flag}): saved {saved[key]!r}, now {now[key]!r}"
            for key, flag in _SCHEDULE_FLAGS.items()
            if saved is not None and key in saved and saved[key] != now.get(key)]
    if diff:
        raise CheckpointError(
            f"--load {path}: the LR schedule of the flags differs from the checkpoint's ("
            + "; ".join(diff) + "); add --override-opt_param-scheduler to train on with the "
            "flags' schedule or --use-checkpoint-opt_param-scheduler to keep the checkpoint's")


def _after_schedule_load(trainer) -> None:
    """With ``--override-opt_param-scheduler`` the loaded optimizer's parameter groups keep
    the checkpoint's ``max_lr``/``min_lr``, which mcore's schedule reads first: put the
    flags' back (as Megatron-LM's ``load_checkpoint`` does).  Then recompute this step's LR
    and weight decay from the final schedule (mcore's ``load_state_dict`` steps before it
    has set the weight-decay values)."""
    scheduler = _scheduler(trainer)
    if getattr(scheduler, "override_opt_param_scheduler", False):
        for group in trainer.optimizer.param_groups:
            if "max_lr" in group:
                group["max_lr"], group["min_lr"] = scheduler.max_lr, scheduler.min_lr
    scheduler.step(increment=0)


def _single(optimizer):
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    if len(chained) != 1:
        raise CheckpointError("switching --use-distributed-optimizer on resume needs a single "
                              "optimizer; resume with the setting the checkpoint was saved with")
    return chained[0]


def _other_optimizer_kind(path: str, optimizer, request: dict) -> Optional[dict]:
    """The checkpoint's optimizer common part if it was saved by the other optimizer kind
    (distributed vs plain); the request is then aliased to the checkpoint's tensor keys."""
    if "optimizer" not in request or not hasattr(optimizer, "sharded_state_dict"):
        return None
    common = optimizer_state.saved_common(path)
    if not common or (optimizer_state.saved_is_distributed(common)
                      == optimizer_state.is_distributed(optimizer)):
        return None
    from megatron.core.dist_checkpointing import load_tensors_metadata

    optimizer_state.alias_missing_keys(request["optimizer"], load_tensors_metadata(path))
    return common


def _load_one(path: str, trainer, meta: CheckpointMeta, config: Optional[dict],
              opts: LoadOptions) -> int:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    with cpu_checkpoint_io(meta.device), cuda_to_cpu(meta.device):
        layout = _check_compatible(path, config, opts)
        if not opts.finetune:
            _check_data_position(path, trainer)
        if opts.load_optim and not opts.finetune:  # the schedule is loaded with the optimizer
            _check_schedule(path, _scheduler(trainer))
        request = _state(trainer, meta, config, is_loading=True, opts=opts, saved_layout=layout)
        other_kind = _other_optimizer_kind(path, trainer.optimizer, request)
        try:
            with errors.quiet_checkpoint_deprecations():
                loaded = dist_checkpointing.load(request, path)
        except CheckpointingException as exc:
            if "shape" in str(exc).lower():
                raise CheckpointError(f"--load {path} holds a model of other shapes ({exc}); "
                                      "use the model flags it was saved with") from None
            raise
    _unwrap(trainer.model).load_state_dict(loaded["model"])
    if "optimizer" not in loaded:  # fp32 main params must follow the loaded weights (Megatron)
        with cuda_to_cpu(meta.device):
            trainer.optimizer.reload_model_params()
    if opts.finetune:
        return 0
    if "optimizer" in loaded:
        state = loaded["optimizer"]
        if other_kind is not None:  # saved with the distributed optimizer on, now off (or back)
            state = optimizer_state.convert(_single(trainer.optimizer), state, other_kind)
        with cuda_to_cpu(meta.device):
            _optimizer_load(trainer.optimizer, state)
    try:
        trainer.sampler.load_state_dict(loaded["data"])
    except ValueError as exc:
        # The data order would change (--global-batch-size, --seed, --skrull-lookahead):
        # bad input, one error line, never a fallback to an older checkpoint.
        raise CheckpointError(f"--load {path}: {exc}") from None
    trainer.iteration = int(loaded["iteration"])  # (moves a stateful LR schedule along)
    if "opt_param_scheduler" in loaded:  # then the saved schedule state wins
        scheduler = _scheduler(trainer)
        scheduler.num_steps = 0  # mcore's load_state_dict steps by the saved num_steps
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
        _after_schedule_load(trainer)
    if "rng_state" in loaded:
        _set_rng_state(loaded["rng_state"])
    elif opts.load_rng:
        logger.warning("RNG state not restored: saved at %s, running at %s", layout,
                       meta.layout)
    return trainer.iteration


def _dcp_exception() -> type:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def load_checkpoint(root: str, trainer, meta: CheckpointMeta,
                    config: Optional[dict[str, Any]] = None, *, finetune: bool = False,
                    load_optim: bool = True, load_rng: bool = True,
                    allow_missing: bool = False) -> Optional[int]:
    """Restores ``trainer`` from ``root``'s latest intact checkpoint; collective.

    Megatron's fine-tuning flags: ``finetune`` loads the model weights only and keeps the
    trainer at iteration 0 (fresh optimizer, sampler and RNG); ``load_optim=False`` /
    ``load_rng=False`` skip the optimizer / RNG state.

    ``allow_missing``: a missing ``root`` means "no checkpoint yet" (``--load`` equal to
    ``--save``, or ``--pretrained-hf`` gives the start) instead of an error.

    Returns:
        The resumed iteration (0 with ``finetune``), or ``None`` (trainer untouched) when
        ``root`` holds no checkpoint yet (``--save X --load X`` restart loops).

    Raises:
        CheckpointError: ``root`` does not exist, the checkpoint is of another model, or
            no checkpoint in ``root`` can be read.
    """
    if not os.path.isdir(root) and not allow_missing:
        raise CheckpointError(f"--load {root}: no such directory; fix the path (or drop "
                              "--load to start from scratch)")
    candidates = candidate_iterations(root) if os.path.isdir(root) else []
    if not candidates:
        logger.warning("no checkpoint in %s (no %s): starting from scratch", root, TRACKER)
        return None
    for n, it in enumerate(candidates):
        path = iteration_dir(root, it)
        try:
            resumed = _load_one(path, trainer, meta, config, LoadOptions(
                finetune=finetune, load_optim=load_optim, load_rng=load_rng))
        except CheckpointError:
            raise
        # torch.distributed.checkpoint raises CheckpointException, a BaseException, on every
        # rank at once when any rank's read fails, so all ranks fall back together.
        except (Exception, _dcp_exception()) as exc:  # unreadable: try the previous one
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            nxt = (f"resuming from the previous intact checkpoint {iteration_dir(root, it2)}"
                   if (it2 := next(iter(candidates[n + 1:]), None)) is not None
                   else "no older checkpoint to fall back to")
            if meta.rank == 0:
                logger.error("checkpoint %s is unreadable (%s); %s", path, reason, nxt)
            continue
        if meta.rank == 0:
            logger.info("loaded checkpoint %s (iteration %d)%s", path, it,
                    " -- --finetune: model weights only, starting at 0" if finetune else "")
        return resumed
    raise CheckpointError(f"--load {root}: no readable checkpoint (tried iterations "
                          f"{', '.join(map(str, candidates))}); see the log above")
