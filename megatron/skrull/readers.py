"""Input files of ``tools/preprocess_sft.py``: JSONL, JSON lists, gzip, Parquet, Arrow datasets.

:class:`RecordReader` yields ``(where, payload)`` per record: ``where`` is ``FILE:LINE`` (the
1-based line of a JSON file, the 1-based row of a Parquet or Arrow file) and ``payload`` is
the raw bytes of a JSONL line (parsed later, in a worker: :func:`parse_payload`) or an
already parsed record.  Accepted inputs:

* ``.jsonl`` (any other suffix is read as JSONL too), ``.jsonl.gz`` / ``.json.gz``;
* ``.json``: a JSON list of records (or JSONL under that name);
* ``.parquet`` and ``.arrow`` (Arrow IPC stream, as ``datasets`` writes it, or file format);
* a directory: a ``datasets`` ``save_to_disk`` directory (``state.json`` lists its ``.arrow``
  files; a ``DatasetDict`` one has ``dataset_dict.json`` and a folder per split), a Hugging
  Face hub cache (``datasets--org--name``: the snapshot ``refs/main`` points at) or any folder
  of data files; files whose path names a split (``train-0000.parquet``, ``data/test/...``)
  are kept only for ``--input-split`` (default ``train``).

Parquet and Arrow need ``pyarrow`` (``pip install pyarrow``, the ``data`` extra); the
``datasets`` package is not needed.
"""
from __future__ import annotations

import gzip
import json
import os
import re
from typing import Any, Iterator, Optional, Sequence, Union

from megatron.skrull.formats import InputError

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz", ".ndjson")
DATA_SUFFIXES = JSONL_SUFFIXES + (".json", ".parquet", ".arrow")
_METADATA = {"dataset_info.json", "dataset_infos.json", "state.json", "dataset_dict.json"}
_SPLITS = ("train", "validation", "valid", "test", "dev")


def _pyarrow():
    try:
        import pyarrow  # noqa: F401  - optional: only Parquet and Arrow inputs need it
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise InputError("reading Parquet or Arrow files needs pyarrow: pip install pyarrow "
                         "(or the project's data extra)") from None
    return pyarrow


def _hub_snapshot(path: str) -> Optional[str]:
    """The snapshot folder of a hub cache entry (``refs/main``, else the only one)."""
    snaps = os.path.join(path, "snapshots")
    if not os.path.isdir(snaps):
        return None
    ref = os.path.join(path, "refs", "main")
    if os.path.isfile(ref):
        with open(ref) as fh:
            return os.path.join(snaps, fh.read().strip())
    names = sorted(os.listdir(snaps))
    if len(names) != 1:
        raise InputError(f"{path}: hub cache with {len(names)} snapshots and no refs/main; "
                         "pass the snapshot folder itself")
    return os.path.join(snaps, names[0])


def _split_filter(files: list[str], root: str, split: str) -> list[str]:
    def names(f: str, s: str) -> bool:
        return re.search(rf"(^|[/_.-]){re.escape(s)}([/_.-]|$)", os.path.relpath(f, root))
    if not any(names(f, s) for f in files for s in _SPLITS):
        return files
    return [f for f in files if names(f, split)]


def resolve_files(path: str, split: str = "train") -> list[str]:
    """The data files of ``path`` in reading order.

    Raises:
        InputError: ``path`` does not exist or a directory holds no data file.
    """
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise InputError(f"--input {path!r} does not exist")
    state = os.path.join(path, "state.json")
    if os.path.isfile(state):  # datasets' save_to_disk
        with open(state) as fh:
            files = [os.path.join(path, f["filename"]) for f in json.load(fh)["_data_files"]]
        return files
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        sub = os.path.join(path, split)
        if not os.path.isdir(sub):
            raise InputError(f"{path}: DatasetDict without a {split!r} split; pass "
                             "--input-split with one of its splits")
        return resolve_files(sub, split)
    root = _hub_snapshot(path) or path
    files = sorted(os.path.join(d, f) for d, dirs, names in os.walk(root, followlinks=True)
                   for f in names
                   if f.endswith(DATA_SUFFIXES) and f not in _METADATA
                   and not any(p.startswith(".") for p in os.path.relpath(d, root).split(os.sep)
                               if p != "."))
    files = _split_filter(files, root, split)
    if not files:
        raise InputError(f"--input {path!r}: no data file ({', '.join(DATA_SUFFIXES)}) for "
                         f"split {split!r} in this directory")
    return files


def parse_payload(where: str, payload: Any) -> Any:
    """A record from a reader's payload (JSON line bytes are decoded and parsed here)."""
    if not isinstance(payload, bytes):
        return payload
    try:
        line = payload.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as exc:
        raise InputError(f"{where}: not valid UTF-8 ({exc.reason})") from None
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: malformed JSON ({exc.msg} at column {exc.pos + 1})"
                         ) from None


class RecordReader:
    """Iterates the records of the ``--input`` files and dataset directories, in order.

    Args:
        paths: One input or several.
        split: Split kept from a directory (``--input-split``).
    """

    def __init__(self, paths: Union[str, Sequence[str]], split: str = "train") -> None:
        self.paths = [paths] if isinstance(paths, str) else list(paths)
        self.files = [f for path in self.paths for f in resolve_files(path, split)]
        self._sizes = [max(1, os.path.getsize(f)) for f in self.files]
        self._done_bytes, self._file, self._current = 0, 0, lambda: 0.0

    @property
    def total_bytes(self) -> int:
        return sum(self._sizes)

    def fraction(self) -> float:
        """Share of the input's bytes read so far, in ``[0, 1]``."""
        part = self._current() * self._sizes[min(len(self._sizes) - 1, self._file)]
        return min(1.0, (self._done_bytes + part) / self.total_bytes)

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        self._done_bytes = 0
        for self._file, (name, size) in enumerate(zip(self.files, self._sizes)):
            if name.endswith(".parquet"):
                yield from self._parquet(name)
            elif name.endswith(".arrow"):
                yield from self._arrow(name)
            elif name.endswith(".json") and _starts_with_bracket(name):
                yield from self._json_list(name)
            else:
                yield from self._jsonl(name)
            self._done_bytes += size
            self._current = lambda: 0.0

    def _jsonl(self, name: str) -> Iterator[tuple[str, bytes]]:
        with open(name, "rb") as raw:
            fh = gzip.GzipFile(fileobj=raw) if name.endswith(".gz") else raw
            self._current = lambda: raw.tell() / self._sizes[self._file]
            try:
                for lineno, line in enumerate(fh, start=1):
                    if line.strip():
                        yield f"{name}:{lineno}", line
            except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError
                raise InputError(f"{name}: not a readable gzip file ({exc})") from None

    def _json_list(self, name: str) -> Iterator[tuple[str, Any]]:
        with open(name, "rb") as fh:
            data = fh.read()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = data.count(b"\n", 0, exc.start) + 1
            raise InputError(f"{name}:{line}: not valid UTF-8 ({exc.reason})") from None
        decoder, pos, line = json.JSONDecoder(), text.index("[") + 1, 1
        line += text.count("\n", 0, pos)
        while True:
            start = _skip(text, pos, ",")
            if start < len(text) and text[start] == "]":
                return
            line += text.count("\n", pos, start)
            where = f"{name}:{line}"
            try:
                record, end = decoder.raw_decode(text, start)
            except json.JSONDecodeError as exc:
                raise InputError(f"{name}:{exc.lineno}: malformed JSON ({exc.msg} at column "
                                 f"{exc.colno})") from None
            self._current = lambda e=end: e / len(text)
            yield where, record
            line += text.count("\n", start, end)
            pos = end

    def _parquet(self, name: str) -> Iterator[tuple[str, Any]]:
        pa = _pyarrow()
        try:
            pf = pa.parquet.ParquetFile(name)
        except pa.ArrowException as exc:
            raise InputError(f"{name}: not a readable Parquet file ({exc})") from None
        total = max(1, pf.metadata.num_rows)
        row = 0
        for batch in pf.iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                row += 1
                self._current = lambda r=row: r / total
                yield f"{name}:{row}", record

    def _arrow(self, name: str) -> Iterator[tuple[str, Any]]:
        pa = _pyarrow()
        source = pa.memory_map(name)
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            try:
                reader = pa.ipc.open_file(source)
            except pa.ArrowInvalid as exc:
                raise InputError(f"{name}: not an Arrow IPC stream or file ({exc})") from None
        table = reader.read_all()
        total, row = max(1, table.num_rows), 0
        for batch in table.to_batches(max_chunksize=1024):
            for record in batch.to_pylist():
                row += 1
                self._current = lambda r=row: r / total
                yield f"{name}:{row}", record


def _skip(text: str, pos: int, extra: str = "") -> int:
    """Index of the next character of ``text`` from ``pos`` that is neither space nor in
    ``extra``."""
    n = len(text)
    while pos < n and (text[pos].isspace() or text[pos] in extra):
        pos += 1
    return pos


def _starts_with_bracket(name: str) -> bool:
    with open(name, "rb") as fh:
        head = fh.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")
