"""Writes docs/megatron_flags.md: every Megatron-LM flag, implemented / accepted / refused.

    python tools/megatron_flags_doc.py            # rewrite docs/megatron_flags.md
    python tools/megatron_flags_doc.py --check    # exit 1 when the page is not current

The page is generated from ``megatron/skrull/megatron_args.py`` (the tables) and the
launcher's parser (the implemented flags), so it cannot drift from what the launcher does.
"""
from __future__ import annotations

import argparse
import os
import sys

from megatron.skrull.flags import build_parser
from megatron.skrull.megatron_args import implemented_names, markdown

PAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                    "megatron_flags.md")


def current() -> str:
    """The page's text as the tables and the parser give it now."""
    return markdown(implemented_names(build_parser()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    args = ap.parse_args(argv)
    text = current()
    if args.check:
        ok = os.path.isfile(PAGE) and open(PAGE).read() == text
        if not ok:
            print(f"error: {PAGE} is not current; run python tools/megatron_flags_doc.py",
                  file=sys.stderr)
        return 0 if ok else 1
    with open(PAGE, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
