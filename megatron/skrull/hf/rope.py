"""Hugging Face RoPE configs <-> the launcher's RoPE flags (no torch, no megatron.core).

A config carries its RoPE in transformers 4.x's ``rope_theta`` + ``rope_scaling`` or in 5.x's
``rope_parameters`` (theta inside); both versions read ``rope_scaling`` first, and so does
:func:`hf_rope_block`.  Values missing from the block take transformers 5's defaults (YaRN's
``beta_fast`` 32 / ``beta_slow`` 1 / ``truncate`` true, ``original_max_position_embeddings``
from ``max_position_embeddings``), so the flags describe the model transformers builds.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from megatron.skrull.rope import ROPE_TYPES, RopeArgs, attention_factor

ROPE_DESTS = tuple(f.name for f in dataclasses.fields(RopeArgs))
# Flags that may add a scaling to a model whose config has none (context extension).
SCALING_DESTS = tuple(d for d in ROPE_DESTS if d != "rotary_percent")
_ORIGINALS = ("yarn_original_max_position_embeddings",
              "rope_scaling_original_max_position_embeddings")


def hf_rope_block(cfg: dict[str, Any]) -> dict[str, Any]:
    """The RoPE dict transformers uses: ``rope_scaling`` if set, else ``rope_parameters``."""
    return dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})


def hf_rope_theta(cfg: dict[str, Any]) -> float:
    """RoPE base: the block's ``rope_theta``, else the top-level one, else 10000."""
    return float(hf_rope_block(cfg).get("rope_theta", cfg.get("rope_theta", 10000.0)))


def rope_flags_from_hf(cfg: dict[str, Any], where: str, problems: list[str]) -> dict[str, Any]:
    """``RopeArgs`` field values of a config; unsupported RoPE appends to ``problems``."""
    values = dataclasses.asdict(RopeArgs())
    block = hf_rope_block(cfg)
    kind = block.get("rope_type", block.get("type", "default"))
    if any(isinstance(v, dict) for v in block.values()):
        problems.append(f"{where}: RoPE parameters per layer type are not supported (one RoPE "
                        "for every layer only)")
        return values
    if kind not in ROPE_TYPES:
        problems.append(f"{where}: rope_type {kind!r} is not supported; supported: "
                        f"{', '.join(ROPE_TYPES)}")
        return values
    partial = block.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        problems.append(f"{where}: partial_rotary_factor {partial} is not supported "
                        "(transformers' Llama/Qwen rotate whole heads)")
    missing = [k for k in {"linear": ("factor",), "llama3": (
        "factor", "low_freq_factor", "high_freq_factor")}.get(kind, ()) if block.get(k) is None]
    if missing:
        problems.append(f"{where}: rope_type {kind!r} needs {', '.join(missing)}; fix the "
                        "config")
        return values
    # transformers 5: a top-level original_max_position_embeddings wins (Phi-3 style).
    original = int(cfg.get("original_max_position_embeddings")
                   or block.get("original_max_position_embeddings")
                   or cfg.get("max_position_embeddings", 4096))
    if kind == "linear":
        values["rotary_seq_len_interpolation_factor"] = float(block["factor"])
    elif kind == "llama3":
        values.update(use_rope_scaling=True, rope_scaling_factor=float(block["factor"]),
                      rope_scaling_low_freq_factor=float(block["low_freq_factor"]),
                      rope_scaling_high_freq_factor=float(block["high_freq_factor"]),
                      rope_scaling_original_max_position_embeddings=original)
    elif kind == "yarn":
        values.update(_yarn_values(cfg, block, original))
    return values


def _yarn_values(cfg: dict[str, Any], block: dict[str, Any], original: int) -> dict[str, Any]:
    factor = block.get("factor")
    if factor is None:  # transformers: the context ratio
        factor = cfg.get("max_position_embeddings", original) / original
    mscale, mscale_all_dim = block.get("mscale"), block.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):  # transformers then uses 0.1 ln(factor) + 1
        mscale, mscale_all_dim = 1.0, 0.0
    explicit = block.get("attention_factor")
    return {"position_embedding_type": "yarn", "rotary_scaling_factor": float(factor),
            "yarn_original_max_position_embeddings": original,
            "yarn_beta_fast": float(block.get("beta_fast") or 32),
            "yarn_beta_slow": float(block.get("beta_slow") or 1),
            "yarn_correction_range_round_to_int": bool(block.get("truncate", True)),
            "mscale": float(mscale), "mscale_all_dim": float(mscale_all_dim),
            "yarn_attention_factor": None if explicit is None else float(explicit)}


def extend_rope(values: dict[str, Any], ns: Any, explicit: set[str]) -> dict[str, Any]:
    """Config values with the command line's RoPE scaling when the config has none.

    Scaling RoPE beyond a model's pretrained context (e.g. YaRN on a 32K model trained at
    128K) keeps every weight, so the flags may add it; the pretrained context (the
    config's ``max_position_embeddings``) becomes the scaling's original length unless
    ``--yarn-original-max-position-embeddings`` says otherwise.  A config that already scales
    RoPE is left alone: a flag contradicting it stays an error.
    """
    chosen = [d for d in SCALING_DESTS if d in explicit]
    if RopeArgs(**{d: values[d] for d in ROPE_DESTS}).rope_type != "default" or not chosen:
        return values
    out = dict(values)
    out.update({d: values["max_position_embeddings"] for d in _ORIGINALS})
    out.update({d: getattr(ns, d) for d in chosen})
    scaled = RopeArgs(**{d: out[d] for d in ROPE_DESTS}).rope_type != "default"
    return out if scaled else values  # e.g. a bare --position-embedding-type rope


def hf_rope_parameters(model: dict[str, Any]) -> dict[str, Any]:
    """transformers 5's ``rope_parameters`` (theta included) of a run's model flags.

    Raises:
        ValueError: ``--rotary-percent`` below 1 (no Llama/Qwen architecture has it).
    """
    rope = RopeArgs(**{d: model[d] for d in ROPE_DESTS if d in model})
    if rope.rotary_percent != 1.0:
        raise ValueError(f"--rotary-percent {rope.rotary_percent} has no Hugging Face "
                         "Llama/Qwen equivalent (they rotate whole heads); cannot export")
    kind = rope.rope_type
    params: dict[str, Any] = {"rope_type": kind, "rope_theta": float(model["rotary_base"])}
    if kind == "linear":
        params["factor"] = rope.rotary_seq_len_interpolation_factor
    elif kind == "llama3":
        params.update(factor=rope.rope_scaling_factor,
                      low_freq_factor=rope.rope_scaling_low_freq_factor,
                      high_freq_factor=rope.rope_scaling_high_freq_factor,
                      original_max_position_embeddings=(
                          rope.rope_scaling_original_max_position_embeddings))
    elif kind == "yarn":
        params.update(factor=rope.rotary_scaling_factor,
                      original_max_position_embeddings=rope.yarn_original_max_position_embeddings,
                      beta_fast=rope.yarn_beta_fast, beta_slow=rope.yarn_beta_slow,
                      truncate=rope.yarn_correction_range_round_to_int)
        if rope.mscale and rope.mscale_all_dim and rope.yarn_attention_factor is None:
            params.update(mscale=rope.mscale, mscale_all_dim=rope.mscale_all_dim)
        elif rope.yarn_attention_factor is not None or (rope.mscale, rope.mscale_all_dim) != (
                1.0, 0.0):  # a value transformers' mscale fields cannot express
            params["attention_factor"] = attention_factor(rope)
    return params


def with_run_rope(hf_config: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
    """``hf_config`` carrying the run's RoPE (for the exporter).

    Unchanged when the config already describes it; otherwise (a context extension, or a
    config written from the flags) the RoPE block is written in the config's own format:
    ``rope_parameters`` for a transformers 5 config, else ``rope_theta`` + ``rope_scaling``,
    which transformers 4.x and 5.x both read.
    """
    problems: list[str] = []
    have = rope_flags_from_hf(hf_config, "config.json", problems)
    params = hf_rope_parameters(model)
    if not problems and hf_rope_parameters(
            {**have, "rotary_base": hf_rope_theta(hf_config)}) == params:
        return hf_config
    out = {k: v for k, v in hf_config.items() if k != "original_max_position_embeddings"}
    if "rope_parameters" in hf_config and not hf_config.get("rope_scaling"):
        out["rope_parameters"] = params
        out.pop("rope_scaling", None)
        return out
    out.pop("rope_parameters", None)
    out["rope_theta"] = params.pop("rope_theta")
    out["rope_scaling"] = params if params["rope_type"] != "default" else None
    return out

