"""Training checkpoint -> Hugging Face model directory (``tools/export_hf.py``).

``--load CKPT [--iteration N] --output DIR`` writes ``config.json``, ``model.safetensors``
(sharded with an index above 5 GB), ``generation_config.json`` and the tokenizer files (chat
template included).  ``config.json``, generation config and tokenizer come from the
``--pretrained-hf`` directory recorded in the checkpoint when it is still there, else from the
model flags and ``--tokenizer-model``; the config carries the run's RoPE scaling either way.  Weights are written in the source model's dtype, so an
import followed by an export without training gives the source tensors bit for bit.

The checkpoint is read by :func:`read_checkpoint` alone (the one place that knows the format):
``megatron.core.dist_checkpointing`` loads it into a TP = 1 model in this one process, which
gives full tensors whatever TP/CP/DP layout wrote it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
from typing import Any, Optional

import torch

from megatron.skrull import errors
from megatron.skrull.hf.config import hf_config_from_model, read_hf_config
from megatron.skrull.hf.io import (MAX_SHARD_BYTES, SIDE_FILES, save_safetensors,
                                   staged_directory)
from megatron.skrull.hf.rope import with_run_rope
from megatron.skrull.hf.weights import AttentionShape, mcore_to_hf, rule_for

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_checkpoint(root: str, iteration: Optional[int] = None
                    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], int]:
    """Full (TP = 1) model tensors and the run description of a checkpoint.

    The checkpoint is a ``megatron.core.dist_checkpointing`` (torch_dist) one: the model is
    rebuilt at TP = 1 in this one process and loaded with its ``sharded_state_dict``, which
    reshards whatever TP/CP/DP layout wrote it.

    Args:
        root: ``--save`` directory of a run.
        iteration: Which iteration (default: the latest).

    Returns:
        ``(state, run_config, iteration)``; ``state`` maps mcore names to full tensors.

    Raises:
        FileNotFoundError: No complete checkpoint there.
    """
    from megatron.core import dist_checkpointing
    from megatron.skrull import checkpointing as ckpt
    from megatron.skrull.arguments import ModelArgs
    from megatron.skrull.cpu_compat import cpu_checkpoint_io

    it = ckpt.read_tracker(root) if iteration is None else iteration
    path = ckpt.iteration_dir(root, it) if it is not None else ""
    if it is None or not ckpt.is_complete(path):
        raise FileNotFoundError(f"--load {root}: no complete checkpoint"
                                + (f" of iteration {iteration}" if iteration is not None else "")
                                + "; pass the --save directory of a training run")
    with _single_process(), cpu_checkpoint_io("cpu"):
        model_cfg = dist_checkpointing.load_common_state_dict(path).get("skrull", {}).get("model")
        if not model_cfg:
            raise ValueError(f"{path} does not record its model flags; not a Skrull checkpoint")
        embedding = dist_checkpointing.load_tensors_metadata(path)[
            "embedding.word_embeddings.weight"]
        model = _tp1_model(ModelArgs(**model_cfg), embedding.global_shape[0], embedding.dtype)
        with errors.quiet_checkpoint_deprecations():
            loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
        model.load_state_dict(loaded["model"])
    state = {k: v.detach() for k, v in model.state_dict().items()
             if isinstance(v, torch.Tensor) and rule_for(k) is not None}
    return state, {"model": model_cfg}, it


@contextlib.contextmanager
def _single_process():
    """A world of one (gloo, file store) with TP = CP = 1, torn down afterwards."""
    import tempfile

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.skrull.cpu_compat import apply_cpu_compat

    apply_cpu_compat("cpu")
    owned = not dist.is_initialized()
    if owned:
        store = tempfile.mkdtemp(prefix="skrull-export-")
        dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0,
                                world_size=1)
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, create_gloo_process_groups=True)
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        if owned:
            dist.destroy_process_group()


def _tp1_model(args, vocab_size: int, dtype: torch.dtype) -> torch.nn.Module:
    from megatron.core import tensor_parallel
    from megatron.skrull.model import build_model

    tensor_parallel.model_parallel_cuda_manual_seed(0)  # init values are overwritten
    return build_model(args, vocab_size=vocab_size, dtype=dtype)


RUN_RECORD = "hf_export.json"


def record_run(save_dir: str, run: dict[str, Any]) -> None:
    """Writes ``<save>/hf_export.json``: the run's model flags, ``--pretrained-hf`` directory
    and tokenizer, read by :func:`export` whatever the checkpoint format stores."""
    os.makedirs(save_dir, exist_ok=True)
    keep = {"model": run.get("model", {}),
            "checkpoint": {"pretrained_hf": _abs(run.get("checkpoint", {}).get("pretrained_hf"))},
            "data": {"tokenizer_model": _abs(run.get("data", {}).get("tokenizer_model"))}}
    tmp = os.path.join(save_dir, RUN_RECORD + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(keep, fh, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(save_dir, RUN_RECORD))


def _abs(path: Optional[str]) -> Optional[str]:
    return os.path.abspath(path) if path else None


def _run_description(root: str, stored: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's own run description, completed by ``hf_export.json`` if present."""
    path = os.path.join(root, RUN_RECORD)
    if not os.path.isfile(path):
        return stored
    with open(path) as fh:
        recorded = json.load(fh)
    return {**recorded, **{k: v for k, v in stored.items() if v}}


def _source_dir(run: dict[str, Any]) -> Optional[str]:
    src = run.get("checkpoint", {}).get("pretrained_hf")
    return src if src and os.path.isfile(os.path.join(src, "config.json")) else None


def _target_dtype(hf_config: dict[str, Any], override: Optional[str],
                  source: Optional[str]) -> torch.dtype:
    """--dtype, else the source weights' stored dtype, else config.json's, else float32."""
    if override is None and source is not None:
        from megatron.skrull.hf.io import SafetensorsDir

        try:
            return SafetensorsDir(source).dtype()
        except FileNotFoundError:
            pass
    name = override or hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} not supported; use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _copy_tokenizer(out: str, source: Optional[str], tokenizer_model: Optional[str]) -> None:
    """Tokenizer + generation files: from --tokenizer-model, else the pretrained directory."""
    for src in (source, tokenizer_model):
        if src and os.path.isdir(src):
            for name in SIDE_FILES:
                if os.path.isfile(os.path.join(src, name)):
                    shutil.copyfile(os.path.join(src, name), os.path.join(out, name))
        elif src and os.path.isfile(src):
            shutil.copyfile(src, os.path.join(out, "tokenizer.json"))


def export(root: str, output: str, *, iteration: Optional[int] = None,
           tokenizer_model: Optional[str] = None, dtype: Optional[str] = None,
           max_shard_bytes: int = MAX_SHARD_BYTES) -> dict[str, Any]:
    """Writes the Hugging Face directory ``output``; returns its config.

    The directory is built next to ``output`` and renamed at the end: on error nothing is
    left behind.

    Raises:
        FileNotFoundError: No checkpoint.
        ValueError: Not a Llama/Qwen2-shaped model, or ``output`` exists and is not empty.
    """
    if os.path.isdir(output) and os.listdir(output):
        raise ValueError(f"--output {output} exists and is not empty; pick a new directory")
    state, stored, _ = read_checkpoint(root, iteration)
    run = _run_description(root, stored)
    model = run.get("model", {})
    source = _source_dir(run)
    hf_config = read_hf_config(source) if source else hf_config_from_model(
        model, vocab_size=state["embedding.word_embeddings.weight"].shape[0])
    hf_config = with_run_rope(hf_config, model)  # a RoPE scaling the run added
    heads = int(model["num_attention_heads"])
    shape = AttentionShape(heads=heads, groups=int(model.get("num_query_groups") or heads),
                           head_dim=int(model.get("kv_channels")
                                        or model["hidden_size"] // heads))
    tensors = mcore_to_hf(state, shape)
    vocab = int(hf_config["vocab_size"])
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors:  # padded vocabulary rows never leave the trainer
            tensors[name] = tensors[name][:vocab]
    target = _target_dtype(hf_config, dtype, source)
    tensors = {k: v.to(target).contiguous() for k, v in tensors.items()}
    with staged_directory(output, ".export-") as tmp:
        save_safetensors(tensors, tmp, max_shard_bytes)
        tok = tokenizer_model or run.get("data", {}).get("tokenizer_model")
        _copy_tokenizer(tmp, source, tok)
        with open(os.path.join(tmp, "config.json"), "w") as fh:
            json.dump(hf_config, fh, indent=2, sort_keys=True)
        if not os.path.isfile(os.path.join(tmp, "generation_config.json")):
            _write_generation_config(tmp, hf_config)
    return hf_config


def _write_generation_config(directory: str, hf_config: dict[str, Any]) -> None:
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=hf_config.get("bos_token_id"),
                     eos_token_id=hf_config.get("eos_token_id"),
                     pad_token_id=hf_config.get("pad_token_id")).save_pretrained(directory)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="export_hf.py", description="Export a Skrull-Megatron "
                                "training checkpoint (any TP/CP/DP layout) as a Hugging Face "
                                "model directory.")
    p.add_argument("--load", required=True, help="checkpoint directory (--save of the run)")
    p.add_argument("--iteration", type=int, help="iteration to export (default: latest)")
    p.add_argument("--output", required=True, help="new Hugging Face model directory")
    p.add_argument("--tokenizer-model", help="tokenizer directory or tokenizer.json to ship "
                   "(default: the run's --tokenizer-model / --pretrained-hf files)")
    p.add_argument("--dtype", choices=tuple(_DTYPES), help="weight dtype (default: the "
                   "pretrained model's, else float32)")
    p.add_argument("--max-shard-size-gb", type=float, default=5.0)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    """CLI entry point; one ``error:`` line and status 2 on bad input."""
    errors.filter_dependency_warnings()
    args = build_parser().parse_args(argv)
    try:
        cfg = export(args.load, args.output, iteration=args.iteration,
                     tokenizer_model=args.tokenizer_model, dtype=args.dtype,
                     max_shard_bytes=int(args.max_shard_size_gb * 1024 ** 3))
    except (ValueError, OSError) as exc:
        print(f"export_hf.py: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {cfg.get('architectures')} {cfg.get('num_hidden_layers')} "
          f"layers, vocab {cfg.get('vocab_size')}")
    return 0
