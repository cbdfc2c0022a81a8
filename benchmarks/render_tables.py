"""Writes the current result tables into the docs from ``benchmarks/results/*.json``.

Every page block between ``<!-- table:NAME -->`` and ``<!-- /table -->`` in README.md and
docs/*.md is replaced by the table ``NAME`` renders from the recorded runs (see
``benchmarks/results_io.py``): the *current* table is the newest run on a quiet machine
(``meta.quiet``, else a 1-minute load average at the start of at most half the CPUs), the
``*-history`` tables list every run, oldest first, each linked to its file.

    python benchmarks/render_tables.py            # rewrite the blocks
    python benchmarks/render_tables.py --check    # exit 1 naming each stale block

Only results tracked by git are read when the checkout is a git repository, so a local
benchmark run does not change the docs until its file is committed.
"""
from __future__ import annotations

import argparse
import glob
import importlib
import os
import re
import subprocess
import sys
from typing import Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_io  # noqa: E402

ROOT = results_io.ROOT
BLOCK = re.compile(r"(<!-- table:([\w-]+) -->\n)(.*?)(<!-- /table -->)", re.S)
PAGES = ["README.md", *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]


# ---- reading -------------------------------------------------------------------------

def _tracked() -> Optional[set]:
    try:
        out = subprocess.run(["git", "ls-files", "--", "benchmarks/results"], cwd=ROOT,
                             capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return set(out.stdout.split()) if out.returncode == 0 else None


def _order(run: dict):
    meta = run["meta"]
    number = re.match(r"\d+", str(meta.get("run", "")))
    return (str(meta.get("date_utc", ""))[:10], int(number.group()) if number else 0,
            str(meta.get("run", "")), str(meta.get("date_utc", "")), run["file"])


def runs(name: str) -> list[dict]:
    """Every recorded run of benchmark ``name``, oldest first; each with ``file``."""
    tracked = _tracked()
    out = []
    for path in glob.glob(os.path.join(results_io.RESULTS_DIR, f"{name}-2*.json")):
        rel = os.path.relpath(path, ROOT)
        if tracked is not None and rel not in tracked:
            continue
        run = results_io.load(path)
        run["file"] = rel
        out.append(run)
    return sorted(out, key=_order)


def quiet(meta: dict) -> bool:
    """Recorded as quiet, or a 1-minute load at the start of at most half the CPUs."""
    if meta.get("quiet") is not None:
        return bool(meta["quiet"])
    start = (meta.get("load_average") or {}).get("start") or []
    return bool(start) and start[0] <= max(1, (meta.get("cpus") or 2) / 2)


def current(name: str, keep: Callable[[dict], bool] = lambda run: True) -> Optional[dict]:
    """The newest quiet run of ``name`` that ``keep`` accepts (else the newest one)."""
    candidates = [r for r in runs(name) if keep(r)]
    calm = [r for r in candidates if quiet(r["meta"])]
    return (calm or candidates or [None])[-1]


# ---- formatting ----------------------------------------------------------------------

def num(value, digits: Optional[int] = None) -> str:
    """A number, a ``[lo, hi]`` range over runs or ``{"runs": [...]}``; ``-`` if absent."""
    if value is None:
        return "-"
    if isinstance(value, list):
        return "-".join(dict.fromkeys(num(v, digits) for v in value))
    if isinstance(value, dict):
        return " / ".join(num(v, digits) for v in value.get("runs", []))
    if digits is None:
        size = abs(value)
        digits = 0 if isinstance(value, int) else 2 if size < 1 else 1 if size < 100 else 0
    return f"{value:,.{digits}f}"


def pct(value) -> str:
    if isinstance(value, list):
        return "-".join(dict.fromkeys(pct(v) for v in value))
    return "-" if value is None else f"{100 * value:.1f}%"


def load_text(meta: dict) -> str:
    load = meta.get("load_average") or {}
    if load.get("text"):
        return load["text"]
    if load.get("range"):
        return num(load["range"], 1)
    parts = [num(load[k][0], 1) for k in ("start", "end") if load.get(k)]
    return " -> ".join(parts) or "not recorded"


def commit_text(meta: dict) -> str:
    commit = str(meta.get("commit", "")).split(";")[0]
    return commit[:7] if re.fullmatch(r"[0-9a-f]{40}", commit) else commit or "not recorded"


def link(run: dict, page: str, text: Optional[str] = None) -> str:
    rel = os.path.relpath(os.path.join(ROOT, run["file"]), os.path.dirname(page))
    return f"[{text or 'json'}]({rel})"


def source_line(run: dict, page: str, history: str) -> str:
    meta = run["meta"]
    return (f"_{str(meta.get('date_utc', ''))[:16].replace('T', ' ')} UTC, "
            f"{meta.get('machine', '')}, load {load_text(meta)}, commit {commit_text(meta)}; "
            f"{link(run, page, 'data')}, {history}._")


def table(head: list[str], rows: list[list[str]], align: Optional[str] = None) -> list[str]:
    align = align or "l" + "r" * (len(head) - 1)
    return ["| " + " | ".join(head) + " |",
            "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|",
            *("| " + " | ".join(r) + " |" for r in rows)]


def row_at(rows, k: int, bucket: int) -> dict:
    return next((r for r in rows if r.get("K") == k and r.get("bucket") == bucket), {})


def history_link(page: str, anchor: str) -> str:
    rel = os.path.relpath(os.path.join(ROOT, "docs", "benchmarks.md"), os.path.dirname(page))
    return f"[history]({rel}#{anchor})"


def flag(meta: dict, name: str, default: str) -> str:
    found = re.search(rf"{name} (\S+)", meta.get("command", ""))
    return found.group(1) if found else default


# ---- the tables ----------------------------------------------------------------------

def _timed_run(run: dict) -> bool:
    """A bench_scheduler run that timed the core and schedule() on several cases."""
    rows = run["rows"]
    return isinstance(rows, list) and len(rows) >= 4 and all(
        "schedule_ms" in r and "core_ms" in r for r in rows)


def _totals_run(run: dict) -> bool:
    """A bench_e2e_cpu run with every policy's total."""
    return all(p.get("total_s") for p in run["rows"]["policies"])


def per_setting(run: dict) -> bool:
    """A paper_table run with a row per setting."""
    return isinstance(run["rows"], list)


def scheduler_speed(page: str) -> list[str]:
    run = current("bench_scheduler", _timed_run)
    rows = []
    for r in run["rows"]:
        ratio = r.get("schedule_per_core") or r["schedule_ms"] / r["core_ms"]
        rows.append([f"{r['K']:,}", f"{r['bucket']:,}", num(r.get("micro_batches"), 0),
                     num(r.get("bound_ratio"), 3), num(r["core_ms"]),
                     f"**{num(r['schedule_ms'])}**", num(ratio, 2) + "x",
                     num(r.get("in_cpp_ms")), num(r.get("megatron_ms"))])
    head = ["K", "bucket", "micro-batches / DP rank", "makespan / bound", "core ms",
            "`schedule()` ms", "/ core", "in C++ ms", "Megatron `BalancedCPScheduler` ms"]
    return [source_line(run, page, history_link(page, "scheduling-latency")) +
            f" `--stat {run['meta'].get('stat', 'median')}`; ranges span the runs.", "",
            *table(head, rows)]


def scheduler_speed_history(page: str) -> list[str]:
    def cell(rows, k, bucket):
        r = row_at(rows, k, bucket)
        if "schedule_ms" in r:
            return num(r["schedule_ms"])
        return f"{num(r['core_cpu_ms'])} (core CPU)" if "core_cpu_ms" in r else "-"
    rows = [[str(run["meta"].get("date_utc", ""))[:16].replace("T", " "), load_text(run["meta"]),
             commit_text(run["meta"]), str(run["meta"].get("stat", "")),
             *(cell(run["rows"], k, b) for k, b in ((256, 26000), (65536, 26000), (65536, 2000))),
             link(run, page)]
            for run in runs("bench_scheduler") if isinstance(run["rows"], list)]
    head = ["date (UTC)", "load", "commit", "stat", "K 256 / 26,000 ms",
            "K 65,536 / 26,000 ms", "K 65,536 / 2,000 ms", "data"]
    return table(head, rows, "llllrrrl")


def _pass_range(p: dict) -> str:
    ratios = p.get("pass_ratios") or p.get("pass_ratio_range")
    return num([min(ratios), max(ratios)], 2) if ratios else "-"


def e2e_cpu(page: str) -> list[str]:
    run = current("bench_e2e_cpu", _totals_run)
    rows = [[p["policy"], num(p.get("median_iteration_ms"), 0), num(p.get("total_s"), 1),
             f"**{num(p.get('total_ratio'), 2)}**", _pass_range(p), pct(p.get("local_share")),
             num(p.get("predicted_ms"), 0)] for p in run["rows"]["policies"]]
    head = ["policy", "median iteration ms", "total s", "total / skrull's",
            "single passes / skrull's", "local tokens", "predicted ms"]
    meta = run["meta"]
    return [source_line(run, page, history_link(page, "end-to-end-training-on-cpu")) +
            f" `--repeats {flag(meta, '--repeats', '3')}`.", "", *table(head, rows)]


def e2e_cpu_history(page: str) -> list[str]:
    names = ["all-cp", "hybrid-cp", "kk", "sorted", "per-seq-cp"]
    rows = []
    for run in runs("bench_e2e_cpu"):
        meta, by = run["meta"], {p["policy"]: p for p in run["rows"]["policies"]}
        rows.append([str(meta.get("run", "")), str(meta.get("date_utc", ""))[:16].replace("T", " "),
                     load_text(meta), "yes" if quiet(meta) else "no",
                     flag(meta, "--repeats", "3"),
                     *(num(by[n].get("total_ratio"), 2) if n in by else "" for n in names),
                     link(run, page)])
    head = ["run", "date (UTC)", "load", "quiet", "repeats",
            *(f"{n} / skrull" for n in names), "data"]
    return table(head, rows, "rllll" + "r" * len(names) + "l")


def _online_rows(page: str, only_current: bool) -> list[str]:
    rows, every = [], runs("bench_online_cost_model")
    calm = [r for r in every if quiet(r["meta"])]
    for run in every:
        meta = run["meta"]
        if only_current and not (quiet(meta) and meta["command"] == calm[-1]["meta"]["command"]):
            continue
        by = {s["seed"]: s for s in run["rows"]}
        cells = []
        for seed in ("file", "cpu", "h100"):
            s = by.get(seed, {})
            cells += [pct(s.get("off")), f"**{pct(s['on'])}**" if s.get("on") is not None else "-"]
        rows.append([str(meta.get("run", "")), str(meta.get("date_utc", ""))[:16].replace("T", " "),
                     flag(meta, "--iters", "20"), load_text(meta), *cells, link(run, page)])
    head = ["run", "date (UTC)", "iterations", "load", "file off", "file on", "cpu off",
            "cpu on", "h100 off", "h100 on", "data"]
    return table(head, rows, "rlll" + "r" * 6 + "l")


def online_refit(page: str) -> list[str]:
    return [f"_The quiet runs of the newest command; {history_link(page, 'online-refit')} has "
            "every run._", "",
            *_online_rows(page, True)]


def online_refit_history(page: str) -> list[str]:
    return _online_rows(page, False)


PAPER_ANCHOR = "reproduction-of-the-papers-evaluation-benchmarkspaper_tablepy"
PAPER_POLICIES = ["per-seq-cp", "all-cp", "sorted", "hybrid-cp", "kk"]


def _means(run: dict) -> dict:
    """Skrull's mean speedup over each policy: as recorded, else over the settings."""
    rows, recorded = run["rows"], run["meta"].get("averages")
    if isinstance(rows, dict):
        recorded = rows["averages"]
    if recorded:
        return {p: recorded.get(f"all over {p}") for p in PAPER_POLICIES}
    return {p: sum(r["speedup"][p] for r in rows) / len(rows) for p in PAPER_POLICIES}


def paper_table(page: str) -> list[str]:
    run = current("paper_table", per_setting)
    rows = [[f"{r['model'].replace('qwen2.5-', '').upper()} {r['dataset']}",
             f"{r['dp']} x {r['cp']}", *(num(r["speedup"][p], 2) + "x" for p in PAPER_POLICIES),
             num(r["bound_ratio"], 2), pct(r["local_share"])] for r in run["rows"]]
    means = _means(run)
    rows.append(["**mean**", "", *(f"**{num(means[p], 2)}x**" for p in PAPER_POLICIES), "", ""])
    head = ["model, data", "DP x CP", *(f"over {p}" for p in PAPER_POLICIES), "Skrull / bound",
            "local"]
    return [source_line(run, page, history_link(page, "paper-settings-simulated")) +
            f" `--objective {run['meta'].get('objective', 'ring')}`.", "", *table(head, rows)]


def paper_table_history(page: str) -> list[str]:
    rows = []
    for run in runs("paper_table"):
        means = _means(run)
        rows.append([str(run["meta"].get("date_utc", ""))[:16].replace("T", " "),
                     str(run["meta"].get("objective", "")),
                     *(num(means[p], 2) + "x" if means[p] else "-" for p in PAPER_POLICIES),
                     link(run, page)])
    return table(["date (UTC)", "objective", *(f"over {p}" for p in PAPER_POLICIES), "data"],
                 rows, "ll" + "r" * len(PAPER_POLICIES) + "l")


def lookahead(page: str) -> list[str]:
    """``benchmarks/lookahead.py``'s per-model summary (N = 1's total over N's)."""
    run = current("lookahead")
    rows = []
    for r in run["rows"]["summary"]:
        p, s = r["predicted"], r["simulated"]
        rows.append([r["model"].replace("qwen2.5-", ""), str(r["n"]),
                     f"{num(p[0], 3)}x ({num(p[2], 3)})",
                     f"{num(s[0], 3)}x ({num(s[1], 3)}-{num(s[2], 3)})",
                     *(f"{num(a, 2)} -> {num(b, 2)}" for a, b in (
                         r["max_over_mean"], r["p90_over_mean"])),
                     f"{num(r['slowest'][0], 2)} ({num(r['slowest'][1], 2)})",
                     "{} -> {}".format(*(num(x, 2) for x in r["tokens_max_over_mean"])),
                     "{}/{}".format(*r["windows_grouped"]),
                     "{} ({})".format(*(num(x, 1) for x in r["judge_ms_per_iteration"])),
                     "{} ({})".format(*(num(x, 3) for x in r["judge_per_iteration_time"]))])
    head = ["model", "N", "predicted (best)", "simulated (worst-best)", "max/mean",
            "p90/mean", "slowest (worst)", "tokens max/mean", "windows regrouped",
            "judge ms/iter (max)", "judge/iteration (max)"]
    return [source_line(run, page, _doc(page, "benchmarks.md", "every-benchmark")), "",
            *table(head, rows, "ll" + "r" * 9)]


def _span(values) -> list:
    flat = [v for x in values for v in (x if isinstance(x, list) else
                                         x.get("runs", []) if isinstance(x, dict) else [x])]
    return [min(flat), max(flat)] if len(set(flat)) > 1 else flat[0]


def _doc(page: str, name: str, anchor: str) -> str:
    rel = os.path.relpath(os.path.join(ROOT, "docs", name), os.path.dirname(page))
    return f"[{name}]({rel}#{anchor})"


def _speed_row(page: str) -> Optional[list[str]]:
    run = current("bench_scheduler", _timed_run)
    big = [r for r in run["rows"] if r["K"] == 65536] if run else []
    if not big or not all("megatron_ms" in r for r in big):
        return None
    return ["planning one global batch (DP 4 x CP 8), `schedule()`",
            f"K = 256: **{num(row_at(run['rows'], 256, 26000).get('schedule_ms'))} ms**; "
            f"K = 65,536: **{num(_span(r['schedule_ms'] for r in big), 0)} ms** "
            f"(Megatron-Core's `BalancedCPScheduler`: "
            f"{num(_span(r['megatron_ms'] for r in big), 0)} ms)",
            _doc(page, "scheduler.md", "speed")]


def _quality_row(page: str) -> Optional[list[str]]:
    """Plan quality under the default ``ring`` objective: the runs of ``plan_quality.py``
    at the newest run's commit (bundled profiles, a lengths file), judged by the cost model,
    so the machine's load does not matter; the bound is each run and model's mean at
    GBS >= 256 (as docs/scheduler.md's table)."""
    ring = [r for r in runs("plan_quality")
            if r["meta"].get("objective") == "ring" and isinstance(r["rows"], list)]
    if not ring:
        return None
    commit = ring[-1]["meta"].get("commit")
    ring = [r for r in ring if r["meta"].get("commit") == commit]
    rows = [s for r in ring for s in r["rows"]]
    worst = min(min(s["worst_batch_ratio"].values()) for s in rows)
    means = []
    for run in ring:
        for model in sorted({s["model"] for s in run["rows"]}):
            big = [s["global_bound_ratio"] for s in run["rows"]
                   if s["model"] == model and s["gbs"] >= 256]
            means += [sum(big) / len(big)] if big else []

    def span(key: str) -> str:
        return "/".join(str(v) for v in sorted({s[key] for s in rows}))
    return [f"plan quality: {len(rows)} settings (CP {span('cp')}, GBS {span('gbs')}, "
            f"{span('model').replace('qwen2.5-', '')}), judged by the cost model",
            f"never slower than {', '.join(sorted(rows[0]['ratio']))} (worst ratio "
            f"**{worst:.4f}**); makespan / lower bound **{min(means):.3f}-{max(means):.3f}** "
            "(mean at GBS >= 256)",
            _doc(page, "scheduler.md", "plan-quality")]


def _paper_row(page: str) -> Optional[list[str]]:
    run = current("paper_table", per_setting)
    if not run:
        return None
    means = _means(run)
    return ["simulated iteration time, the paper's 6 settings (H100 preset)",
            f"Skrull faster than all-CP **{means['all-cp']:.2f}x**, KK {means['kk']:.2f}x, "
            f"per-sequence CP {means['per-seq-cp']:.2f}x (mean)",
            _doc(page, "planner.md", PAPER_ANCHOR)]


def _e2e_row(page: str) -> Optional[list[str]]:
    run = current("bench_e2e_cpu", _totals_run)
    if not run:
        return None
    others = [p["total_ratio"] for p in run["rows"]["policies"] if p["policy"] != "skrull"]
    meta = run["meta"]
    return [f"CPU training, 2 ranks, CP 2 ({flag(meta, '--iters', '8')} iterations x "
            f"{flag(meta, '--repeats', '3')} repeats)",
            f"every other policy's total / Skrull's: **{num(_span(others), 2)}x**",
            _doc(page, "scheduler.md", "end-to-end-training-on-cpu")]


def _online_row(page: str) -> Optional[list[str]]:
    calm = [r for r in runs("bench_online_cost_model") if quiet(r["meta"])]
    newest = [r for r in calm if r["meta"]["date_utc"] == calm[-1]["meta"]["date_utc"]]
    cpu = [s for r in newest for s in r["rows"] if s["seed"] == "cpu"]
    if not cpu:
        return None
    return ["online cost-model refit, seeded with the built-in `cpu` preset",
            f"median error {pct(_span([s['off'] for s in cpu]))} fixed -> "
            f"**{pct(_span([s['on'] for s in cpu]))}** refitted",
            _doc(page, "scheduler.md", "online-refit---skrull-online-cost-model")]


def headline(page: str) -> list[str]:
    """README's one small table: the newest quiet number of each headline benchmark."""
    rows = [row(page) for row in (_quality_row, _speed_row, _paper_row, _e2e_row, _online_row,
                                  _render_gpu().headline_row)]
    return table(["what", "result (newest run; timings: newest quiet run)", "details"],
                 [r for r in rows if r], "lll")


TABLES = {
    "scheduler-speed": scheduler_speed, "scheduler-speed-history": scheduler_speed_history,
    "e2e-cpu": e2e_cpu, "e2e-cpu-history": e2e_cpu_history,
    "online-refit": online_refit, "online-refit-history": online_refit_history,
    "paper-table": paper_table, "paper-table-history": paper_table_history,
    "lookahead": lookahead,
    "headline": headline,
}


def _sibling(name: str):
    """``benchmarks/<name>.py``, more tables: imported on use, not at the top, because it
    imports this module's helpers (and with this folder on ``sys.path`` again: a caller may
    have restored ``sys.path`` since this module was imported)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module(name)


def _render_gpu():
    """``benchmarks/render_gpu.py``, the GPU runs' tables."""
    return _sibling("render_gpu")


def all_tables() -> dict:
    """:data:`TABLES`, the GPU runs' tables and the launcher's (``render_training.py``)."""
    return {**TABLES, **_render_gpu().TABLES, **_sibling("render_training").TABLES}


def render_page(path: str) -> tuple[str, list[str]]:
    """The page's text with every block re-rendered, and the names of unknown blocks."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    unknown, tables = [], all_tables()

    def fill(match):
        name = match.group(2)
        if name not in tables:
            unknown.append(name)
            return match.group(0)
        return match.group(1) + "\n".join(tables[name](path)) + "\n" + match.group(4)

    return BLOCK.sub(fill, text), unknown


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="change nothing; exit 1 if a block is not what the results give")
    args = ap.parse_args(argv)
    stale = []
    for page in PAGES:
        path = os.path.join(ROOT, page)
        new, unknown = render_page(path)
        for name in unknown:
            print(f"error: {os.path.relpath(path, ROOT)}: unknown table '{name}' (known: "
                  f"{', '.join(all_tables())})", file=sys.stderr)
            return 2
        with open(path, encoding="utf-8") as f:
            old = f.read()
        if new != old:
            stale.append(os.path.relpath(path, ROOT))
            if not args.check:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(new)
    verb = "stale (run python benchmarks/render_tables.py)" if args.check else "rewritten"
    print(f"{verb}: {', '.join(stale)}" if stale else "tables up to date")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
