#!/usr/bin/env python
"""Build chat JSONL for tools/preprocess_sft.py from ShareGPT conversations and long documents.

ShareGPT records (``{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}]}``,
a JSON list or JSONL) become ``{"messages": [{"role", "content"}]}``; conversations that do not
alternate user/assistant or have no assistant reply are skipped.  Each long document (e.g. the
reStructuredText sources of the Python documentation) becomes a two-turn record: a user request
naming the file and the document as the reply, giving the length mix its long tail.

Example (what examples/sft_smollm2.sh runs)::

    python tools/build_chat_jsonl.py --output data/chat.jsonl \\
        --sharegpt .../fastchat/data/dummy_conversation.json --max-conversations 400 \\
        --documents '/usr/share/doc/python3.11/html/_sources/library/*.rst.txt' \\
        --max-documents 6 --min-document-chars 20000 --max-document-chars 60000
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import Iterator, Optional

ROLE = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
        "system": "system"}


def sharegpt_records(path: str) -> Iterator[dict]:
    """``{"messages": ...}`` per usable ShareGPT conversation of ``path``."""
    with open(path) as fh:
        text = fh.read()
    items = json.loads(text) if text.lstrip().startswith("[") else [
        json.loads(line) for line in text.splitlines() if line.strip()]
    for item in items:
        turns = item.get("conversations") or item.get("messages") or []
        messages = []
        for turn in turns:
            role = ROLE.get(turn.get("from", turn.get("role")))
            content = turn.get("value", turn.get("content"))
            if role is None or not isinstance(content, str):
                break
            messages.append({"role": role, "content": content})
        else:
            roles = [m["role"] for m in messages if m["role"] != "system"]
            alternating = all(r == ("user", "assistant")[i % 2] for i, r in enumerate(roles))
            if roles and alternating and "assistant" in roles:
                yield {"messages": messages}


def document_records(pattern: str, limit: int, min_chars: int, max_chars: int) -> Iterator[dict]:
    """Two-turn records whose reply is a whole document, the longest first up to ``limit``."""
    sized = [(os.path.getsize(p), p) for p in glob.glob(pattern)]
    picked = sorted([(s, p) for s, p in sized if min_chars <= s <= max_chars], reverse=True)
    for _, path in picked[:limit]:
        with open(path, encoding="utf-8", errors="replace") as fh:
            body = fh.read()
        name = os.path.basename(path)
        yield {"messages": [
            {"role": "user", "content": f"Write the reStructuredText source of {name}."},
            {"role": "assistant", "content": body}]}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True)
    p.add_argument("--sharegpt", required=True, help="ShareGPT JSON or JSONL file")
    p.add_argument("--max-conversations", type=int, default=None)
    p.add_argument("--documents", help="glob of long text files (one record each)")
    p.add_argument("--max-documents", type=int, default=4)
    p.add_argument("--min-document-chars", type=int, default=10000)
    p.add_argument("--max-document-chars", type=int, default=60000)
    args = p.parse_args(argv)
    try:
        records = list(sharegpt_records(args.sharegpt))[:args.max_conversations]
        if not records:
            raise ValueError(f"{args.sharegpt}: no usable ShareGPT conversation")
        docs = list(document_records(args.documents, args.max_documents,
                                     args.min_document_chars, args.max_document_chars)
                    ) if args.documents else []
        with open(args.output, "w") as fh:
            for rec in records + docs:
                fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
    except (ValueError, OSError) as exc:
        print(f"build_chat_jsonl.py: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {len(records)} conversations, {len(docs)} documents")
    return 0


if __name__ == "__main__":
    sys.exit(main())
