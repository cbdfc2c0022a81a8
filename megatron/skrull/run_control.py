"""Megatron-LM's run-control flags at run time: time limit and EOD loss masking.

* ``--exit-duration-in-mins N`` (:class:`ExitDuration`): after every iteration each rank
  compares its wall clock since the program started (the earliest start over the ranks)
  with ``N`` minutes; one MAX all-reduce makes the decision the same everywhere; the loop
  then saves (``--save``) and stops, as Megatron-LM's ``checkpoint_and_decide_exit``.
* ``--eod-mask-loss`` (:class:`EodMaskedSource`): no loss on positions whose *input* token is
  the tokenizer's EOD (Megatron-LM's ``loss_mask[tokens == eod] = 0``).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.skrull.samples import TokenSample

logger = logging.getLogger("megatron.skrull")

#: When this module was first imported: the launcher imports it at start-up, so this is
#: the program's start (Megatron-LM takes the import time of its training module).
PROGRAM_START = time.time()


class ExitDuration:
    """``exit_fn`` of :func:`megatron.skrull.training.train` for ``--exit-duration-in-mins``.

    Args:
        minutes: The limit (Megatron-LM compares ``elapsed > minutes``).
        device: Where the decision tensor lives (the collectives' device).
        start: Program start on this rank (default :data:`PROGRAM_START`); the earliest
            over the ranks is used (one MIN all-reduce here, collective).
        clock: ``time.time`` (tests pass a fake).
    """

    def __init__(self, minutes: float, device: torch.device, *,
                 start: Optional[float] = None, clock: Callable[[], float] = time.time):
        self.minutes, self.device, self.clock = minutes, device, clock
        first = torch.tensor([PROGRAM_START if start is None else start], dtype=torch.float64,
                             device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
        self.start = float(first.item())

    def elapsed_minutes(self) -> float:
        return (self.clock() - self.start) / 60.0

    def __call__(self, trainer: Any) -> bool:
        elapsed = self.elapsed_minutes()
        done = torch.tensor([int(elapsed > self.minutes)], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(done, op=dist.ReduceOp.MAX)  # the same decision on every rank
        if done.item():
            logger.warning("exiting program after %.2f minutes (--exit-duration-in-mins %s) at "
                           "iteration %d", elapsed, self.minutes, trainer.iteration)
        return bool(done.item())


def any_exit(fns: list) -> Optional[Callable[[Any], bool]]:
    """One ``exit_fn`` asking every one of ``fns`` (each runs its collective every time)."""
    fns = [f for f in fns if f is not None]
    if not fns:
        return None
    return lambda trainer: any([f(trainer) for f in fns])


class EodMaskedSource:
    """A sample source whose loss mask is 0 wherever the input token is ``eod``.

    Args:
        base: Any :class:`megatron.skrull.samples.SampleSource`.
        eod: The tokenizer's end-of-document id.
    """

    def __init__(self, base: Any, eod: int):
        self.base, self.eod = base, int(eod)
        self.lengths = np.asarray(base.lengths, dtype=np.int64)
        self._loss_tokens = np.full(len(self.lengths), -1, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getattr__(self, name: str):  # vocab_size, description, dataset, ...
        if name == "base":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.base, name)

    def sample(self, index: int) -> TokenSample:
        s = self.base.sample(index)
        mask = np.where(s.tokens == self.eod, np.float32(0.0), s.loss_mask).astype(np.float32)
        return TokenSample(tokens=s.tokens, labels=s.labels, loss_mask=mask)

    def num_loss_tokens(self, indices: np.ndarray) -> int:
        indices = np.asarray(indices, dtype=np.int64)
        for i in indices[self._loss_tokens[indices] < 0]:
            self._loss_tokens[i] = int(np.count_nonzero(self.sample(int(i)).loss_mask))
        return int(self._loss_tokens[indices].sum())


def eod_id(source: Any) -> Optional[int]:
    """The EOD id of the tokenizer a source was tokenized with (``None``: unknown, e.g.
    ``--mock-data``, whose samples hold no EOD token)."""
    while source is not None:
        dataset = getattr(source, "dataset", None)
        if dataset is not None:
            return dataset.tokenizer_description.get("eod")
        source = getattr(source, "base", None)
    return None


def mask_eod(sources: Any, printer: Callable[[str], None] = logger.info) -> Any:
    """``--eod-mask-loss`` on :class:`megatron.skrull.data.SampleSources` (train and
    validation), as Megatron-LM applies it to every split."""
    eod = eod_id(sources.train)
    if eod is None:
        printer(" skrull: --eod-mask-loss: the samples have no EOD token (--mock-data); "
                "nothing to mask")
        return sources
    valid = None if sources.valid is None else EodMaskedSource(sources.valid, eod)
    return sources._replace(train=EodMaskedSource(sources.train, eod), valid=valid)
