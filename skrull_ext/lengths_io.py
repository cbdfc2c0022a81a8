"""Reading sample lengths from files: a JSON list, a ``.npy`` int array, or one int per line."""
from __future__ import annotations

import json
import os

import numpy as np


def read_lengths(path: str) -> np.ndarray:
    """Reads ``[K]`` sample lengths.

    Args:
        path: ``*.json`` (a list of ints), ``*.npy`` (a 1-D integer array) or a text file
            with one integer per line (blank lines and ``#`` comments are skipped).

    Returns:
        ``[K]`` int64 lengths, exactly as given (validation of values is the scheduler's).

    Raises:
        ValueError: unreadable file or a value that is not an integer, naming file and entry.
    """
    if not os.path.isfile(path):
        raise ValueError(f"lengths file {path!r} does not exist")
    if path.endswith(".npy"):
        try:
            arr = np.load(path, allow_pickle=False)
        except Exception as exc:  # noqa: BLE001 - numpy raises many kinds
            raise ValueError(f"{path}: not a readable .npy array ({exc})") from exc
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ValueError(f"{path}: expected a 1-D integer array, got {arr.dtype} {arr.shape}")
        return arr.astype(np.int64)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: invalid JSON ({exc})") from exc
        if not isinstance(values, list):
            raise ValueError(f"{path}: expected a JSON list of integers")
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{path}: entry {i} is {v!r}, not an integer")
        return np.asarray(values, dtype=np.int64).reshape(-1)
    values = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            values.append(int(line))
        except ValueError:
            raise ValueError(f"{path}:{lineno}: {line!r} is not an integer") from None
    return np.asarray(values, dtype=np.int64).reshape(-1)
