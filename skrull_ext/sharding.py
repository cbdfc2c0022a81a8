"""How a distributed sequence splits over CP ranks: zigzag padding and per-rank tokens.

A sample sharded over ``n > 1`` ranks is padded to a multiple of ``2 n`` (each rank holds two
zigzag chunks) and costs each rank ``pad(S, n) / n`` tokens; a local sample costs its rank ``S``.
Dependency-free on purpose: the cost model, the scheduler, the layout and the simulator all
count tokens this way.
"""
from __future__ import annotations

import numpy as np


def padded_length(length: int, n: int) -> int:
    """Length after zigzag padding for sharding over ``n`` ranks.

    Args:
        length: Tokens of the sample (>= 1).
        n: Number of ranks it is sharded over (>= 1).

    Returns:
        ``length`` rounded up to a multiple of ``2 n``; ``length`` itself when ``n == 1``
        (one rank needs no zigzag, so no padding).
    """
    if n <= 1:
        return int(length)
    m = 2 * n
    return -(-int(length) // m) * m


def shard_tokens(length: int, n: int) -> int:
    """Tokens each of ``n`` ranks holds of a sample sharded over them: ``pad(S, n) / n``."""
    return padded_length(length, n) // n


def shard_tokens_array(lengths, n: int) -> np.ndarray:
    """:func:`shard_tokens` of every entry: ``[K]`` lengths (>= 0) -> ``[K]`` int64."""
    arr = np.asarray(lengths, dtype=np.int64)
    if n <= 1:
        return arr.copy()
    m = 2 * n
    return (arr + (m - 1)) // m * 2  # pad(S, n) / n = ceil(S / 2n) * 2n / n, one division


def padded_length_array(lengths, n) -> np.ndarray:
    """:func:`padded_length` of every entry, each over its own rank count: ``[K]`` lengths
    and ``n`` (an int or ``[K]`` ints >= 1) -> ``[K]`` int64."""
    arr = np.asarray(lengths, dtype=np.int64)
    m = 2 * np.asarray(n, dtype=np.int64)
    return np.where(m <= 2, arr, (arr + (m - 1)) // m * m)

