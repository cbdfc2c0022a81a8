"""SFT preprocessing: chat records -> Megatron indexed datasets (tokens + loss mask).

Records come from :mod:`megatron.skrull.readers` (JSONL, JSON lists, gzip, Parquet, Arrow and
``datasets`` folders) in any format of :mod:`megatron.skrull.formats` (OpenAI messages with
tool calls, ShareGPT, Alpaca, prompt/response); ``--workers N`` tokenizes on N processes
with byte-identical output (:func:`parallel_samples`, :mod:`megatron.skrull.workers`).

On-disk format for ``--output-prefix P`` (see docs/data.md):

- ``P.bin`` / ``P.idx``: Megatron ``IndexedDataset`` of token ids, one sequence (and one
  document) per sample, dtype ``uint16`` when the vocabulary fits, else ``int32``.  It is a
  standard GPT dataset, so stock Megatron tools read it.
- ``P_lossmask.bin`` / ``P_lossmask.idx``: a second ``IndexedDataset`` (``uint8``), with
  exactly the same sequence lengths, holding 1 on every token that is trained.
- ``P.json``: metadata (format version, tokenizer identity, ``seq_length``, counts).  It is
  written last, after the four files above are complete, so its presence marks a finished
  dataset.

Sample layout: the tokenizer's chat template when it has one (rendered by transformers'
``apply_chat_template``, assistant replies found by :mod:`megatron.skrull.chat_template`), else
``[BOS] (role_prefix content turn_end turn_sep)*`` (BOS only when the tokenizer has one).  The mask is 1 on assistant content and on the ``turn_end`` that closes
an assistant turn (the model learns to stop), 0 elsewhere.  A stored sample of S tokens gives
S - 1 training positions (input ``tokens[:-1]``, labels ``tokens[1:]``); ``--seq-length`` bounds
S - 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import sys
import warnings
from typing import Any, Iterable, Iterator, Optional

import numpy as np

from megatron.skrull.corpus import CorpusConfig, generate_records
from megatron.skrull.formats import (INPUT_FORMATS, LOSS_ON, InputError, detect_format,
                                     plain_turns, to_conversation, trained_turns)
from megatron.skrull.readers import RecordReader, parse_payload
from megatron.skrull.tokenizer import (DEFAULT_TOKENIZER_TYPE, TOKENIZER_TYPES, SFTTokenizer,
                                       build_tokenizer)

FORMAT_VERSION = 1
LOSSMASK_SUFFIX = "_lossmask"
OVERLONG_POLICIES = ("error", "truncate", "drop")


class WriteError(RuntimeError):
    """The output could not be written (full disk, permissions): exit status 1."""


@dataclasses.dataclass
class PreprocessStats:
    """Counts reported after preprocessing.

    Attributes:
        read: Records read from the input.
        written: Samples written.
        truncated: Samples cut to ``seq_length + 1`` tokens (``--overlong truncate``).
        dropped: Overlong samples left out (``--overlong drop``).
        skipped_empty: Samples without trainable tokens left out (``--skip-empty``).
        tokens: Tokens written (sum of S).
        loss_tokens: Trained label positions written.
        max_length: Longest training length written (max of S - 1).
    """

    read: int = 0
    written: int = 0
    truncated: int = 0
    dropped: int = 0
    skipped_empty: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    max_length: int = 0

    def summary(self) -> str:
        return " ".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items())


def dataset_paths(prefix: str) -> dict[str, str]:
    """The five files of a preprocessed dataset, keyed by role."""
    return {"tokens_bin": prefix + ".bin", "tokens_idx": prefix + ".idx",
            "mask_bin": prefix + LOSSMASK_SUFFIX + ".bin",
            "mask_idx": prefix + LOSSMASK_SUFFIX + ".idx", "meta": prefix + ".json"}


def record_to_messages(record: Any, where: str,
                       input_format: Optional[str] = None) -> list[dict[str, Any]]:
    """Validates one record and returns its messages (:mod:`megatron.skrull.formats`).

    Args:
        record: Parsed JSON in one of :data:`~megatron.skrull.formats.INPUT_FORMATS`.
        where: Location for error messages (e.g. ``"data.jsonl:12"``).
        input_format: The record's format (``None``: detected from its keys).

    Raises:
        InputError: The record fits no (or not the given) format, or holds a bad message.
    """
    return to_conversation(record, input_format or detect_format(record, where), where).messages


def tokenize_conversation(tokenizer: SFTTokenizer, messages: list[dict[str, Any]], *,
                          tools: Optional[list] = None,
                          loss_on: str = "assistant") -> tuple[np.ndarray, np.ndarray]:
    """Applies the chat template.

    Args:
        tokenizer: Any :class:`SFTTokenizer`.
        messages: Validated messages (see :func:`record_to_messages`).
        tools: Tool definitions (rendered by a chat template that supports them).
        loss_on: ``--sft-loss-on``: ``assistant`` (every reply), ``last-assistant`` or
            ``all`` (prompt too).

    Returns:
        ``(tokens, mask)``: int64 ``[S]`` and uint8 ``[S]``; ``mask[t] == 1`` where token t
        is trained as a label.  A tokenizer with a chat template renders it with
        transformers (``tokens == apply_chat_template(messages)``); others use role markers,
        tool calls and results written as text (:func:`~megatron.skrull.formats.plain_turns`).
    """
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.encode_chat(messages, tools=tools, loss_on=loss_on)
    tokens: list[int] = [] if tokenizer.bos is None else [tokenizer.bos]
    everything = 1 if loss_on == "all" else 0
    mask: list[int] = [everything] * len(tokens)
    end, sep = tokenizer.turn_end, tokenizer.turn_sep
    turns = plain_turns(messages)
    for (role, text), trained in zip(turns, trained_turns([r for r, _ in turns], loss_on)):
        prefix = tokenizer.role_prefix(role)
        content = tokenizer.encode(text)
        tokens += prefix + content + end + sep
        mask += ([everything] * len(prefix) + [int(trained)] * (len(content) + len(end))
                 + [everything] * len(sep))
    return np.asarray(tokens, dtype=np.int64), np.asarray(mask, dtype=np.uint8)


def has_response(tokenizer: SFTTokenizer, messages: list[dict[str, Any]]) -> bool:
    """Whether any assistant message has a tool call or non-empty tokenized content."""
    return any(m["role"] == "assistant" and (m.get("tool_calls") or tokenizer.encode(
        m["content"])) for m in messages)


def iter_jsonl(path: str) -> Iterator[tuple[str, Any]]:
    """Yields ``(where, record)`` per non-blank line; malformed JSON names the line.

    Raises:
        InputError: ``path`` does not exist, or a line is not valid JSON (or not UTF-8).
    """
    for where, payload in RecordReader(path):
        yield where, parse_payload(where, payload)


def _fit_length(tokens: np.ndarray, mask: np.ndarray, seq_length: int, overlong: str,
                where: str, stats: PreprocessStats) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """Applies the overlong policy; None when the sample is dropped."""
    if len(tokens) - 1 <= seq_length:
        return tokens, mask
    if overlong == "drop":
        stats.dropped += 1
        return None
    if overlong == "truncate":
        stats.truncated += 1
        return tokens[:seq_length + 1], mask[:seq_length + 1]
    raise InputError(f"{where}: sample has {len(tokens) - 1} training positions > "
                     f"--seq-length {seq_length}; raise --seq-length or pass "
                     "--overlong truncate|drop")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SampleOptions:
    """How records become samples (the flags every worker needs).

    Attributes:
        seq_length: Most training positions per sample (S - 1 <= seq_length).
        overlong: ``"error"``, ``"truncate"`` or ``"drop"`` for longer samples.
        skip_empty: Count and skip samples with no trainable label instead of failing.
        input_format: Format of every record (``None``: detected per record).
        loss_on: ``--sft-loss-on`` (:data:`~megatron.skrull.formats.LOSS_ON`).
    """

    seq_length: int
    overlong: str = "error"
    skip_empty: bool = False
    input_format: Optional[str] = None
    loss_on: str = "assistant"

    def __post_init__(self) -> None:
        if self.overlong not in OVERLONG_POLICIES:
            raise ValueError(f"--overlong must be one of {', '.join(OVERLONG_POLICIES)}")
        if self.seq_length < 1:
            raise ValueError(f"--seq-length must be >= 1, got {self.seq_length}")
        if self.input_format not in (None, *INPUT_FORMATS):
            raise ValueError(f"--input-format must be one of {', '.join(INPUT_FORMATS)}")
        if self.loss_on not in LOSS_ON:
            raise ValueError(f"--sft-loss-on must be one of {', '.join(LOSS_ON)}")


def process_record(where: str, payload: Any, tokenizer: SFTTokenizer, opts: SampleOptions,
                   stats: PreprocessStats) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """One record (or a JSON line's bytes) -> ``(tokens int64 [S], mask uint8 [S])``.

    Returns ``None`` for a sample left out (dropped or skipped; counted in ``stats``).

    Raises:
        InputError: Malformed record, overlong sample under ``"error"``, or a sample with no
            trainable label without ``skip_empty``.
    """
    stats.read += 1
    record = parse_payload(where, payload)
    conv = to_conversation(record, opts.input_format or detect_format(record, where), where)
    tokens, mask = tokenize_conversation(tokenizer, conv.messages, tools=conv.tools,
                                         loss_on=opts.loss_on)
    fitted = _fit_length(tokens, mask, opts.seq_length, opts.overlong, where, stats)
    if fitted is None:
        return None
    tokens, mask = fitted
    # mask[0] can never be a label (nothing precedes it), so count labels from 1.
    if len(tokens) < 2 or not mask[1:].any() or not has_response(tokenizer, conv.messages):
        if opts.skip_empty:
            stats.skipped_empty += 1
            return None
        raise InputError(f"{where}: sample has no assistant/response tokens to train on "
                         "(after truncation, if any); fix the data or pass --skip-empty")
    stats.written += 1
    stats.tokens += len(tokens)
    stats.loss_tokens += int(mask[1:].sum())
    stats.max_length = max(stats.max_length, len(tokens) - 1)
    return tokens, mask


def process_records(records: Iterable[tuple[str, Any]], tokenizer: SFTTokenizer, *,
                    seq_length: int, overlong: str = "error", skip_empty: bool = False,
                    stats: Optional[PreprocessStats] = None, input_format: Optional[str] = None,
                    loss_on: str = "assistant") -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Validates, tokenizes and length-checks records in one process.

    Args:
        records: ``(where, record)`` pairs (see :func:`iter_jsonl`).
        tokenizer: Tokenizer applying the chat template.
        seq_length, overlong, skip_empty, input_format, loss_on: See :class:`SampleOptions`.
        stats: Counters updated in place (read, truncated, dropped, ...), if given.

    Yields:
        ``(tokens int64 [S], mask uint8 [S])`` per kept sample.

    Raises:
        InputError: See :func:`process_record`.
    """
    opts = SampleOptions(seq_length=seq_length, overlong=overlong, skip_empty=skip_empty,
                         input_format=input_format, loss_on=loss_on)
    stats = PreprocessStats() if stats is None else stats
    for where, record in records:
        sample = process_record(where, record, tokenizer, opts, stats)
        if sample is not None:
            yield sample


def _import_indexed_dataset():
    # megatron.core warns at import about missing Transformer Engine/Apex; irrelevant here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def write_dataset(samples: Iterable[tuple[np.ndarray, np.ndarray]], output_prefix: str,
                  tokenizer: SFTTokenizer, *, seq_length: int, stats: PreprocessStats,
                  extra_meta: Optional[dict[str, Any]] = None) -> None:
    """Writes ``<prefix>.bin/.idx``, ``<prefix>_lossmask.bin/.idx`` and ``<prefix>.json``.

    Files are built under temporary names and renamed only when every sample is written, so
    a failure leaves no half-written dataset behind.  An older dataset at the prefix loses
    its metadata first, so a crash mid-rename never pairs old metadata with new data.

    Args:
        samples: ``(tokens [S], mask [S])`` pairs, e.g. from :func:`process_records`.
        output_prefix: Path prefix of the dataset.
        tokenizer: The tokenizer that produced the samples (stored in the metadata).
        seq_length: The ``--seq-length`` bound (stored in the metadata).
        stats: The counters ``samples`` updates (stored in the metadata).
        extra_meta: More JSON-able metadata (e.g. the synthetic corpus config).

    Raises:
        InputError: No sample survived.
    """
    import torch  # the builder's add_item takes tensors

    idx_mod = _import_indexed_dataset()
    token_dtype = idx_mod.DType.optimal_dtype(tokenizer.vocab_size)
    paths = dataset_paths(output_prefix)
    tmp = {k: f"{v}.tmp{os.getpid()}" for k, v in paths.items()}
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    builders = []
    try:
        tok_builder = idx_mod.IndexedDatasetBuilder(tmp["tokens_bin"], dtype=token_dtype)
        builders.append(tok_builder)
        mask_builder = idx_mod.IndexedDatasetBuilder(tmp["mask_bin"], dtype=np.uint8)
        builders.append(mask_builder)
        for tokens, mask in samples:
            tok_builder.add_item(torch.from_numpy(tokens))
            tok_builder.end_document()
            mask_builder.add_item(torch.from_numpy(mask))
            mask_builder.end_document()
        tok_builder.finalize(tmp["tokens_idx"])
        mask_builder.finalize(tmp["mask_idx"])
        if stats.written == 0:
            raise InputError("no sample left to write (all dropped or skipped); check the "
                             "input, --seq-length and --overlong")
        meta = {"format_version": FORMAT_VERSION, "tokenizer": tokenizer.describe(),
                "seq_length": seq_length, "num_samples": stats.written,
                "token_dtype": np.dtype(token_dtype).name, "stats": dataclasses.asdict(stats)}
        meta.update(extra_meta or {})
        with open(tmp["meta"], "w") as fh:
            json.dump(meta, fh, indent=1, sort_keys=True)
        if os.path.exists(paths["meta"]):
            os.remove(paths["meta"])
        for key in ("tokens_bin", "tokens_idx", "mask_bin", "mask_idx", "meta"):
            os.replace(tmp[key], paths[key])
    except OSError as exc:  # a full disk, a read-only directory, ...
        fix = ("free space on that disk or choose another --output-prefix"
               if exc.errno == errno.ENOSPC else "choose a writable --output-prefix")
        raise WriteError(f"writing {output_prefix}.*: {exc.strerror or exc}; {fix} "
                         "(nothing was replaced)") from exc
    finally:
        _discard(builders, tmp.values())


def _discard(builders: list, tmp_paths: Iterable[str]) -> None:
    """Closes the builders and removes every temporary file, even on a full disk.

    Closing flushes the write buffer, which raises again when the disk is full: that must
    not stop the cleanup (it used to leave ``*.bin.tmpPID`` files behind).
    """
    for builder in builders:  # finalize() closes them; an error path may not have
        try:
            builder.data_file.close()
        except OSError:
            pass
    for path in tmp_paths:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


_WORKER: dict[str, Any] = {}  # this process's tokenizer and options (see _work_chunk)


def _init_worker(tokenizer_type: Optional[str], tokenizer_model: Optional[str],
                 opts: SampleOptions) -> None:
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent's handler is for the parent
    _WORKER.update(tokenizer=build_tokenizer(tokenizer_type, tokenizer_model), opts=opts)


def _work_chunk(items: list[tuple[str, Any]]) -> tuple[list, PreprocessStats]:
    """Samples and counts of one chunk of records (runs in a worker or in-process)."""
    stats = PreprocessStats()
    samples = [process_record(where, payload, _WORKER["tokenizer"], _WORKER["opts"], stats)
               for where, payload in items]
    return [s for s in samples if s is not None], stats


def _merge(total: PreprocessStats, part: PreprocessStats) -> None:
    for field in dataclasses.fields(PreprocessStats):
        a, b = getattr(total, field.name), getattr(part, field.name)
        setattr(total, field.name, max(a, b) if field.name == "max_length" else a + b)


def parallel_samples(records: Iterable[tuple[str, Any]], tokenizer: SFTTokenizer,
                     opts: SampleOptions, stats: PreprocessStats, *, workers: int = 1,
                     progress: Any = None, chunk_size: int = 256,
                     ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """:func:`process_records` on ``workers`` processes, samples in input order.

    The output does not depend on ``workers`` (chunks are processed in any order, written in
    order); the first bad record, in input order, raises as with one worker.

    Args:
        records: ``(where, record or JSON line bytes)`` pairs.
        tokenizer: This process's tokenizer; workers build their own from its ``describe()``.
        opts: How records become samples.
        stats: Counters updated in place.
        workers: Processes (``--workers``).
        progress: A :class:`megatron.skrull.workers.Progress` (``None``: silent).
        chunk_size: Records per task.
    """
    from megatron.skrull.workers import chunked, ordered_map

    desc = tokenizer.describe()
    _WORKER.update(tokenizer=tokenizer, opts=opts)  # the in-process path (workers <= 1)
    results = ordered_map(_work_chunk, chunked(records, chunk_size), workers=workers,
                          initializer=_init_worker, initargs=(desc["type"], desc["model"], opts))
    for samples, part in results:
        _merge(stats, part)
        if progress is not None:
            progress.update(part.read)
        yield from samples


def preprocess(records: Iterable[tuple[str, Any]], output_prefix: str,
               tokenizer: SFTTokenizer, *, seq_length: int, overlong: str = "error",
               skip_empty: bool = False, input_format: Optional[str] = None,
               loss_on: str = "assistant", workers: int = 1, progress: Any = None,
               extra_meta: Optional[dict[str, Any]] = None) -> PreprocessStats:
    """Records -> dataset files in one call (:func:`parallel_samples` + :func:`write_dataset`).

    Returns:
        The final counts (also stored in ``<prefix>.json``).
    """
    stats = PreprocessStats()
    opts = SampleOptions(seq_length=seq_length, overlong=overlong, skip_empty=skip_empty,
                         input_format=input_format, loss_on=loss_on)
    samples = parallel_samples(records, tokenizer, opts, stats, workers=workers,
                               progress=progress)
    write_dataset(samples, output_prefix, tokenizer, seq_length=seq_length, stats=stats,
                  extra_meta=extra_meta)
    if progress is not None:
        progress.finish()
    return stats


def build_parser() -> argparse.ArgumentParser:
    """Parser of ``tools/preprocess_sft.py`` (Megatron flag names)."""
    from megatron.skrull.errors import OneLineParser

    p = OneLineParser(
        prog="preprocess_sft.py",
        description="Tokenize chat JSONL (or the built-in synthetic corpus) into Megatron "
                    "indexed datasets: <prefix>.bin/.idx tokens, <prefix>_lossmask.bin/.idx "
                    "loss mask, <prefix>.json metadata.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", metavar="PATH",
                     help="chat data: .jsonl, .json (a list), .jsonl.gz, .parquet, .arrow, or "
                          "a datasets save_to_disk / hub cache directory; several are "
                          "concatenated in order (docs/data.md)")
    src.add_argument("--synthetic", type=int, metavar="N",
                     help="generate N records of the built-in learnable corpus instead")
    p.add_argument("--output-prefix", required=True, help="path prefix of the output files")
    p.add_argument("--tokenizer-type", default=DEFAULT_TOKENIZER_TYPE, choices=TOKENIZER_TYPES)
    p.add_argument("--tokenizer-model", default=None,
                   help="Hugging Face tokenizer directory or tokenizer.json (HFTokenizer only)")
    p.add_argument("--seq-length", type=int, default=16384,
                   help="most training positions per sample (stored tokens - 1)")
    p.add_argument("--overlong", choices=OVERLONG_POLICIES, default="error",
                   help="what to do with samples longer than --seq-length")
    p.add_argument("--skip-empty", action="store_true",
                   help="count and skip samples with no assistant tokens instead of failing")
    p.add_argument("--input-format", choices=INPUT_FORMATS, default=None,
                   help="format of every record (default: detected per record from its keys)")
    p.add_argument("--input-split", default="train",
                   help="split read from a dataset directory that holds several")
    p.add_argument("--sft-loss-on", choices=LOSS_ON, default="assistant",
                   help="tokens trained: every assistant reply (default), only the last one, "
                        "or all tokens (prompt too)")
    p.add_argument("--workers", type=int, default=1,
                   help="tokenizing processes (output identical for any number)")
    p.add_argument("--log-interval", type=int, default=10000,
                   help="records between progress lines on stderr (0: none)")
    p.add_argument("--seed", type=int, default=1234, help="seed of --synthetic")
    p.add_argument("--synthetic-max-tokens", type=int, default=None,
                   help="longest synthetic sample in byte-level tokens "
                        "(default: --seq-length + 1)")
    p.add_argument("--save-jsonl", default=None, metavar="PATH",
                   help="with --synthetic: also write the generated records as JSONL")
    return p


def _synthetic_records(args: argparse.Namespace) -> tuple[list[tuple[str, Any]], dict]:
    max_tokens = args.synthetic_max_tokens or args.seq_length + 1
    config = CorpusConfig(num_samples=args.synthetic, seed=args.seed, max_tokens=max_tokens)
    records = list(generate_records(config))
    if args.save_jsonl:
        with open(args.save_jsonl, "w") as fh:
            for rec in records:
                fh.write(json.dumps(rec) + "\n")
    meta = {"synthetic": dataclasses.asdict(config)}
    return [(f"synthetic:{i}", rec) for i, rec in enumerate(records)], meta


def _records(args: argparse.Namespace):
    """``(records, metadata, fraction read)`` of ``--synthetic`` or ``--input``."""
    if args.synthetic is not None:
        records, extra = _synthetic_records(args)
        it = iter(records)
        extra["sft_loss_on"] = args.sft_loss_on
        return it, extra, lambda: 1 - it.__length_hint__() / len(records)
    reader = RecordReader(args.input, args.input_split)
    paths = [os.path.abspath(p) for p in args.input]
    extra = {"source": paths[0] if len(paths) == 1 else paths, "sft_loss_on": args.sft_loss_on}
    return iter(reader), extra, reader.fraction


def check_args(args: argparse.Namespace) -> None:
    """Every check that needs no tokenizer, torch or Megatron import (fast errors).

    Raises:
        ValueError: The first bad flag, with the fix.
    """
    if args.synthetic is not None and args.synthetic < 1:
        raise ValueError(f"--synthetic must be >= 1, got {args.synthetic}")
    for flag, value in (("--seq-length", args.seq_length),
                        ("--synthetic-max-tokens", args.synthetic_max_tokens)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.save_jsonl and args.synthetic is None:
        raise ValueError("--save-jsonl only applies to --synthetic")
    for path in args.input or ():
        if not os.path.exists(path):
            raise ValueError(f"--input {path!r} does not exist")
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    if args.log_interval < 0:
        raise ValueError(f"--log-interval must be >= 0, got {args.log_interval}")
    if args.tokenizer_model and not os.path.exists(args.tokenizer_model):
        raise ValueError(f"--tokenizer-model {args.tokenizer_model!r} does not exist; pass a "
                         "Hugging Face tokenizer directory or tokenizer.json")
    prefix = args.output_prefix
    parent = os.path.dirname(os.path.abspath(prefix)) if prefix else ""
    if not prefix or prefix.endswith(os.sep) or os.path.isdir(prefix):
        raise ValueError(f"--output-prefix {prefix!r} must be a file prefix such as "
                         "data/chat (the tool writes data/chat.bin, .idx, .json ...)")
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise ValueError(f"--output-prefix {prefix!r}: {parent} is a file, not a directory")


def _stop_on_sigterm() -> None:
    # SIGTERM's default kills without running `finally`, leaving *.tmpPID files behind;
    # as SystemExit the cleanup in write_dataset runs.
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def main(argv: Optional[list[str]] = None) -> int:
    """CLI entry point; returns the exit status.

    Bad input: one ``preprocess_sft.py: error:`` line, status 2, checked before the
    tokenizer, torch or Megatron is imported.  Output that cannot be written (full disk):
    one line, status 1, no temporary file left and no earlier dataset replaced.
    """
    from megatron.skrull import errors
    from megatron.skrull.workers import Progress

    argv, debug = errors.take_debug_flag(argv)
    errors.filter_dependency_warnings()
    args = build_parser().parse_args(argv)
    prog = "preprocess_sft.py"
    try:
        check_args(args)
        _stop_on_sigterm()
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
        records, extra, fraction = _records(args)
        progress = Progress(fraction, args.log_interval, prog=prog)
        stats = preprocess(records, args.output_prefix, tokenizer, seq_length=args.seq_length,
                           overlong=args.overlong, skip_empty=args.skip_empty,
                           input_format=args.input_format, loss_on=args.sft_loss_on,
                           workers=args.workers, progress=progress, extra_meta=extra)
    except WriteError as exc:
        if debug:
            raise
        return errors.report([str(exc)], prog=prog, rank=0, code=errors.EXIT_FAILURE)
    except (ValueError, OSError) as exc:  # InputError is a ValueError
        if debug:
            raise
        return errors.report([str(exc)], prog=prog, rank=0)
    print(f"wrote {args.output_prefix}: {stats.summary()}")
    return 0
