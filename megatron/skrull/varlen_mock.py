"""Megatron-LM dev's ``--use-varlen-dataset --mock-data`` lengths for our synthetic task.

Megatron-LM ``dev`` (d48bd6be; pull request 5811 brings it to ``main``) benchmarks packing
and dynamic CP on ``MockVarlenDataset``, whose sample lengths come from
``MockSFTLowLevelDataset`` (``megatron/training/datasets/sft_dataset.py``), configured by
``--varlen-mock-dataset-config-json`` (an inline JSON literal or a file holding one):

* ``{"mode": "distribution", "type": "lognormal", "min_seq_len", "max_seq_len",
  "mean_seq_len", "lognormal_sigma"}``: NumPy's legacy global RNG seeded with 0 draws
  1,000,000 lengths ``lognormal(log(mean) - sigma^2 / 2, sigma)``, clipped, truncated to int;
* ``{"mode": "file", "path": CSV}``: the CSV's cells after its first row (pandas reads
  that row as the header), row by row;
* without the flag, the lognormal with ``--seq-length S``: ``[S / 2, S]``, mean ``3 S / 4``,
  sigma 1.1 (``MockVarlenDataset``'s default).

Sample ``i`` has length ``lengths[i % size]`` in tokens, the EOD included, so it trains one
position fewer.  Here those lengths drive :class:`megatron.skrull.samples.SyntheticSFTSource`
(our learnable task, not Megatron's random tokens), so the scheduler sees the same
per-sample positions in the same order: ``length - 1``, kept within ``[4, --seq-length]``
(our task's shortest sample is 4 tokens; Megatron truncates to ``--seq-length``).
``"mode": "verification"`` (real tokens from an IndexedDataset) is refused: use
``--data-path`` with a preprocessed prefix.
"""
from __future__ import annotations

import csv
import json
import math
import os
from typing import Any, Optional

import numpy as np

FLAG = "--varlen-mock-dataset-config-json"
# MockSFTLowLevelDataset's class constants at Megatron-LM dev d48bd6be.
MEGATRON_SEED, MEGATRON_SIZE = 0, 1_000_000
SHORTEST = 4  # SyntheticSFTSource: BOS, key, two body tokens


def read_config(text: Optional[str], seq_length: int) -> dict[str, Any]:
    """The mock config of ``FLAG`` (``None``: Megatron's default for ``seq_length``).

    Raises:
        ValueError: Not JSON, not a file, or not a supported mode (the message names the fix).
    """
    if text is None:
        return {"mode": "distribution", "type": "lognormal", "min_seq_len": seq_length // 2,
                "max_seq_len": seq_length, "mean_seq_len": seq_length // 4 * 3,
                "lognormal_sigma": 1.1}
    source = text
    if not text.lstrip().startswith("{"):
        if not os.path.isfile(text):
            raise ValueError(f"{FLAG} {text}: neither a JSON object nor a file; give "
                             '\'{"mode": "distribution", ...}\' or a path to one')
        with open(text, encoding="utf-8") as fh:
            source = fh.read()
    try:
        config = json.loads(source)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{FLAG}: not valid JSON ({exc}); give an object such as "
                         '{"mode": "distribution", "type": "lognormal", ...}') from None
    if not isinstance(config, dict) or config.get("mode") not in ("distribution", "file"):
        raise ValueError(f"{FLAG}: mode must be \"distribution\" or \"file\", got "
                         f"{config.get('mode') if isinstance(config, dict) else config!r}"
                         " (verification mode reads real tokens: use --data-path with a "
                         "preprocessed prefix)")
    return config


def check(config: dict[str, Any]) -> None:
    """Raises ``ValueError`` (naming the fix) if ``config`` cannot give lengths."""
    if config["mode"] == "file":
        _csv_lengths(config.get("path"))
    else:
        _lognormal_params(config)


def megatron_lengths(config: dict[str, Any]) -> np.ndarray:
    """``MockSFTLowLevelDataset``'s lengths (tokens, EOD included): ``[size]`` int64."""
    if config["mode"] == "file":
        return _csv_lengths(config.get("path"))
    low, high, mean, sigma = _lognormal_params(config)
    rng = np.random.RandomState(MEGATRON_SEED)  # the legacy global RNG after seed(0)
    drawn = rng.lognormal(math.log(mean) - sigma ** 2 / 2, sigma, MEGATRON_SIZE)
    return np.clip(drawn, low, high).astype(np.int64)


def _lognormal_params(config: dict[str, Any]) -> tuple[int, int, float, float]:
    try:
        low, high = int(config["min_seq_len"]), int(config["max_seq_len"])
        mean, sigma = float(config["mean_seq_len"]), float(config["lognormal_sigma"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{FLAG}: distribution mode needs min_seq_len, max_seq_len, "
                         f"mean_seq_len and lognormal_sigma numbers ({exc!r} missing or bad)"
                         ) from None
    if config.get("type") != "lognormal" or not 1 <= low <= high or mean <= 0 or sigma <= 0:
        raise ValueError(f"{FLAG}: need type lognormal, 1 <= min_seq_len <= max_seq_len, "
                         f"mean_seq_len > 0 and lognormal_sigma > 0, got {config}")
    return low, high, mean, sigma


def _csv_lengths(path: Any) -> np.ndarray:
    if not isinstance(path, str) or not os.path.isfile(path):
        raise ValueError(f"{FLAG}: file mode needs \"path\" to a CSV of sequence lengths, "
                         f"got {path!r}")
    with open(path, newline="", encoding="utf-8") as fh:
        rows = list(csv.reader(fh))[1:]  # pandas.read_csv takes the first row as the header
    try:
        out = np.array([int(float(c)) for row in rows for c in row if c.strip()],
                       dtype=np.int64)
    except ValueError as exc:
        raise ValueError(f"{FLAG}: {path}: not a CSV of numbers ({exc})") from None
    if not len(out) or out.min() < 1:
        raise ValueError(f"{FLAG}: {path}: needs at least one length >= 1 after the header row")
    return out


def flag_problems(*, use_varlen_dataset: bool, use_mock: bool, config: Optional[str],
                  sbhd_validation: bool) -> list[str]:
    """The varlen flags' problems, one line each naming the fix (``DataArgs``' check)."""
    if sbhd_validation:
        return ["--varlen-sbhd-validation: Megatron's padded SBHD reference mode is not "
                "implemented (samples always run as packed documents); drop the flag"]
    if config is None:
        return []
    if not (use_varlen_dataset and use_mock):
        return [f"{FLAG} applies to --use-varlen-dataset --mock-data (as in Megatron); add "
                "them, or drop it"]
    try:
        check(read_config(config, 1))
    except ValueError as exc:
        return [str(exc)]
    return []


def sample_positions(config: dict[str, Any], num_samples: int, seq_length: int) -> np.ndarray:
    """Training positions of our samples ``0 .. num_samples - 1``: ``[num_samples]`` int64."""
    if seq_length < SHORTEST:
        raise ValueError(f"--seq-length {seq_length}: the mock task needs >= {SHORTEST}")
    lengths = megatron_lengths(config)
    return np.clip(lengths[np.arange(num_samples) % len(lengths)] - 1, SHORTEST, seq_length)


__all__ = ["FLAG", "check", "flag_problems", "megatron_lengths", "read_config",
           "sample_positions"]
