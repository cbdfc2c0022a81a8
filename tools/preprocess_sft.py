#!/usr/bin/env python
"""Preprocess chat data (or the built-in synthetic corpus) for Skrull SFT training.

Reads OpenAI messages (tool calls too), ShareGPT, Alpaca and prompt/response records from
JSONL, JSON, gzip, Parquet, Arrow and ``datasets`` folders; ``--workers N`` for speed.

Example::

    python tools/preprocess_sft.py --synthetic 2000 --seed 1 --seq-length 16384 \\
        --output-prefix data/synth
    python tools/preprocess_sft.py --input chat.jsonl --output-prefix data/chat \\
        --tokenizer-type HFTokenizer --tokenizer-model tokenizer.json --seq-length 8192 \\
        --overlong truncate
    python tools/preprocess_sft.py --input sharegpt.json alpaca.parquet --workers 8 \\
        --output-prefix data/mix --tokenizer-type HFTokenizer --tokenizer-model models/m

See docs/data.md for the output format.
"""
import os
import sys

# Run from a checkout without installing: put the repository root first on the path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.skrull.preprocess import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
