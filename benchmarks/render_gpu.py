"""The GPU runs' tables for ``benchmarks/render_tables.py`` (docs/gpu.md, docs/benchmarks.md
and README's headline row).

A GPU run leaves several files: ``gpu_check-*`` (``tools/check_gpu.py``'s sections, one
file per run, possibly a few sections only), ``calibrate_gpu-*``, ``bench_memory_cuda-*``,
``memory_breakdown_cuda-*``, ``profile_step-*`` and ``bench_gpu-*``.  Each table shows the
newest quiet result of its benchmark measured on a GPU (CPU runs of the same scripts, as the
tests make, are left out); the section table the newest result of every section, each row
linked to the run it comes from.
"""
from __future__ import annotations

from typing import Optional

import render_tables as rt


def _date(meta: dict) -> str:
    return str(meta.get("date_utc", ""))[:16].replace("T", " ")


def _gib(value) -> str:
    return f"{value / 2**30:.2f}"


def _on_gpu(run: dict) -> bool:
    """Measured on a GPU: the script's own environment record (else the meta) names no CPU."""
    rows, meta = run["rows"], run["meta"]
    env = {}
    if isinstance(rows, dict):
        models = list((rows.get("models") or {}).values())
        env = (rows.get("calibration") or rows.get("environment") or
               (models[0].get("environment") if models else None) or {})
    device = env.get("device") or meta.get("gpu") or meta.get("machine", "")
    return not str(device).startswith(("cpu", "x86_64", "aarch64", "arm64"))


def current(name: str, keep=lambda run: True) -> Optional[dict]:
    return rt.current(name, lambda run: _on_gpu(run) and keep(run))


def gpu_source_line(run: dict, page: str, history: str) -> str:
    meta, versions = run["meta"], run["meta"].get("versions", {})
    return (f"_{_date(meta)} UTC, {meta.get('machine', '')}, torch "
            f"{versions.get('torch', '?')}, CUDA {versions.get('cuda', '?')}, commit "
            f"{rt.commit_text(meta)}; {rt.link(run, page, 'data')}, {history}._")


def _history(page: str) -> str:
    return rt.history_link(page, "gpu-runs")


# ---- tools/check_gpu.py's sections ---------------------------------------------------

def _sci(value) -> str:
    return value if isinstance(value, str) else "-" if value is None else f"{value:.1e}"


def _parity_text(sec: dict) -> str:
    """Per kernel and dtype: the worst errors and how many cases passed (first error)."""
    groups: dict = {}
    for r in sec["rows"]:
        groups.setdefault((r["kernel"], r["dtype"]), []).append(r)
    parts = []
    for (kernel, dtype), rows in groups.items():
        worst = {}
        for key in ("out", "grad", "lse"):
            vals = [r[key] for r in rows if r.get(key) is not None]
            worst[key] = "NaN" if "NaN" in vals else max(vals) if vals else None
        errors = [r["error"] for r in rows if r.get("error")]
        numbers = ", ".join(f"{k if k != 'lse' else 'LSE'} {_sci(v)}" for k, v in worst.items()
                            if v is not None)
        parts.append(f"{kernel} {dtype}: {numbers or 'failed'} ({sum(r['ok'] for r in rows)}/"
                     f"{len(rows)} ok" + (f"; {errors[0]}" if errors else "") + ")")
    return "; ".join(parts)


def _train_text(sec: dict) -> str:
    loss, tok = sec["losses"], sec["tokens_per_s"]
    ratio = [p / m for p, m in zip(sec.get("predicted_ms", []), sec.get("iteration_ms", []))]
    return (f"auto -> {(sec['auto_kernel'] or ['?'])[0]}, loss {loss[0]:.2f} -> {loss[-1]:.2f} "
            f"in {len(loss)} iterations, {rt.num(min(tok) / 1e3, 0)}-"
            f"{rt.num(max(tok) / 1e3, 0)}K tokens/s" +
            (f"; predicted / measured iteration time by iteration "
             f"{', '.join(rt.num(r, 2) for r in ratio)} ({sec.get('cost_model', '')})"
             if ratio else ""))


def _recorded(sec: dict, page: str) -> str:
    """Links to the results files a hook section names (plain names if not committed)."""
    names = sec.get("recorded_as") or []
    names = [names] if isinstance(names, str) else names
    out = []
    for name in names:
        found = [r for r in rt.runs(name.split("-2")[0]) if r["file"].endswith(name)]
        out.append(rt.link(found[0], page, name) if found else f"`{name}`")
    return "numbers: " + (", ".join(out) or "?")


def _section_text(name: str, sec: dict, page: str) -> str:
    if sec.get("reason"):
        return sec["reason"]
    if name == "parity":
        return _parity_text(sec)
    if name == "kernel_time":
        return "fwd+bwd, 1K-32K documents: " + ", ".join(
            f"{r['kernel']} {r['shape'].split()[0]} {rt.num(r['fwd_ms'] + r['bwd_ms'], 1)} ms"
            for r in sec["rows"] if r.get("ok") and r.get("docs") == "1K-32K")
    if name == "cp_attention":
        w = sec["worst"]
        return (f"{sec['kernel']} over {sec['backend']}: max rel. error vs float64 "
                f"{_sci(w['vs_fp64'])}, vs one process {_sci(w['vs_one_process'])}; side-stream "
                f"order {'BAD' if sec['stream_order_problems'] else 'ok'}")
    if name == "cp_training":
        return (f"max rel. loss diff {_sci(sec['max_rel_diff'])} over {sec['backend']}, "
                f"{len(sec['losses']['cp1'])} iterations")
    if name == "train":
        return _train_text(sec)
    return _recorded(sec, page)


def newest_sections() -> list[tuple[str, dict, dict]]:
    """``(name, section, run)``: each section's newest result over the ``gpu_check`` runs; a
    run that did not run a section leaves the older result standing."""
    latest: dict = {}
    for run in rt.runs("gpu_check"):
        for name, sec in run["rows"].items():
            if sec.get("status") != "not run" or name not in latest:
                latest[name] = (sec, run)
    return [(name, *latest[name]) for name in latest]


def gpu_check(page: str) -> list[str]:
    found = newest_sections()
    if not found:
        return ["_Not yet measured._"]
    metas = [run["meta"] for _, _, run in found]
    where = "; ".join(dict.fromkeys(
        f"{m.get('machine', '')}, torch {m.get('versions', {}).get('torch', '?')}, CUDA "
        f"{m.get('versions', {}).get('cuda', '?')}" for m in metas))
    rows = [[name, sec["status"], rt.num(sec.get("seconds"), 1),
             _section_text(name, sec, page),
             rt.link(run, page, f"{_date(run['meta'])[5:]}, {rt.commit_text(run['meta'])}")]
            for name, sec, run in found]
    return [f"_The newest result of each section: {where}; {_history(page)}._", "",
            *rt.table(["section", "status", "s", "result", "run (UTC), commit"], rows, "llrll")]


def gpu_kernel_time(page: str) -> list[str]:
    run = rt.current("gpu_check", lambda r: "kernel_time" in r["rows"])
    if run is None:
        return ["_Not yet measured._"]
    rows = [[r["shape"], r["docs"], f"{r['tokens']:,}", r["kernel"], rt.num(r["fwd_ms"], 1),
             rt.num(r["bwd_ms"], 1), f"**{rt.num(r['fwd_ms'] + r['bwd_ms'], 1)}**",
             rt.num(r["tflops"], 0), rt.num(r["first_ms"], 0)]
            for r in run["rows"]["kernel_time"]["rows"] if r.get("ok")]
    head = ["heads (Q/KV x dim)", "documents", "tokens", "kernel", "fwd ms", "bwd ms",
            "fwd+bwd ms", "TFLOP/s", "first call ms"]
    return [gpu_source_line(run, page, _history(page)), "",
            *rt.table(head, rows, "llrlrrrrr")]


# ---- bench_gpu.py, calibrate_gpu.py, bench_memory.py, memory_breakdown.py, profile_step.py --

def _vs_transformers(res: dict) -> dict:
    """``variant -> tokens/s over the best transformers row`` of one model's rows."""
    done = [r for r in res.get("rows", []) if not r.get("skipped")]
    best = max((r["tokens_per_s"] for r in done if r["system"] == "transformers"), default=0)
    return {(r["system"], r["variant"]): r["tokens_per_s"] / best if best else None
            for r in done}


# A bench_gpu run whose `ours torch` rows timed fewer iterations is a smoke run: it goes to
# the history, while the table and README's row keep the newest run long enough to compare.
MIN_TABLE_ITERATIONS = 3


def _long_enough(run: dict) -> bool:
    return all(r.get("iterations", 0) >= MIN_TABLE_ITERATIONS
               for res in run["rows"]["models"].values() for r in res.get("rows", [])
               if (r["system"], r["variant"]) == ("ours", "torch") and not r.get("skipped"))


def gpu_throughput(page: str) -> list[str]:
    run = current("bench_gpu", _long_enough)
    if run is None:
        return ["_Not yet measured._"]
    rows, skipped = [], []
    for model, res in run["rows"]["models"].items():
        ratio = _vs_transformers(res)
        skipped += [f"{r['system']} {r['variant']}" for r in res.get("rows", [])
                    if r.get("skipped")]
        rows += [[model, r["system"], r["variant"], f"**{rt.num(r['tokens_per_s'], 0)}**",
                  rt.num(r["tflops_per_gpu"], 1), rt.pct(r.get("mfu")),
                  rt.num(ratio[r["system"], r["variant"]], 2) + "x"
                  if ratio[r["system"], r["variant"]] else "-"]
                 for r in res.get("rows", []) if not r.get("skipped")]
    head = ["model", "system", "variant", "tokens/s", "TFLOP/s per GPU", "MFU",
            "vs best transformers"]
    note = f" Not run (not installed): {', '.join(dict.fromkeys(skipped))}." if skipped else ""
    return [gpu_source_line(run, page, _history(page)) + note, "",
            *rt.table(head, rows, "lllrrrr")]


def _errors(summary: dict, goal: str, what: str, count: str) -> list[str]:
    def pct(key):
        return f"{summary[key]:+.1f}%" if key == "total_pct" else f"{summary[key]:.1f}%"

    return [what, count, f"**{pct('median_abs_pct')}**", pct("max_abs_pct"), pct("total_pct"),
            goal]


def gpu_cost_model(page: str) -> list[str]:
    """calibrate_gpu.py: the fit, the held-out loop with the written file, the online refit."""
    run = current("calibrate_gpu", lambda r: bool(r["rows"].get("validation")))
    if run is None:
        return ["_Not yet measured._"]
    data, meta = run["rows"], run["meta"]
    fit, val = data["fit"]["error"], data["validation"]
    rows = [_errors(fit, "-", "fit: the launcher's steps on composed and sampler batches",
                    str(fit["n"])),
            _errors(val["summary"], "15%", "held-out: the launcher's loop, the written file, "
                    "fixed", f"{val['summary']['n']} (after {val['skipped_first']})")]
    for seed, res in (data.get("online") or {}).items():
        rows.append(_errors(res["summary"], "10%", f"online refit seeded with `{seed}`",
                            f"{res['summary']['n']} (after {res['skipped_first']})"))
    cm, dense = data["cost_model"], data["kernels"]["dense"]
    model = data["calibration"]["model"]
    return [gpu_source_line(run, page, _history(page)) +
            f" {model['num_layers']} layers, hidden {model['hidden_size']}, kernel "
            f"{data['calibration'].get('kernel', '?')}, recompute "
            f"{rt.flag(meta, '--recompute-granularity', 'none')}, bucket "
            f"{rt.flag(meta, '--skrull-bucket-size', '?')}, GBS "
            f"{rt.flag(meta, '--global-batch-size', '?')}.", "",
            *rt.table(["predicted / measured iteration time - 1", "iterations", "median abs. error",
                       "max abs. error", "totals", "goal"], rows, "lrrrrr"), "",
            f"Fitted: dense layers and head {1e-12 / cm['c_linear']:.0f} TFLOP/s in training "
            f"({dense['tflops']:.0f} in the kernel runs alone), attention "
            f"{1e-12 / cm['c_attention']:.0f} TFLOP/s on long blocks, "
            f"{1e3 * cm['micro_batch_overhead']:.0f} ms per micro-batch, "
            f"{1e3 * cm['iteration_overhead']:.0f} ms per iteration."]


def _shape(run: dict) -> str:
    """The model shape of a bench_memory run (its ``--shape``, else the script's default)."""
    return rt.flag(run["meta"], "--shape", "qwen2.5-0.5b")


def memory_rows() -> list[tuple[str, dict, dict]]:
    """``(shape, setting, run)``: the newest quiet GPU result of each shape and setting."""
    latest: dict = {}
    for run in rt.runs("bench_memory_cuda"):
        if not _on_gpu(run) or not rt.quiet(run["meta"]):
            continue
        for setting in run["rows"].get("settings", []):
            latest[_shape(run), setting["setting"]] = (setting, run)
    return [(shape, *latest[shape, name]) for shape, name in latest]


def _peak(r: dict) -> str:
    if r.get("oom"):
        return f"out of memory (predicted {_gib(r['predicted_peak'])})"
    return (f"{_gib(r['measured_peak'])} / {_gib(r['predicted_peak'])} "
            f"({r['error_pct']:+.1f}%)")


def gpu_memory(page: str) -> list[str]:
    """bench_memory.py --device cuda per shape and setting, then memory_breakdown.py."""
    found = memory_rows()
    if not found:
        return ["_Not yet measured._"]
    buckets = sorted({r["bucket"] for _, s, _ in found for r in s["rows"]})
    rows = []
    for shape, s, run in found:
        by = {r["bucket"]: r for r in s["rows"]}
        rec, fit = s.get("recommended") or {}, s.get("fit") or {}
        rows.append([f"{shape.replace('qwen2.5-', '').upper()}, {s['setting']}",
                     *(_peak(by[b]) if b in by else "-" for b in buckets),
                     f"{rec['bucket']:,}: **{_peak(rec)}**" if rec else "-",
                     f"{rt.num(fit.get('alpha_bytes_per_token'), 0)} / "
                     f"{rt.num(s.get('alpha_model'), 0)}",
                     rt.link(run, page, _date(run["meta"])[11:])])
    newest = max((run for _, _, run in found), key=rt._order)
    head = ["shape, recompute", *(f"bucket {b // 1024}K" for b in buckets),
            "planner's bucket (10% margin)", "bytes/token fitted / model", "data"]
    return [gpu_source_line(newest, page, _history(page)) + " Peak GiB measured / predicted "
            "(error); each row links its run.", "",
            *rt.table(head, rows, "l" + "r" * (len(buckets) + 2) + "l"),
            *_breakdown_line(page)]


def _breakdown_line(page: str) -> list[str]:
    run = current("memory_breakdown_cuda")
    if run is None:
        return []
    parts = []
    for s in run["rows"]["settings"]:
        got, model = s["measured"]["totals"], s["model"]["totals"]
        slope = 100 * (s["peak_model"] / s["peak_bytes_per_token"] - 1)
        parts.append(
            f"recompute {s['recompute']}, {s['tokens']:,} tokens: saved per layer "
            f"{rt.num(got['layer'], 0)} bytes/token measured, {rt.num(model['layer'], 0)} "
            f"modelled; outside the layers {rt.num(got['outside'], 0)} / "
            f"{rt.num(model['outside'], 0)}; the allocator's peak grows "
            f"{rt.num(s['peak_bytes_per_token'], 0)} bytes/token (model "
            f"{rt.num(s['peak_model'], 0)}, {slope:+.1f}%)")
    return ["", f"Tensor by tensor (`memory_breakdown.py`, {_date(run['meta'])} UTC, commit "
            f"{rt.commit_text(run['meta'])}, {rt.link(run, page, 'data')}): " +
            "; ".join(parts) + "."]


def _per_step(data: dict) -> tuple[dict, int]:
    """``name -> calls per step`` of the profiled ops, and the number of profiled steps
    (``by_self_cpu`` holds totals, ``syncs_per_step`` per-step counts of the same ops)."""
    totals = {r["name"]: r for r in data["by_self_cpu"]}
    steps = next((round(totals[s["name"]]["calls"] / s["calls"]) for s in data["syncs_per_step"]
                  if s["calls"] and s["name"] in totals), 1)
    return {name: r["calls"] / steps for name, r in totals.items()}, steps


def gpu_profile(page: str) -> list[str]:
    """profile_step.py: one launcher step under torch.profiler, its headline numbers."""
    run = current("profile_step")
    if run is None:
        return ["_Not yet measured._"]
    d = run["rows"]
    calls, steps = _per_step(d)
    wall, busy = d["wall_ms_per_step_profiled"], d["device_busy_ms_per_step"]
    syncs = {s["name"]: s for s in d["syncs_per_step"]}
    rows = [["one step: documents, tokens, micro-batches",
             f"{d['docs']}, {d['tokens']:,}, {d['micro_batches']}"],
            ["wall time under the profiler (the first step, unprofiled, with set-up)",
             f"**{wall:.0f} ms** ({d['first_step_ms']:.0f} ms)"],
            ["device busy", f"**{busy:.1f} ms** ({100 * busy / wall:.0f}% of the wall time)"],
            ["kernel launches (`cudaLaunchKernel`, `cuLaunchKernelEx`)",
             f"{rt.num(calls.get('cudaLaunchKernel', 0), 0)}, "
             f"{rt.num(calls.get('cuLaunchKernelEx', 0), 0)}"]]
    for name in ("cudaMemcpyAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize",
                 "aten::item", "aten::copy_", "aten::to"):
        if name in syncs:
            s = syncs[name]
            rows.append([f"`{name}`", f"{rt.num(s['calls'], 0 if s['calls'] >= 10 else 1)} "
                         f"({s['self_cpu_us'] / 1e3:.1f} ms self CPU)"])
    top = ", ".join(f"`{r['name']}` {r['self_cpu_us'] / 1e3 / steps:.1f}"
                    for r in d["by_self_cpu"][:6])
    return [gpu_source_line(run, page, _history(page)) + f" {steps} profiled steps.", "",
            *rt.table(["per step", "measured"], rows, "lr"), "",
            f"Most self CPU time per step (ms): {top}."]


# ---- every GPU run, and README's row -----------------------------------------------

def _history_result(name: str, data: dict) -> str:
    if name == "bench_gpu":
        return "; ".join(f"{m}: " + ", ".join(
            f"{r['variant']} {rt.num(r['tokens_per_s'], 0)}" for r in res.get("rows", [])
            if r["system"] == "ours" and not r.get("skipped")) + " tokens/s"
            for m, res in data["models"].items())
    if name == "calibrate_gpu":
        online = data.get("online", {}).get("h100", {}).get("summary", {})
        return (f"held-out median {data['validation']['summary']['median_abs_pct']:.1f}%, "
                f"online from h100 median {online.get('median_abs_pct', float('nan')):.1f}%")
    if name == "bench_memory_cuda":
        rows = [r for s in data["settings"] for r in s["rows"] + [s.get("recommended") or {}]
                if r]
        return (f"{', '.join(s['setting'] for s in data['settings'])}: max error "
                f"{max(abs(r['error_pct']) for r in rows if not r['oom']):.1f}%, "
                f"{sum(r['oom'] for r in rows)} out of memory")
    if name == "memory_breakdown_cuda":
        return "; ".join(f"{s['recompute']}: per layer "
                         f"{rt.num(s['measured']['totals']['layer'], 0)} / "
                         f"{rt.num(s['model']['totals']['layer'], 0)} bytes/token"
                         for s in data["settings"])
    if name == "profile_step":
        return (f"{data['wall_ms_per_step_profiled']:.0f} ms per step, device busy "
                f"{data['device_busy_ms_per_step']:.1f} ms")
    ran = [k for k, s in data.items() if s["status"] != "not run"]
    return (f"{sum(data[k]['status'] == 'ok' for k in ran)}/{len(ran)} sections ok "
            f"({', '.join(ran)})")


HISTORY = ("gpu_check", "bench_gpu", "calibrate_gpu", "bench_memory_cuda",
           "memory_breakdown_cuda", "profile_step")


def gpu_history(page: str) -> list[str]:
    every = [(name, run) for name in HISTORY for run in rt.runs(name) if _on_gpu(run)]
    rows = [[_date(run["meta"]), name.replace("gpu_check", "check_gpu"),
             run["meta"].get("machine", ""), run["meta"].get("versions", {}).get("torch", ""),
             rt.commit_text(run["meta"]), _history_result(name, run["rows"]), rt.link(run, page)]
            for name, run in sorted(every, key=lambda item: rt._order(item[1]))]
    return rt.table(["date (UTC)", "run", "machine", "torch", "commit", "result", "data"], rows,
                    "lllllll")


def headline_row(page: str) -> Optional[list[str]]:
    """README's GPU row: tokens/s against transformers, predicted time, predicted memory."""
    speed, cal, memory = current("bench_gpu", _long_enough), current(
        "calibrate_gpu", lambda r: bool(r["rows"].get("validation"))), memory_rows()
    if not (speed and cal and memory):
        return None
    ratios = [_vs_transformers(res).get(("ours", "torch")) for res in
              speed["rows"]["models"].values()]
    models = " / ".join(m.replace("qwen2.5-", "").upper() for m in speed["rows"]["models"])
    worst = max(abs(r["error_pct"]) for _, s, _ in memory
                for r in s["rows"] + [s.get("recommended") or {}] if r and not r["oom"])
    gpu, cal_gpu = (str(run["meta"].get("machine", "")).split(" (")[0].replace("NVIDIA ", "")
                    for run in (speed, cal))
    where = "" if cal_gpu == gpu else f", {cal_gpu}"  # the newest calibration ran elsewhere
    return [f"one GPU ({gpu}), Qwen2.5-{models} shapes, `torch` kernel",
            f"**{' / '.join(rt.num(r, 1) + 'x' for r in ratios if r)}** transformers' "
            f"tokens/s; iteration time predicted within "
            f"**{cal['rows']['validation']['summary']['median_abs_pct']:.1f}%** (median, "
            f"held out{where}), peak memory within **{worst:.1f}%**",
            rt._doc(page, "gpu.md", "latest-results")]


TABLES = {"gpu-check": gpu_check, "gpu-kernel-time": gpu_kernel_time,
          "gpu-throughput": gpu_throughput, "gpu-cost-model": gpu_cost_model,
          "gpu-memory": gpu_memory, "gpu-profile": gpu_profile, "gpu-history": gpu_history}
