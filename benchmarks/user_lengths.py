"""The synthetic long-tail length file of docs/plan_quality.md ("A user's length file").

It stands in for a user's real file (``plan_quality.py --lengths FILE``): 10,000 lengths,
90% log-normal (median 550 tokens, sigma 0.8), 10% log-normal (median 15K, sigma 0.6),
clipped to [16, 131072]; ``numpy.random.default_rng(2026)`` draws the short values, then
the long ones, then the 90/10 choice (median 625, 8.5% above 8,000 tokens).

    python benchmarks/user_lengths.py /tmp/user_lengths.txt
"""
from __future__ import annotations

import sys

import numpy as np


def user_lengths(n: int = 10_000, seed: int = 2026) -> np.ndarray:
    """``[n]`` int64 lengths as the module doc says."""
    rng = np.random.default_rng(seed)
    short = rng.lognormal(np.log(550), 0.8, n)
    long = rng.lognormal(np.log(15_000), 0.6, n)
    pick = rng.choice(2, n, p=[0.9, 0.1]) == 1
    return np.clip(np.where(pick, long, short), 16, 131_072).astype(np.int64)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: user_lengths.py OUT.txt", file=sys.stderr)
        return 2
    np.savetxt(argv[0], user_lengths(), fmt="%d")
    return 0


if __name__ == "__main__":
    sys.exit(main())
