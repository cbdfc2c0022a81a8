"""The launcher's measured tables for ``benchmarks/render_tables.py``: docs/costmodel.md
(the ``cpu`` preset's fit and validation, the memory model against the real tensors, the
256-wide model's end-to-end run with its time split), docs/parallelism.md (pipeline
parallelism, simulated) and their histories in docs/benchmarks.md.

Each table draws the newest quiet run of its benchmark (``render_tables.current``) among
the runs of the configuration the page describes (the calibration and validation per
``--model``; the end-to-end tables only the default 256-wide, 8-iteration run with a time
split, so the page's reading of it stays next to the numbers it reads).
"""
from __future__ import annotations

from typing import Optional

import render_tables as rt

MODEL_TEXT = {"h256": "`--model h256` (the `cpu` preset)",
              "h128": "`--model h128` (the CPU demo's model)"}


def _model(run: dict) -> str:
    return rt.flag(run["meta"], "--model", "h256")


def _per_model(name: str) -> list[dict]:
    """The newest quiet run of ``name`` per ``--model``, the default model first."""
    models = sorted({_model(r) for r in rt.runs(name)}, key=lambda m: (m != "h256", m))
    return [rt.current(name, lambda r, m=m: _model(r) == m) for m in models]


def _date(meta: dict) -> str:
    return str(meta.get("date_utc", ""))[:16].replace("T", " ")


def _history(page: str) -> str:
    return rt.history_link(page, "cost-model-and-memory-on-cpu")


# ---- the cpu preset's fit ------------------------------------------------------------

def _size(n: float) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def _secs(s: float) -> str:
    return f"{1e3 * s:.1f} ms" if s >= 1e-3 else f"{1e6 * s:.3g} us"


def _fit_cells(rows: dict) -> list[str]:
    p, comm = rows["preset"], rows.get("comm")

    def get(key, fmt):
        return fmt(p[key]) if p.get(key) is not None else "-"
    attention = p["peak_flops"] * p["attention_efficiency"] / 1e9
    errors = [f"{rt.num(e.get('mean_abs_pct'), 1)}% / "
              f"{rt.num(e.get('max_abs_pct'), 1) + '%' if 'max_abs_pct' in e else '-'}"
              for e in (rows["fit_error"].get(k, {}) for k in ("simulator", "scheduler"))]
    ring = rows.get("ring_latency_s")
    return [f"{p['peak_flops'] / 1e9:.1f} GFLOP/s",
            f"{attention:.1f} GFLOP/s, `S_half` = {p['attention_half_tokens']:.0f} tokens",
            get("attention_call_overhead_s", _secs), get("layer_overhead_s", _secs),
            get("step_overhead_s", _secs),
            (f"{_secs(comm['seconds'][0])} (<= {_size(comm['sizes_bytes'][0])}) ... "
             f"{_secs(comm['seconds'][-1])} ({_size(comm['sizes_bytes'][-1])})") if comm else "-",
            "-" if ring is None else "none fitted" if ring == 0 else _secs(ring),
            *errors, rt.num(rows.get("runs"))]


def cpu_calibration(page: str) -> list[str]:
    """``calibrate_training_cpu.py``: the fitted constants, one column per ``--model``."""
    fits = _per_model("calibrate_training_cpu")
    names = ["everything outside attention (matmuls, norms, RoPE, loss)",
             "attention (ATen CPU flash kernel, fwd + bwd)",
             "per document (kernel call) and layer",
             "per layer and micro-batch (mcore modules, autograd, Python)",
             "per iteration (optimizer, clipping, planning)",
             "gloo P2P message, ping-pong", "extra per ring message inside training",
             "fit error, simulator: mean / max", "fit error, scheduler's cost model: mean / max",
             "runs fitted"]
    columns = [_fit_cells(run["rows"]) for run in fits]
    rows = [[name, *(c[i] for c in columns)] for i, name in enumerate(names)]
    sources = "; ".join(f"`--model {_model(r)}`: {_date(r['meta'])}, load "
                        f"{rt.load_text(r['meta'])}, commit {rt.commit_text(r['meta'])}, "
                        f"{rt.link(r, page, 'data')}" for r in fits)
    head = ["constant", *(MODEL_TEXT.get(_model(r), f"`--model {_model(r)}`") for r in fits)]
    return [f"_{sources}; {_history(page)}._", "", *rt.table(head, rows, "l" + "l" * len(fits))]


# ---- the preset against held-out iterations ------------------------------------------

def _summary_text(summary: dict) -> str:
    names = {"scheduler": "the scheduler's cost model", "simulator": "the simulator",
             "preset": "the preset"}
    parts = []
    for key, s in summary.items():
        extra = [f"{k} {rt.num(s[f'{k}_abs_pct'], 1)}%" for k in ("median", "max")
                 if s.get(f"{k}_abs_pct") is not None]
        parts.append(f"{rt.num(s['mean_abs_pct'], 1)}%" + (f" ({', '.join(extra)})" if extra
                                                           else "") + f" for {names.get(key, key)}")
    return "mean abs. error " + ", ".join(parts)


def cpu_validation(page: str) -> list[str]:
    """``validate_training_cpu.py``: every plan of the default model, then each model's
    summary."""
    runs = _per_model("validate_training_cpu")
    main = next(r for r in runs if "cases" in r["rows"])
    rows = []
    for c in main["rows"]["cases"]:
        m = c["measured_ms"]
        rows.append([str(c["seed"]), str(c["global_batch"]), c["policy"], str(c["tokens"]),
                     str(c["max_length"]), str(c["micro_batches"]),
                     f"{100 * c['local_share']:.0f}%", f"{m:.0f} ms",
                     f"{c['scheduler_ms']:.0f} ms", f"{100 * (c['scheduler_ms'] - m) / m:+.0f}%",
                     f"{c['simulator_ms']:.0f} ms", f"{100 * (c['simulator_ms'] - m) / m:+.0f}%"])
    head = ["seed", "gb", "policy", "tokens", "max len", "micro-batches", "local", "measured",
            "scheduler", "err", "simulator", "err"]
    lines = [rt.source_line(main, page, _history(page)) + f" {MODEL_TEXT['h256']}.", "",
             *rt.table(head, rows, "rrlrrrrrrrrr"), ""]
    for run in runs:
        lines.append(f"- {MODEL_TEXT.get(_model(run), _model(run))}: "
                     f"{_summary_text(run['rows']['summary'])} "
                     f"({_date(run['meta'])}, {rt.link(run, page, 'data')}).")
    return lines


# ---- memory: the memory model against the launcher's tensors -------------------------

MEMORY_LABELS = {"fp32, DP 2 + distributed optimizer":
                 "fp32, DP 2 + `--use-distributed-optimizer`",
                 "bf16, DP 2 + distributed optimizer":
                 "`--bf16`, DP 2 + `--use-distributed-optimizer`",
                 "fp32 + full recompute":
                 "fp32 + `--recompute-granularity full` (uniform, 1 layer)",
                 "fp32 + selective recompute": "fp32 + `--recompute-granularity selective`",
                 "fp32, TP 2 + sequence parallel": "fp32, TP 2 + `--sequence-parallel`"}
MEMORY_PARTS = ("params", "grads", "main_params", "optimizer_state", "activation_bytes_per_token")


def cpu_memory(page: str) -> list[str]:
    """``bench_memory.py`` (CPU): KiB per rank measured / predicted per setting."""
    run = rt.current("bench_memory")
    rows = [[MEMORY_LABELS.get(name, name),
             *(f"{r['measured'][k] / 1024:.1f} / {r['predicted'][k] / 1024:.1f}"
               for k in MEMORY_PARTS)] for name, r in run["rows"].items()]
    head = ["setting", "params", "grads", "main params", "optimizer state",
            "peak activations per token"]
    return [rt.source_line(run, page, _history(page)) + " KiB per rank, measured / predicted.",
            "", *rt.table(head, rows, "l" * 6)]


def _memory_errors(rows: dict) -> str:
    static = max(abs(sum(r["measured"][k] for k in MEMORY_PARTS[:4]) /
                     sum(r["predicted"][k] for k in MEMORY_PARTS[:4]) - 1) for r in rows.values())
    act = max(abs(r["measured"][MEMORY_PARTS[4]] / r["predicted"][MEMORY_PARTS[4]] - 1)
              for r in rows.values())
    return (f"{len(rows)} settings: static memory within {100 * static:.1f}%, activations "
            f"per token within {100 * act:.1f}%")


def cost_model_cpu_history(page: str) -> list[str]:
    """Every calibration, validation and CPU memory run, oldest first."""
    out = []
    for name in ("calibrate_training_cpu", "validate_training_cpu", "bench_memory"):
        for run in rt.runs(name):
            rows = run["rows"]
            if name == "bench_memory":
                result = _memory_errors(rows)
            elif name == "calibrate_training_cpu":
                result = "fit " + _summary_text(rows["fit_error"])
            else:
                result = _summary_text(rows.get("summary", rows))
            out.append((_date(run["meta"]), [_date(run["meta"]), f"`{name}`",
                                             f"`{_model(run)}`" if name != "bench_memory"
                                             else "", result, rt.link(run, page)]))
    return rt.table(["date (UTC)", "benchmark", "model", "result", "data"],
                    [r for _, r in sorted(out, key=lambda x: x[0])], "lllll")


# ---- the 256-wide model end to end (bench_e2e_cpu.py's defaults) ----------------------

def _h256_run(run: dict) -> bool:
    meta = run["meta"]
    return (_model(run) == "h256" and rt.flag(meta, "--iters", "8") == "8" and
            all(p.get("split_s") and p.get("total_s") for p in run["rows"]["policies"]))


def _e2e() -> Optional[dict]:
    return rt.current("bench_e2e_cpu", _h256_run)


def e2e_cpu_h256(page: str) -> list[str]:
    run = _e2e()
    pols = run["rows"]["policies"]
    ref = pols[0]
    rows = [[p["policy"], f"{p['median_iteration_ms']:,.0f} ms",
             f"{p['median_iteration_ms'] / ref['median_iteration_ms']:.2f}x",
             f"{p['total_s']:.1f} s", f"**{p['total_ratio']:.2f}x**", rt.pct(p.get("local_share")),
             rt.num(p.get("micro_batches"), 1), f"{rt.num(p.get('predicted_ms'), 0)} ms"]
            for p in pols]
    head = ["policy", "median iteration", f"vs {ref['policy']}", "total", f"vs {ref['policy']}",
            "tokens local", "micro-batches", "predicted (median)"]
    hist = rt.history_link(page, "end-to-end-training-on-cpu")
    return [rt.source_line(run, page, hist) + f" `{run['meta']['command']}`.", "",
            *rt.table(head, rows)]


SPLIT = (("attention local", ("attn_local",)), ("attention ring", ("attn_ring",)),
         ("ring wait", ("ring_wait",)), ("ring other", ("ring_other",)),
         ("linear layers", ("linear",)), ("model other", ("model_other",)),
         ("data + grads + optimizer", ("data", "grad_allreduce", "optimizer")))


def e2e_cpu_h256_split(page: str) -> list[str]:
    """The time split of :func:`e2e_cpu_h256`'s run, seconds summed over its iterations."""
    rows = []
    for p in _e2e()["rows"]["policies"]:
        split = p["split_s"]
        cells = [split.get("data_grads_optimizer") if keys[0] == "data" and
                 "data_grads_optimizer" in split else sum(split.get(k, 0.0) for k in keys)
                 for _, keys in SPLIT]
        total = split.get("total", sum(v for k, v in split.items() if k != "total"))
        rows.append([p["policy"], *(f"{v:.2f}" for v in cells), f"{total:.2f}"])
    return rt.table(["policy", *(name for name, _ in SPLIT), "total"], rows)


def e2e_cpu_h256_batches(page: str) -> list[str]:
    """Per batch: each policy's measured ms (``-`` where the run did not record it)."""
    run = _e2e()
    policies = [p["policy"] for p in run["rows"]["policies"]]
    rows = []
    for it in run["rows"]["iterations"]:
        label = f"iteration {it['iter']}" if it.get("iter") is not None else it.get("group", "")
        rows.append([label, rt.num(it.get("longest")),
                     *(rt.num(it[p][0], 0) if it.get(p) else "-" for p in policies)])
    return rt.table(["batch", "longest", *(f"{p} ms" for p in policies)], rows)


# ---- pipeline parallelism, simulated (pp_table.py) -----------------------------------

def _speedup(r: dict) -> float:
    return r.get("speedup") or r["all-cp_best"] / r["skrull_best"]


def pp_table(page: str) -> list[str]:
    """The newest run: a simulation, so the machine's load does not matter."""
    run = rt.runs("pp_table")[-1]
    rows = [[r["profile"], str(r["pp"]), str(r["dp"]), str(r["bucket"]),
             f"{r['skrull_plan_order']:.2f}", f"{r['skrull_best']:.2f}",
             f"{r['all-cp_best']:.2f}", f"{_speedup(r):.2f}x", f"{r['skrull_mbs']:.1f}",
             f"{100 * r['skrull_bubble']:.1f}%", f"{r['skrull_tuned']:.2f} ({r['tuned_bucket']})"]
            for r in run["rows"]]
    head = ["profile", "PP", "DP", "bucket", "skrull s (plan order)", "skrull s (best order)",
            "all-cp s (best order)", "skrull speedup", "micro-batches", "bubble",
            "skrull s, best bucket (bucket)"]
    return [rt.source_line(run, page, rt.history_link(page, "pipeline-simulated")), "",
            *rt.table(head, rows)]


def pp_table_history(page: str) -> list[str]:
    profiles = sorted({r["profile"] for run in rt.runs("pp_table") for r in run["rows"]})
    rows = []
    for run in rt.runs("pp_table"):
        by = {(r["profile"], r["pp"]): r for r in run["rows"]}
        pps = sorted({r["pp"] for r in run["rows"]})
        first = run["rows"][0]["profile"]
        rows.append([_date(run["meta"]), rt.commit_text(run["meta"]),
                     " / ".join(str(by[(first, p)]["bucket"]) for p in pps),
                     *(" / ".join(f"{_speedup(by[(name, p)]):.2f}" for p in pps
                                  if (name, p) in by) for name in profiles),
                     rt.link(run, page)])
    head = ["date (UTC)", "commit", "bucket at PP 1 / 2 / 4",
            *(f"{name}: skrull speedup" for name in profiles), "data"]
    return rt.table(head, rows, "lll" + "r" * len(profiles) + "l")


TABLES = {"cpu-calibration": cpu_calibration, "cpu-validation": cpu_validation,
          "cpu-memory": cpu_memory, "cost-model-cpu-history": cost_model_cpu_history,
          "e2e-cpu-h256": e2e_cpu_h256, "e2e-cpu-h256-split": e2e_cpu_h256_split,
          "e2e-cpu-h256-batches": e2e_cpu_h256_batches,
          "pp-table": pp_table, "pp-table-history": pp_table_history}
