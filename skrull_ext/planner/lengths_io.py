"""Reading sample lengths from files: shared by the planner CLIs and the length profiles.

Two sources:

* :func:`read_lengths`: a user's lengths file, one of
  - ``*.json``: a JSON list of positive integers,
  - ``*.npy``: a 1-D integer NumPy array,
  - anything else: text with one positive integer per line (blank lines and lines
    starting with ``#`` are skipped).
* :func:`read_megatron_idx_lengths`: the per-sequence token counts of a Megatron
  ``IndexedDataset`` (``PREFIX.idx``), read directly with NumPy so that ``skrull_ext``
  never imports Megatron.

Every error is a :class:`ValueError` that names the file (and the line or element).
"""
from __future__ import annotations

import json
import os
import struct

import numpy as np

from skrull_ext.cli_common import MAX_LENGTH

# The Megatron ``.idx`` layout (megatron/core/datasets/indexed_dataset.py, version 1), all
# little-endian:
#   9 bytes  magic b"MMIDIDX\x00\x00"
#   u64      version (1)
#   u8       dtype code of the token ids in the .bin file
#   u64      sequence_count
#   u64      document_count
#   int32[sequence_count]   sequence lengths (tokens)
#   int64[sequence_count]   byte offsets of the sequences in the .bin file
#   int64[document_count]   document boundaries (indices into the sequences)
_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEADER_BYTES = 9 + 8 + 1 + 8 + 8


def _too_long(path: str, where: str, value: int) -> ValueError:
    return ValueError(f"{path}: {where}: length {value} is more than 2^40 tokens, the "
                      "largest the scheduler takes; fix the file")


def _check_values(arr: np.ndarray, path: str, where) -> np.ndarray:
    """Rejects lengths < 1 or > 2^40; ``where(i)`` describes element ``i``."""
    bad = np.flatnonzero(arr < 1)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{path}: {where(i)}: length {int(arr[i])} is < 1; "
                         "every sample needs at least one token")
    big = np.flatnonzero(arr > MAX_LENGTH)
    if big.size:
        raise _too_long(path, where(int(big[0])), int(arr[int(big[0])]))
    return arr.astype(np.int64)


def _read_json(path: str) -> np.ndarray:
    with open(path, encoding="utf-8") as f:
        try:
            obj = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg}); "
                             "expected a list of integers") from exc
    if not isinstance(obj, list):
        raise ValueError(f"{path}: expected a JSON list of integers, got {type(obj).__name__}")
    for i, x in enumerate(obj):
        if isinstance(x, bool) or not isinstance(x, int):
            raise ValueError(f"{path}: element {i} is {x!r}, not an integer length")
        if x > MAX_LENGTH:  # before int64 conversion (2^70 would overflow it)
            raise _too_long(path, f"element {i}", x)
    return _check_values(np.asarray(obj, dtype=np.int64), path, lambda i: f"element {i}")


def _read_npy(path: str) -> np.ndarray:
    try:
        arr = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path}: cannot read as a .npy array ({exc})") from exc
    if arr.ndim != 1:
        raise ValueError(f"{path}: expected a 1-D array of lengths, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{path}: expected an integer array, got dtype {arr.dtype}; "
                         "save it with .astype(np.int64)")
    return _check_values(arr, path, lambda i: f"element {i}")


def _read_text(path: str) -> np.ndarray:
    values: list[int] = []
    lines: list[int] = []
    with open(path, encoding="utf-8") as f:
        for lineno, raw in enumerate(f, start=1):
            text = raw.strip()
            if not text or text.startswith("#"):
                continue
            try:
                values.append(int(text))
            except ValueError:
                raise ValueError(f"{path}: line {lineno}: {text[:40]!r} is not an integer; "
                                 "expected one length per line") from None
            if values[-1] > MAX_LENGTH:  # before int64 conversion (2^70 would overflow it)
                raise _too_long(path, f"line {lineno}", values[-1])
            lines.append(lineno)
    arr = np.asarray(values, dtype=np.int64)
    return _check_values(arr, path, lambda i: f"line {lines[i]}")


def read_lengths(path: str) -> np.ndarray:
    """Reads a lengths file (JSON list, ``.npy`` array or one integer per line).

    Args:
        path: The file; the format is chosen by its suffix (``.json``, ``.npy``, else text).

    Returns:
        ``[K]`` int64 lengths, ``K >= 1``, every value ``>= 1``.

    Raises:
        ValueError: missing/empty file or bad content, naming the file and line/element.
    """
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such lengths file")
    lower = path.lower()
    if lower.endswith(".json"):
        arr = _read_json(path)
    elif lower.endswith(".npy"):
        arr = _read_npy(path)
    else:
        arr = _read_text(path)
    if arr.size == 0:
        raise ValueError(f"{path}: contains no lengths")
    return arr


def read_megatron_idx_lengths(prefix: str) -> np.ndarray:
    """Per-sequence token counts of a Megatron indexed dataset.

    Args:
        prefix: Dataset prefix (``PREFIX.idx`` is read) or the ``.idx`` path itself.

    Returns:
        ``[sequence_count]`` int64 lengths (one entry per sequence of the ``.idx``; in an
        SFT dataset written one sample per sequence, one per sample).

    Raises:
        ValueError: missing file, bad magic/version, or a truncated file.
    """
    path = prefix if prefix.endswith(".idx") else prefix + ".idx"
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such Megatron index file (give --data-path PREFIX "
                         "without the .idx/.bin suffix)")
    with open(path, "rb") as f:
        header = f.read(_IDX_HEADER_BYTES)
    if len(header) < _IDX_HEADER_BYTES or header[:9] != _IDX_MAGIC:
        raise ValueError(f"{path}: not a Megatron MMIDIDX index file (bad header)")
    (version,) = struct.unpack("<Q", header[9:17])
    if version != 1:
        raise ValueError(f"{path}: unsupported .idx version {version} (expected 1)")
    (count,) = struct.unpack("<Q", header[18:26])
    size = os.path.getsize(path)
    if _IDX_HEADER_BYTES + 4 * count > size:
        raise ValueError(f"{path}: truncated: header says {count} sequences, file has "
                         f"{size} bytes")
    lengths = np.fromfile(path, dtype="<i4", count=count, offset=_IDX_HEADER_BYTES)
    if count == 0:
        raise ValueError(f"{path}: the dataset holds no sequences")
    return _check_values(lengths.astype(np.int64), path, lambda i: f"sequence {i}")


__all__ = ["read_lengths", "read_megatron_idx_lengths"]
