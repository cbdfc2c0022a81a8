"""Optimizer state across checkpoints: the distributed optimizer on one side, off on the other.

mcore's checkpoint formats for the two optimizers hold the same tensors under the same
sharded keys (``optimizer.state.{exp_avg,exp_avg_sq}.<model key>``, each of the model
parameter's shape and sharding), but differ in three places, so mcore alone cannot resume
a distributed-optimizer checkpoint with the plain optimizer or the other way round:

* the main parameters: ``optimizer.state.param.<key>`` (distributed, fully reshardable),
  ``optimizer.state.fp32_param.<key>`` (plain, 16-bit model) or nothing at all (plain, the
  fp32 / fp64 model's own weights are the main parameters);
* the common part: the distributed optimizer keeps its parameter groups (with ``step``
  when torch's AdamW runs) under ``optimizer.param_groups``; the plain one keeps torch's
  ``state`` / ``param_groups`` (with ``state.common_step``), nested under ``optimizer``
  for a 16-bit model;
* the parameter indices in the groups, which only the running optimizer knows.

:func:`alias_missing_keys` points the running optimizer's request at the keys the
checkpoint has; :func:`convert` rebuilds the loaded state in the running optimizer's
structure from the tensors that arrived and the checkpoint's common part.  Megatron-LM
(0.16) does not convert between the two either; users expect a layout change to include
switching ``--use-distributed-optimizer``.
"""
from __future__ import annotations

from typing import Any, Optional

_PREFIX = "optimizer.state."
_IDENTIFIERS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")


def is_distributed(optimizer) -> bool:
    """Whether ``optimizer`` (an mcore optimizer, chained or not) is the distributed one."""
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return any(hasattr(o, "load_parameter_state_from_fully_reshardable") for o in chained)


def saved_common(path: str) -> dict:
    """The optimizer's non-tensor part of checkpoint ``path`` (``{}`` when none saved)."""
    from megatron.core.dist_checkpointing import load_common_state_dict

    return load_common_state_dict(path).get("optimizer") or {}


def saved_is_distributed(common: dict) -> bool:
    return "param_state_sharding_type" in common


def alias_missing_keys(request: dict, saved: dict) -> None:
    """Points optimizer-state requests at the checkpoint's name for the same tensor.

    A main-parameter request absent from the checkpoint is read from the other optimizer's
    name for it, in the dtype it was saved in (the optimizer casts), or dropped when the
    checkpoint's main params are the model weights themselves.

    Args:
        request: The running optimizer's sharded state dict (changed in place).
        saved: ``dist_checkpointing.load_tensors_metadata`` of the checkpoint.
    """
    saved_keys = set(saved)
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

    def alias(obj):
        key = getattr(obj, "key", None)
        if not isinstance(obj, ShardedBase) or not key.startswith(_PREFIX) or key in saved_keys:
            return obj
        name, _, model_key = key[len(_PREFIX):].partition(".")
        if name not in ("param", "fp32_param"):
            return obj  # a moment the checkpoint lacks: let mcore name it in its error
        if not any(k in saved_keys for k in (f"{_PREFIX}param.{model_key}",
                                               f"{_PREFIX}fp32_param.{model_key}")):
            # The saved main params are the model weights (plain fp32 / fp64 run): the
            # model loads them under their key (mcore reads a key once per rank), and
            # :func:`convert` takes them from the loaded model parameters.
            return LocalNonpersistentObject(None)
        for candidate in (f"{_PREFIX}param.{model_key}", f"{_PREFIX}fp32_param.{model_key}"):
            if candidate in saved_keys:
                obj.key = candidate
                dtype = saved[candidate].dtype
                if obj.data is not None and obj.data.dtype != dtype:
                    obj.data = obj.data.to(dtype)
                if hasattr(obj, "dtype") and "dtype" in getattr(obj, "__dataclass_fields__", {}):
                    obj.dtype = dtype
                break
        return obj

    dict_list_map_inplace(alias, request)


def _saved_groups(common: dict) -> tuple[list[dict], Optional[float], Optional[dict]]:
    """``(parameter groups without params, common step, grad scaler)`` of either kind."""
    if saved_is_distributed(common):
        groups = common["optimizer"]["param_groups"]
        steps = {g["step"] for g in groups if "step" in g}
        return groups, (steps.pop() if steps else None), common.get("grad_scaler")
    inner = common["optimizer"] if "optimizer" in common else common  # 16-bit: nested
    step = (inner.get("state") or {}).get("common_step")
    return inner["param_groups"], step, common.get("grad_scaler")


def _identify(group: dict) -> tuple:
    return tuple(group.get(k, group.get(f"pre_{k}")) for k in _IDENTIFIERS)


def _groups_for(inner_groups: list[dict], saved: list[dict], step: Optional[float],
                with_step: bool) -> list[dict]:
    """The saved hyper-parameters for each running group, with the running params."""
    by_id = {_identify(g): g for g in saved}
    out = []
    for group in inner_groups:
        found = by_id.get(_identify(group))
        if found is None:
            raise KeyError(f"no saved parameter group like {_identify(group)}")
        merged = {k: v for k, v in found.items() if k not in ("params", "step")}
        merged["params"] = group["params"]
        if with_step and step is not None:
            merged["step"] = step
        out.append(merged)
    return out


def _tensor_states(loaded: Any) -> dict:
    """``{param index: {name: tensor}}`` entries of a loaded ``state`` dict."""
    return {k: v for k, v in (loaded or {}).items() if isinstance(k, int) and isinstance(v, dict)}


def convert(optimizer, loaded: dict, common: dict) -> dict:
    """``loaded`` (read with the running optimizer's aliased request) in its own structure.

    Args:
        optimizer: The running mcore optimizer (one, not chained over several).
        loaded: What ``dist_checkpointing.load`` returned for the optimizer request.
        common: :func:`saved_common` of the checkpoint (the other optimizer's kind).
    """
    groups, step, scaler = _saved_groups(common)
    inner_groups = optimizer.optimizer.state_dict()["param_groups"]
    if is_distributed(optimizer):
        param_state = loaded["param_state"]
        model_params = [p for buf in optimizer.buffers for p in buf.param_index_map]
        for idx, entry in param_state.items():  # (the same order mcore loads them in)
            if entry.get("param") is None:
                entry["param"] = model_params[idx].detach()
        out = {"optimizer": {"param_groups": _groups_for(inner_groups, groups, step, True)},
               "param_state": param_state,
               "param_state_sharding_type": "fully_reshardable"}
    else:
        state = _tensor_states(loaded["optimizer"]["state"] if "fp32_from_fp16_params" in loaded
                               else loaded["state"])
        if step is not None:
            state["common_step"] = step
        torch_sd = {"state": state,
                    "param_groups": _groups_for(inner_groups, groups, step, False)}
        out = torch_sd
        if "fp32_from_fp16_params" in loaded:  # 16-bit model: main params beside
            out = {"optimizer": torch_sd, "fp32_from_fp16_params": loaded["fp32_from_fp16_params"]}
    if scaler is not None:
        out["grad_scaler"] = scaler
    return out
