"""Hugging Face ``config.json`` <-> the launcher's model flags (no torch, no megatron imports).

:func:`flags_from_hf_config` maps a Llama / Qwen2 / Mistral config onto Megatron flag
destinations (``num_layers``, ``num_query_groups``, ``use_rope_scaling``, ...), refusing every
feature the mcore model here does not implement (RoPE scalings other than linear, llama3 and
yarn, sliding windows shorter than the sequence, biases outside q/k/v, other activations): a
silently different model is worse than an error.  RoPE's part is in :mod:`.rope`.
:func:`hf_config_from_model` is the inverse, used by the exporter.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, Optional, Sequence

from megatron.skrull.hf.rope import ROPE_DESTS, extend_rope, hf_rope_theta, rope_flags_from_hf

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
# Flag destinations a pretrained config decides (the rest of the model flags keep defaults).
MODEL_DESTS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
               "num_query_groups", "kv_channels", "max_position_embeddings", "vocab_size",
               "make_vocab_size_divisible_by", "swiglu", "normalization", "norm_epsilon",
               "disable_bias_linear", "add_qkv_bias", "qk_layernorm",
               "untie_embeddings_and_output_weights",
               "rotary_base") + ROPE_DESTS


class HFConfigError(ValueError):
    """Unusable pretrained directory or config; ``problems`` has one line per problem."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def read_hf_config(directory: str) -> dict[str, Any]:
    """``DIR/config.json`` as a dict.

    Raises:
        HFConfigError: No such directory or file, or not JSON.
    """
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise HFConfigError([f"--pretrained-hf {directory}: no config.json there; pass a Hugging "
                             "Face model directory (config.json + *.safetensors)"])
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise HFConfigError([f"{path} is not a JSON file ({exc}); re-download or fix it"]) from exc


def _unsupported(cfg: dict[str, Any], arch: str, seq_length: int, where: str) -> list[str]:
    p = []
    if cfg.get("hidden_act", "silu") != "silu":
        p.append(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported (SwiGLU with silu "
                 "only)")
    if cfg.get("mlp_bias"):
        p.append(f"{where}: mlp_bias is not supported (q/k/v biases only)")
    if arch in ("llama", "mistral", "qwen3") and cfg.get("attention_bias"):
        p.append(f"{where}: attention_bias (bias on o_proj too) is not supported")
    window = cfg.get("sliding_window")
    uses_window = cfg.get("use_sliding_window", arch == "mistral")
    if uses_window and window is not None and window < seq_length:
        p.append(f"{where}: sliding_window {window} < --seq-length {seq_length}: sliding-window "
                 f"attention is not implemented; use --seq-length <= {window}")
    if cfg.get("layer_types") and any(t != "full_attention" for t in cfg["layer_types"]) \
            and uses_window:
        p.append(f"{where}: layer_types other than full_attention are not supported")
    return p


def flags_from_hf_config(cfg: dict[str, Any], *, seq_length: int, tp_size: int = 1,
                         where: str = "config.json") -> dict[str, Any]:
    """Model flag values (argparse destinations) of a Hugging Face causal-LM config.

    Args:
        cfg: Parsed ``config.json``.
        seq_length: The run's ``--seq-length`` (sliding windows at least this long are exact).
        tp_size: Tensor-parallel size; it must divide the vocabulary (no padded rows).
        where: Name used in error messages.

    Returns:
        ``{dest: value}`` for every name in :data:`MODEL_DESTS`.

    Raises:
        HFConfigError: Unsupported architecture or feature, or a vocabulary TP cannot split.
    """
    archs = cfg.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise HFConfigError([f"{where}: architectures {archs} not supported; supported: "
                             f"{', '.join(ARCHITECTURES)}"])
    p = _unsupported(cfg, arch, seq_length, where)
    rope = rope_flags_from_hf(cfg, where, p)
    theta = hf_rope_theta(cfg)
    if theta != int(theta):
        p.append(f"{where}: rope_theta {theta} is not an integer (--rotary-base is)")
    heads = int(cfg["num_attention_heads"])
    vocab = int(cfg["vocab_size"])
    if vocab % tp_size:
        p.append(f"{where}: vocab_size {vocab} is not divisible by --tensor-model-parallel-size "
                 f"{tp_size}; padded rows would enter the softmax, so use a TP size dividing it")
    if p:
        raise HFConfigError(p)
    return {
        "num_layers": int(cfg["num_hidden_layers"]), "hidden_size": int(cfg["hidden_size"]),
        "ffn_hidden_size": int(cfg["intermediate_size"]), "num_attention_heads": heads,
        "num_query_groups": int(cfg.get("num_key_value_heads") or heads),
        "kv_channels": int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        "max_position_embeddings": int(cfg.get("max_position_embeddings", seq_length)),
        "vocab_size": vocab, "make_vocab_size_divisible_by": 1, "swiglu": True,
        "normalization": "RMSNorm", "norm_epsilon": float(cfg.get("rms_norm_eps", 1e-6)),
        "disable_bias_linear": True, "add_qkv_bias": arch == "qwen2",
        "qk_layernorm": arch == "qwen3",
        "untie_embeddings_and_output_weights": not cfg.get("tie_word_embeddings", False),
        "rotary_base": int(theta), **rope,
    }


def _explicit_dests(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> set[str]:
    """Destinations the command line sets explicitly (parse again with suppressed defaults)."""
    saved = [(a, a.default, a.required) for a in parser._actions]
    try:
        for action, _, _ in saved:
            action.default, action.required = argparse.SUPPRESS, False
        return set(vars(parser.parse_args(argv)))
    finally:
        for action, default, required in saved:
            action.default, action.required = default, required


def parse_with_pretrained(parser: argparse.ArgumentParser,
                          argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """Parses ``argv``; with ``--pretrained-hf DIR`` the model flags come from its config.

    Model flags become optional; one given explicitly must equal the config's value, except
    RoPE scaling flags on a config without scaling (a context extension:
    :func:`megatron.skrull.hf.rope.extend_rope`).

    Raises:
        HFConfigError: Config problems and disagreeing flags, one line each.
    """
    for action in parser._actions:
        if action.dest in MODEL_DESTS:
            action.required = False
    ns = parser.parse_args(argv)
    where = os.path.join(ns.pretrained_hf, "config.json")
    values = flags_from_hf_config(read_hf_config(ns.pretrained_hf), seq_length=ns.seq_length,
                                  tp_size=ns.tensor_model_parallel_size, where=where)
    explicit = _explicit_dests(parser, argv)
    values = extend_rope(values, ns, explicit)
    problems = []
    for dest, value in values.items():
        given = getattr(ns, dest, None)  # config-only RoPE fields have no flag
        if dest == "make_vocab_size_divisible_by" and dest in explicit:
            problems.extend(_padding_problem(given, values["vocab_size"], where))
        elif dest in explicit and given != value:
            problems.append(f"--{dest.replace('_', '-')} {given} disagrees with {where} "
                            f"({value}); drop the flag or fix it")
        setattr(ns, dest, value)
    if problems:
        raise HFConfigError(problems)
    return ns


def _padding_problem(divisor: int, vocab: int, where: str) -> list[str]:
    """An explicit ``--make-vocab-size-divisible-by`` with ``--pretrained-hf``.

    The vocabulary was padded once, by the model's authors (``vocab_size``): more rows would
    enter the softmax and the loss would no longer be transformers'.  Megatron's scripts for
    these models pass a divisor of it (``1``, ``128``, ``1187`` for Qwen's 151936), which is
    accepted and changes nothing.
    """
    if divisor >= 1 and vocab % divisor == 0:
        return []
    return [f"--make-vocab-size-divisible-by {divisor} would pad {where}'s vocab_size {vocab} "
            "with rows that enter the softmax (the vocabulary is padded once, as the model "
            f"has it); use a divisor of {vocab} such as 1, or drop the flag"]


def hf_config_from_model(model: dict[str, Any], *, vocab_size: int) -> dict[str, Any]:
    """A Hugging Face ``config.json`` for model flags (a run not started from a HF model).

    Args:
        model: ``dataclasses.asdict(ModelArgs)`` as stored in a checkpoint.
        vocab_size: Vocabulary rows to export (``model['vocab_size']`` wins when set).

    Raises:
        HFConfigError: The model is not Llama/Qwen2-shaped (SwiGLU, RMSNorm, no linear biases).
    """
    if not (model.get("swiglu") and model.get("normalization") == "RMSNorm"
            and model.get("disable_bias_linear")):
        raise HFConfigError(["the model is not Llama/Qwen2-shaped: export needs --swiglu "
                             "--normalization RMSNorm --disable-bias-linear"])
    heads, hidden = int(model["num_attention_heads"]), int(model["hidden_size"])
    ffn = model.get("ffn_hidden_size") or int(4 * hidden * 2 / 3 / 64) * 64
    kind = "qwen3" if model.get("qk_layernorm") else (
        "qwen2" if model.get("add_qkv_bias") else "llama")
    if kind == "qwen3" and model.get("add_qkv_bias"):
        raise HFConfigError(["q/k/v biases with --qk-layernorm have no Hugging Face "
                             "architecture here (Qwen3 has no biases)"])
    return {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM"}[kind]],
        "model_type": kind, "hidden_act": "silu",
        "num_hidden_layers": int(model["num_layers"]), "hidden_size": hidden,
        "intermediate_size": int(ffn), "num_attention_heads": heads,
        "num_key_value_heads": int(model.get("num_query_groups") or heads),
        "head_dim": int(model.get("kv_channels") or hidden // heads),
        "max_position_embeddings": int(model["max_position_embeddings"]),
        "vocab_size": int(model.get("vocab_size") or vocab_size),
        "rms_norm_eps": float(model["norm_epsilon"]), "rope_theta": float(model["rotary_base"]),
        "tie_word_embeddings": not model.get("untie_embeddings_and_output_weights"),
        "torch_dtype": "float32",
    }
