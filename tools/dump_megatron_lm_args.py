"""Lists every argument of Megatron-LM's training parser, with its value kind.

    python tools/dump_megatron_lm_args.py CHECKOUT > megatron/skrull/megatron_lm_arguments.txt

Megatron-LM builds most of its parser from dataclasses (``ArgumentGroupFactory``), so the
names cannot be read from ``megatron/training/arguments.py``'s text: this script imports that
file from the given checkout and calls ``add_megatron_arguments`` on a fresh parser.  The
GPU-only packages its imports pull in (triton, Transformer Engine, apex, ...) are stood in
for by empty placeholder modules: building the parser only reads dataclass fields, never
calls them.  Run it with this repository's interpreter (torch installed); the checkout's
``megatron`` package shadows the installed Megatron-Core for this one process.

Output: a header naming the commit, then one ``--name<TAB>kind`` line per option string,
sorted, where kind is ``flag`` (no value) or ``int``/``float``/``str`` with an nargs suffix
(``+``, ``*``, a count) and ``{choice,...}`` when the values are restricted.  The launcher
registers the accepted/refused names with these kinds (``megatron/skrull/megatron_args.py``)
and ``tests/test_megatron_args.py`` checks that every name falls in exactly one kind.
"""
from __future__ import annotations

import argparse
import enum
import importlib.abc
import importlib.machinery
import os
import subprocess
import sys
import types

# Packages only GPU builds have; building the parser never calls into them.
_PLACEHOLDER_ROOTS = {"triton", "transformer_engine", "apex", "flash_attn", "modelopt",
                      "nvidia_resiliency_ext", "tensorstore", "zarr", "einops", "wandb", "nvtx",
                      "onelogger", "one_logger_utils"}


class _AnyMeta(type):
    def __getattr__(cls, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Any

    def __call__(cls, *args, **kwargs):  # decorators (``@triton.jit``) return the function
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else cls


class _Any(metaclass=_AnyMeta):
    """Stands for any attribute of a placeholder module (a class, a decorator, a value)."""


class _Placeholders(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in _PLACEHOLDER_ROOTS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__, module.__version__ = [], "99.0.0"

        def getattr_(attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _Any

        module.__getattr__ = getattr_
        return module

    def exec_module(self, module):
        pass


def kind(action: argparse.Action) -> str:
    """``flag`` or ``TYPE[NARGS][{CHOICES}]`` of one argparse action."""
    if action.nargs == 0:
        return "flag"
    name = getattr(action.type, "__name__", None)
    text = name if name in ("int", "float") else "str"
    if action.nargs not in (None, "?"):
        text += str(action.nargs)
    if action.choices:
        text += "{" + ",".join(c.name if isinstance(c, enum.Enum) else str(c)
                               for c in action.choices) + "}"
    return text


def megatron_parser(checkout: str) -> argparse.ArgumentParser:
    sys.path.insert(0, checkout)
    sys.meta_path.insert(0, _Placeholders())
    import typing

    if not hasattr(typing, "override"):  # Python < 3.12; Megatron-LM imports it
        import typing_extensions

        typing.override = typing_extensions.override
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    return parser


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkout", help="a Megatron-LM checkout (or export of one commit)")
    ap.add_argument("--commit", help="commit to name in the header (default: git rev-parse "
                    "HEAD in the checkout)")
    args = ap.parse_args(argv)
    commit = args.commit or subprocess.run(
        ["git", "-C", args.checkout, "rev-parse", "HEAD"], capture_output=True,
        text=True).stdout.strip() or "unknown"
    parser = megatron_parser(os.path.abspath(args.checkout))
    rows = sorted((opt, kind(a)) for a in parser._actions for opt in a.option_strings
                  if opt.startswith("--") and opt != "--help")
    print(f"# Megatron-LM {commit}: megatron/training/arguments.py add_megatron_arguments()")
    print("# --name<TAB>kind: flag | int/float/str [nargs] [{choices}]; "
          "tools/dump_megatron_lm_args.py wrote it")
    for opt, k in rows:
        print(f"{opt}\t{k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
