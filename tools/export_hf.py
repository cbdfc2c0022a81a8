#!/usr/bin/env python
"""Export a Skrull-Megatron training checkpoint as a Hugging Face model directory.

Example::

    python tools/export_hf.py --load runs/sft/ckpt --output runs/sft/hf
    python -c "from transformers import AutoModelForCausalLM as M; M.from_pretrained('runs/sft/hf')"

See docs/models.md.
"""
import os
import sys

# Run from a checkout without installing: put the repository root first on the path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.skrull.hf.export import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
