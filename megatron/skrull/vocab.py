"""The padded vocabulary belongs to the model: computed once, then carried by its checkpoints.

Megatron pads the vocabulary to a multiple of ``--make-vocab-size-divisible-by x TP``, so
the same flags give another padded size at another TP (a byte-level vocabulary of 262 ids:
384 rows at TP 1, 512 at TP 2).  The padded rows are part of the model: the output layer's
padded logits enter the softmax, and a checkpoint's trained rows differ from freshly
initialised ones.  mcore loads an embedding of another padded size without complaint (its
vocabulary tensors allow a shape mismatch), so a resume at another TP silently continued a
different model.

Here a run that resumes (``--load`` holding a checkpoint, also with ``--finetune``) builds
its model with the checkpoint's padded size, read from the checkpoint's tensor metadata,
whenever the new TP size divides it; otherwise it stops with one error naming
``--make-vocab-size-divisible-by``.  A Hugging Face import (``--pretrained-hf``) is padded
once, by the model's authors: its ``vocab_size`` exactly, at every TP size
(:mod:`megatron.skrull.hf.config`).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

logger = logging.getLogger(__name__)

EMBEDDING_KEY = "embedding.word_embeddings.weight"


def saved_rows(root: Optional[str]) -> Optional[int]:
    """Rows of the word embedding in the newest readable checkpoint under ``root``.

    Reads only the tracker and the checkpoints' metadata (no tensors, no collectives).

    Returns:
        The padded vocabulary size, or ``None`` when ``root`` holds no readable checkpoint
        (:func:`megatron.skrull.checkpointing.load_checkpoint` then reports or starts fresh).
    """
    from megatron.skrull.checkpointing import (CheckpointError, candidate_iterations,
                                               iteration_dir)

    if not root or not os.path.isdir(root):
        return None
    try:
        iterations = candidate_iterations(root)
    except CheckpointError:
        return None
    from megatron.core.dist_checkpointing import load_tensors_metadata

    for it in iterations:
        try:
            tensor = load_tensors_metadata(iteration_dir(root, it)).get(EMBEDDING_KEY)
        except Exception:  # noqa: BLE001 - unreadable: the loader falls back past it too
            continue
        if tensor is not None:
            return int(tensor.global_shape[0])
    return None


def padded_vocab_size(cfg: Any, data_vocab: int) -> int:
    """The model's vocabulary rows: the checkpoint's on resume, else ``--padded-vocab-size``,
    else Megatron's padding.

    Args:
        cfg: The :class:`megatron.skrull.arguments.RunConfig`.
        data_vocab: The data's (tokenizer's) vocabulary; ``--vocab-size`` wins when set.

    Raises:
        ValueError: The checkpoint's rows are fewer than the vocabulary, or the TP size
            does not divide them, or ``--padded-vocab-size`` disagrees with them or is
            smaller than the vocabulary (the message names the fix).
    """
    tp = cfg.parallel.tensor_model_parallel_size
    vocab = cfg.model.vocab_size or data_vocab
    padded = cfg.model.padded_vocab_size(vocab, tp)
    explicit = cfg.run.padded_vocab_size  # Megatron-LM's --padded-vocab-size
    if explicit is not None:
        if explicit < vocab:
            raise ValueError(f"--padded-vocab-size {explicit} is smaller than the vocabulary "
                             f"{vocab}; raise it or drop the flag")
        padded = explicit
    root = cfg.checkpoint.load
    rows = saved_rows(root)
    if rows is None:
        return padded
    if explicit is not None and rows != explicit:
        raise ValueError(f"--padded-vocab-size {explicit}, but the model in --load {root} has "
                         f"{rows} vocabulary rows; give {rows} or drop the flag")
    if rows < vocab:
        raise ValueError(f"--load {root}: its model has {rows} vocabulary rows, fewer than "
                         f"this run's vocabulary of {vocab}; resume with the tokenizer (or "
                         "--vocab-size) the checkpoint was trained with")
    if rows % tp:
        raise ValueError(f"--load {root}: its model's padded vocabulary of {rows} rows cannot "
                         f"be split over --tensor-model-parallel-size {tp}; resume at a TP "
                         f"size that divides {rows}, or train from the start with a "
                         "--make-vocab-size-divisible-by that is a multiple of every TP size "
                         "you will use")
    if rows != padded:
        logger.info("keeping the checkpoint's padded vocabulary of %d rows (the flags pad to "
                    "%d at TP %d; the padded rows belong to the model)", rows, padded, tp)
    return rows
