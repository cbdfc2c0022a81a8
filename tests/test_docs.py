"""The docs stay true: every command they show runs, every link resolves, every table is
current.

* Every command in a ``bash`` block of README.md and docs/*.md names an entry point that runs
  ``--help`` (each distinct one once, in this process), and every ``--flag`` it shows is in
  that help; ``bash`` scripts exist and pass ``bash -n``.
* Every relative link and ``#anchor`` (GitHub's heading ids) resolves; figures are small.
* The result tables are what ``benchmarks/render_tables.py`` draws from the committed results.
* README's test command is the one ``.ci/run`` runs.
"""
from __future__ import annotations

import contextlib
import functools
import glob
import importlib
import io
import os
import re
import runpy
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", *sorted(os.path.relpath(p, ROOT)
                              for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
LINKED = PAGES + ["benchmarks/results/README.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
# Programs a page may show that are not ours (nothing to check here).
EXTERNAL = {"pip", "git", "cd", "source", "export", "tensorboard", "nvidia-smi", "sbatch"}
SHELL_OPS = {"&&", "||", ";", "|"}
MAX_FIGURE_BYTES = 200 * 1024
# Benchmarks that pass the flags they do not know on to the launcher (parse_known_args).
FORWARD_TO_LAUNCHER = {"benchmarks/calibrate_gpu.py", "benchmarks/bench_gpu.py",
                       "benchmarks/bench_memory.py", "benchmarks/memory_breakdown.py",
                       "benchmarks/profile_step.py"}


def _read(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def shown_commands(text: str) -> list[list[str]]:
    """The commands of every ``bash`` block: continuations joined, comments dropped, split
    at ``&&``, ``;`` and pipes, leading ``VAR=value`` assignments dropped."""
    out = []
    for lang, body in FENCE.findall(text):
        if lang not in ("bash", "sh", "shell"):
            continue
        for line in re.sub(r"\\\n", " ", body).splitlines():
            tokens, cmd = shlex.split(line, comments=True), []
            for tok in tokens + [";"]:
                if tok in SHELL_OPS:
                    while cmd and re.fullmatch(r"[A-Za-z_]\w*=.*", cmd[0]):
                        cmd.pop(0)
                    if cmd:
                        out.append(cmd)
                    cmd = []
                else:
                    cmd.append(tok)
    return out


def _console_scripts() -> dict[str, str]:
    """pyproject.toml's ``[project.scripts]`` (read by hand: tomllib needs Python 3.11)."""
    section = _read("pyproject.toml").split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([^"]+)"', section, re.M))


def entry_point(cmd: list[str]):
    """``(kind, target, flags)``: kind ``module``, ``script``, ``console`` or ``bash``;
    ``None`` for an external program; flags are the ``--names`` after the target."""
    def flags(rest):
        return sorted({m for t in rest for m in re.findall(r"(?<![\w-])--[a-z][\w-]*", t)})

    prog = os.path.basename(cmd[0])
    if prog == "...":  # "... --flag value": more flags of the launcher shown above
        return "module", "megatron.skrull.pretrain_gpt", flags(cmd[1:])
    if prog == "bash":
        return "bash", cmd[1], []
    if "-m" in cmd:
        at = len(cmd) - 1 - cmd[::-1].index("-m")
        if cmd[at + 1] == "pytest":
            return None
        return "module", cmd[at + 1], flags(cmd[at + 2:])
    if re.fullmatch(r"python3?(\.\d+)?", prog):
        return "script", cmd[1], flags(cmd[2:])
    if prog in _console_scripts():
        return "console", prog, flags(cmd[1:])
    if prog in EXTERNAL:
        return None
    raise AssertionError(f"unknown program in a docs command: {' '.join(cmd)} (add it to "
                         "tests/test_docs.py's EXTERNAL if it is not ours)")


def _entries() -> dict[tuple[str, str], dict]:
    """Each distinct entry point: the flags the docs show with it and where."""
    found = {}
    for page in PAGES:
        for cmd in shown_commands(_read(page)):
            ep = entry_point(cmd)
            if ep is None:
                continue
            kind, target, flags = ep
            item = found.setdefault((kind, target), {"flags": set(), "pages": set()})
            item["flags"].update(flags)
            item["pages"].add(page)
    return found


ENTRIES = _entries()


@functools.lru_cache(maxsize=None)
def _help(kind: str, target: str) -> str:
    """``target --help`` run in this process; its output (fails on a non-zero exit)."""
    argv, path = sys.argv[:], list(sys.path)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                if kind == "module":  # its main(), as `python -m` runs it
                    sys.argv = [target, "--help"]
                    module = importlib.import_module(target)
                    if hasattr(module, "main"):
                        module.main()
                    else:
                        runpy.run_module(target, run_name="__main__", alter_sys=True)
                elif kind == "console":
                    sys.argv = [target, "--help"]
                    module, func = _console_scripts()[target].split(":")
                    getattr(importlib.import_module(module), func)()
                else:
                    script = os.path.join(ROOT, target)
                    sys.argv = [script, "--help"]
                    sys.path.insert(0, os.path.dirname(script))
                    runpy.run_path(script, run_name="__main__")
            except SystemExit as exc:
                assert exc.code in (0, None), \
                    f"{target} --help exited {exc.code}:\n{out.getvalue()}"
    finally:
        sys.argv[:], sys.path[:] = argv, path
    return out.getvalue()


@pytest.mark.parametrize("kind,target", sorted(ENTRIES), ids=lambda v: str(v))
def test_every_command_shown_runs_its_help(kind, target):
    item = ENTRIES[(kind, target)]
    where = ", ".join(sorted(item["pages"]))
    if kind == "bash":
        path = os.path.join(ROOT, target)
        assert os.path.isfile(path), f"{where}: {target} does not exist"
        proc = subprocess.run(["bash", "-n", path], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, f"{where}: {target}: {proc.stderr}"
        return
    if kind == "script":
        assert os.path.isfile(os.path.join(ROOT, target)), f"{where}: {target} does not exist"
    text = _help(kind, target)
    assert "usage" in text.lower(), f"{where}: {target} --help printed no usage:\n{text[:500]}"
    if target in FORWARD_TO_LAUNCHER:
        text += _help("module", "megatron.skrull.pretrain_gpt")
    missing = [f for f in sorted(item["flags"])
               if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text)]
    assert not missing, f"{where}: {target} has no {missing} (not in its --help)"


def test_commands_are_found():
    """The extraction sees the commands (guards the test above against finding nothing)."""
    assert ("module", "megatron.skrull.pretrain_gpt") in ENTRIES
    assert ("console", "skrull-plan") in ENTRIES
    assert ("bash", "examples/quickstart.sh") in ENTRIES
    cmds = shown_commands("```bash\nA=1 python x.py --a \\\n  --b  # c\nls | bash y.sh\n```\n")
    assert cmds == [["python", "x.py", "--a", "--b"], ["ls"], ["bash", "y.sh"]]


def slug(heading: str) -> str:
    """GitHub's id of a heading: link text kept, lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: str) -> set[str]:
    text, seen, out = FENCE.sub("", _read(page)), {}, set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: str) -> list[str]:
    text = FENCE.sub("", _read(page))
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)


@pytest.mark.parametrize("page", LINKED)
def test_every_relative_link_and_anchor_resolves(page):
    bad = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (os.path.normpath(os.path.join(os.path.dirname(page), path)) if path
                    else page)
        if not os.path.exists(os.path.join(ROOT, resolved)):
            bad.append(f"{target} (no {resolved})")
        elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
            bad.append(f"{target} (no heading #{anchor} in {resolved})")
        elif resolved.endswith(".png") and os.path.getsize(os.path.join(ROOT, resolved)) > \
                MAX_FIGURE_BYTES:
            bad.append(f"{target} (over {MAX_FIGURE_BYTES // 1024} KB)")
    assert not bad, f"{page}: " + "; ".join(bad)


def test_slugs_follow_github():
    assert slug("Online refit (`--skrull-online-cost-model`)") == \
        "online-refit---skrull-online-cost-model"
    assert slug("Reproduction of the paper's evaluation (`benchmarks/paper_table.py`)") == \
        "reproduction-of-the-papers-evaluation-benchmarkspaper_tablepy"


def test_result_tables_are_current():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import render_tables
    finally:
        sys.path.pop(0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = render_tables.main(["--check"])
    assert code == 0, out.getvalue()


def test_readme_and_architecture_map_every_docs_page():
    """A new docs page is findable: README's documentation map and docs/architecture.md's
    list of topic pages link every docs/*.md."""
    pages = {os.path.basename(p) for p in PAGES if p.startswith("docs")}
    readme = {os.path.basename(t) for t in links("README.md") if t.startswith("docs/")}
    arch = {t for t in links("docs/architecture.md") if "/" not in t and t.endswith(".md")}
    assert pages - readme == set(), f"README.md's map lacks {sorted(pages - readme)}"
    assert pages - arch - {"architecture.md"} == set(), \
        f"docs/architecture.md lacks {sorted(pages - arch - {'architecture.md'})}"


def test_readme_test_command_is_what_ci_runs():
    command = "bash scripts/install.sh && .venv/bin/python -m pytest -q"
    assert command in _read("README.md")
    assert command in _read(".ci/run").splitlines()
