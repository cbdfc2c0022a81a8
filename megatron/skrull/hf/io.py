"""Safetensors directories: read one tensor at a time, write (sharded) with an index.

A Hugging Face model directory holds ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (``weight_map``: tensor name -> file).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Any, Iterator, Optional

import torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Hugging Face's default shard size for save_pretrained.
MAX_SHARD_BYTES = 5 * 1024 ** 3
# Files copied along with the weights on export (tokenizer and generation settings).
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
              "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")


@contextlib.contextmanager
def staged_directory(output: str, prefix: str = ".staged-") -> Iterator[str]:
    """Yields a temporary sibling of ``output``, renamed to ``output`` on success.

    On any error the temporary directory is removed: nothing half-written is left behind.

    Raises:
        ValueError: ``output`` exists and is not empty.
    """
    if os.path.isdir(output) and os.listdir(output):
        raise ValueError(f"--output {output} exists and is not empty; pick a new directory")
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        yield tmp
        if os.path.isdir(output):
            os.rmdir(output)
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class SafetensorsDir:
    """Lazy reader of a (possibly sharded) safetensors model directory.

    Raises:
        FileNotFoundError: Neither ``model.safetensors`` nor the index exists.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        index = os.path.join(directory, INDEX)
        if os.path.isfile(index):
            with open(index) as fh:
                self.weight_map: dict[str, str] = dict(json.load(fh)["weight_map"])
        elif os.path.isfile(os.path.join(directory, SINGLE)):
            from safetensors import safe_open

            with safe_open(os.path.join(directory, SINGLE), framework="pt") as f:
                self.weight_map = {k: SINGLE for k in f.keys()}
        else:
            raise FileNotFoundError(f"{directory}: no {SINGLE} or {INDEX}; the model directory "
                                    "needs its safetensors weights (save_pretrained writes them)")
        self._open: dict[str, Any] = {}

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (read now, in its stored dtype)."""
        from safetensors import safe_open

        fname = self.weight_map[name]
        if fname not in self._open:
            path = os.path.join(self.directory, fname)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} (listed in {INDEX}) is missing")
            self._open[fname] = safe_open(path, framework="pt")
        return self._open[fname].get_tensor(name)

    def dtype(self) -> torch.dtype:
        """Stored dtype of the weights (of the first tensor, in name order)."""
        return self.get(sorted(self.weight_map)[0]).dtype


def save_safetensors(tensors: dict[str, torch.Tensor], directory: str,
                     max_shard_bytes: int = MAX_SHARD_BYTES,
                     metadata: Optional[dict[str, str]] = None) -> list[str]:
    """Writes ``model.safetensors``, or shards plus the index above ``max_shard_bytes``.

    Returns:
        The weight files written.
    """
    from safetensors.torch import save_file

    names = sorted(tensors)
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    metadata = {"format": "pt", **(metadata or {})}
    if len(shards) == 1:
        save_file({n: tensors[n].contiguous() for n in names},
                  os.path.join(directory, SINGLE), metadata=metadata)
        return [SINGLE]
    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in shard}, os.path.join(directory, fname),
                  metadata=metadata)
        files.append(fname)
        weight_map.update({n: fname for n in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(directory, INDEX), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
    return files


def load_pretrained(model: torch.nn.Module, directory: str, model_args: Any, *,
                    tp_rank: int = 0, tp_size: int = 1, rename: Any = None) -> int:
    """Initialises ``model`` (this TP rank's shards) from a Hugging Face directory.

    Args:
        model: mcore GPTModel built from ``model_args`` (its config came from the same
            ``config.json``, see :mod:`megatron.skrull.hf.config`).
        directory: ``--pretrained-hf`` directory.
        model_args: :class:`megatron.skrull.arguments.ModelArgs` (head counts).
        rename: Stage-to-whole-model parameter names (pipeline parallelism).

    Returns:
        Number of parameters loaded.

    Raises:
        FileNotFoundError: No weights in ``directory``.
        ValueError: A weight missing or of the wrong shape.
    """
    from megatron.skrull.hf.weights import AttentionShape, load_into_model

    weights = SafetensorsDir(directory)
    shape = AttentionShape(heads=model_args.num_attention_heads, groups=model_args.query_groups,
                           head_dim=model_args.head_dim)
    return load_into_model(model, weights.get, weights.has, shape, tp_rank=tp_rank,
                           tp_size=tp_size, source=directory, rename=rename)
