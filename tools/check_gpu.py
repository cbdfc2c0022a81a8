"""One command for a GPU machine: are the attention kernels, the CP=2 ring and training
right, and how fast are the kernels?

    python tools/check_gpu.py                      # sections 1-5 (CUDA, 1 or 2 GPUs)
    python tools/check_gpu.py --all --out DIR      # + training run and hooks; DIR/gpu_check.{json,log}
    python tools/check_gpu.py --dry-run            # anywhere: the plan, shapes and commands

Sections, each in its own process under its own timeout (and within ``--budget``), so a
failing or hanging one stops nothing; the report is rewritten after each:

1. ``parity``: every kernel that runs here (``torch`` = PyTorch's FlashAttention-2 op,
   ``flash``, ``te``) in bf16 and fp16 against the float64 reference, GQA
   (``tools/gpu_check_kernels.py``).
2. ``kernel_time``: causal varlen forward/backward per kernel, Qwen2.5 head shapes,
   documents of 1K-32K tokens.
3. ``cp_attention``: a torchrun group of 2 (on one GPU: gloo, the ring staged through host
   memory): DACP attention in bf16 against float64 and against one process, side stream on
   and off, and the side stream's order of operations on real CUDA streams
   (``tools/gpu_check_cp.py``).
4. ``cp_training``: the launcher's per-iteration losses, CP=2 (two ranks; on one GPU over
   gloo, ``SKRULL_DIST_BACKEND=gloo``) against CP=1.
5. ``cp_timing`` (2 GPUs): DACP time with the side stream on and off.
6. ``train`` (``--all``): a Qwen2.5-0.5B-shaped model with ``--skrull-attention-kernel auto``.
7. hooks (``--all``): ``benchmarks/calibrate_gpu.py``, ``bench_memory.py --device cuda``,
   ``bench_gpu.py`` when present (``$SKRULL_GPU_REPORT`` names a JSON file they may write).

Bad input or a missing GPU is one ``error:`` line and exit 2; exit 1 when a section fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import torch  # noqa: E402

import gpu_check_kernels as gk  # noqa: E402

LOSS_RTOL = 2e-2  # bf16, CP=2 vs CP=1 per iteration
TRAIN_FLAGS = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "8",
               "--group-query-attention", "--num-query-groups", "2", "--swiglu",
               "--normalization", "RMSNorm",
               "--disable-bias-linear", "--seq-length", "2048", "--global-batch-size", "16",
               "--lr", "1e-3", "--lr-warmup-iters", "0", "--train-iters", "8", "--bf16",
               "--skrull-bucket-size", "2048", "--mock-data", "--mock-num-samples", "256",
               "--log-interval", "1", "--device", "cuda", "--seed", "7"]
#: Qwen2.5-0.5B's shape (mock vocabulary), as the first GPU run trained it.
QWEN_FLAGS = ["--num-layers", "24", "--hidden-size", "896", "--ffn-hidden-size", "4864",
              "--num-attention-heads", "14", "--group-query-attention", "--num-query-groups", "2",
              "--add-qkv-bias",
              "--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6",
              "--disable-bias-linear", "--rotary-base", "1000000", "--seq-length", "32768",
              "--max-position-embeddings", "32768", "--global-batch-size", "16", "--lr", "1e-4",
              "--lr-warmup-iters", "0", "--mock-data", "--mock-num-samples", "512",
              "--log-interval", "1", "--device", "cuda", "--seed", "7", "--skrull-bucket-size",
              "32768", "--bf16", "--recompute-granularity", "selective", "--train-iters", "6",
              "--skrull-attention-kernel", "auto"]
#: (name, script, arguments, timeout s) of the benchmark hooks run by ``--all``.  In the
#: arguments ``{report}`` is the hook's JSON result (merged into the report), ``{out}`` the
#: ``--out`` folder and ``{budget}`` the hook's own time budget (its timeout less start-up).
HOOKS = (("calibrate_gpu", "benchmarks/calibrate_gpu.py",
          ["--shape", "qwen2.5-0.5b", "--device", "cuda", "--bf16", "--skrull-attention-kernel",
           "auto", "--recompute-granularity", "selective", "--seq-length", "{calib_len}",
           "--skrull-bucket-size", "{calib_len}", "--global-batch-size", "16", "--time-budget-s",
           "{budget}", "--json", "{report}", "--cost-model-config",
           "{out}/calibrated_cost_model.json"], 150),
         ("bench_memory", "benchmarks/bench_memory.py",
          ["--device", "cuda", "--skrull-attention-kernel", "auto", "--time-budget-s",
           "{budget}", "--json", "{report}"], 100),
         ("bench_gpu", "benchmarks/bench_gpu.py",
          ["--device", "cuda", "--bf16", "--kernels", "torch,flash,te", "--time-budget-s",
           "{budget}", "--json", "{report}"], 150))


@dataclasses.dataclass(frozen=True)
class Section:
    name: str
    title: str
    timeout: int
    gpus: int = 1
    all_only: bool = False


SECTIONS = (Section("parity", "kernel parity vs float64 (bf16, fp16, GQA)", 120),
            Section("cp_attention", "DACP at CP=2 vs float64 and one process, side stream", 120),
            Section("cp_training", "launcher losses CP=2 vs CP=1", 180),
            Section("train", "Qwen2.5-0.5B shape, kernel auto", 180, all_only=True),
            Section("kernel_time", "causal varlen fwd/bwd time per kernel", 90),
            Section("cp_timing", "DACP time, side stream on/off", 150, gpus=2),
            *(Section(n, f"hook {s} {' '.join(a)}".strip(), t, all_only=True)
              for n, s, a, t in HOOKS))


def env() -> dict:
    """The environment of child processes: this checkout first on PYTHONPATH, the rest kept
    (an offline kit's site directory with megatron-core, for one)."""
    path = [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1"}


def torchrun(nproc: int, python: str = sys.executable) -> list[str]:
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def training_commands(kernel: str = "auto", python: str = sys.executable) -> dict:
    """``{label: argv}`` of the loss-parity runs (CP=1, CP=2)."""
    flags = TRAIN_FLAGS + ["--skrull-attention-kernel", kernel]
    launch = ["-m", "megatron.skrull.pretrain_gpt", *flags, "--context-parallel-size"]
    return {"cp1": torchrun(1, python) + launch + ["1"], "cp2": torchrun(2, python) + launch + ["2"]}


def parse_losses(stdout: str) -> list[float]:
    """Per-iteration losses of the launcher's log lines."""
    return [float(x) for x in re.findall(r" iteration +\d+/ *\d+ \|.*? lm loss: ([-+.\dEe]+)",
                                         stdout)]


def _spawn(argv, timeout: float, extra_env: Optional[dict] = None) -> dict:
    """Runs ``argv`` in its own process group; kills the whole group on timeout."""
    return _spawn_many({"one": argv}, timeout, extra_env)["one"]


def _spawn_many(cmds: dict, timeout: float, extra_env: Optional[dict] = None) -> dict:
    """Runs ``{label: argv}`` at once, each in its own process group (killed with all its
    children on timeout); ``{label: {"rc": int or "timeout", "out": text}}``."""
    procs = {label: subprocess.Popen(argv, cwd=ROOT, env={**env(), **(extra_env or {})},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
             for label, argv in cmds.items()}
    deadline, res = time.monotonic() + timeout, {}
    for label, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            res[label] = {"rc": proc.returncode, "out": out}
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            res[label] = {"rc": "timeout", "out": proc.communicate()[0]}
    return res


def _json_lines(text: str) -> list:
    """The JSON objects among ``text``'s lines (a worker's result; other lines are logs)."""
    found = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                found.append(json.loads(line))
            except ValueError:
                pass
    return found


# --- the sections, each run in a child process (``--section NAME``) ---------------------------

def section_parity(kernels, dtypes, timeout) -> dict:
    dev = torch.device("cuda")
    rows = [r for k in kernels for d in dtypes
            for r in gk.parity_rows(k, dev, gk.DTYPES[d], d)]
    return {"ok": bool(rows) and all(r["ok"] for r in rows), "rows": rows}


def section_kernel_time(kernels, dtypes, timeout) -> dict:
    rows = gk.timing_rows([k for k in kernels if k != "te"], torch.device("cuda"))
    return {"ok": any(r.get("ok") for r in rows), "rows": rows}


def _cp_kernel(kernels) -> str:
    return next((k for k in kernels if k in ("torch", "flash")), "torch")


def _cp_worker(what: str, kernels, timeout):
    """``(kernel, last JSON line or None, error text)`` of a torchrun of gpu_check_cp.py."""
    kernel = _cp_kernel(kernels)
    run = _spawn(torchrun(2) + [os.path.join(ROOT, "tools", "gpu_check_cp.py"), what, kernel],
                 timeout - 5)
    lines = _json_lines(run["out"])
    ok = run["rc"] == 0 and lines
    return kernel, (lines[-1] if ok else None), run["out"][-3000:]


def section_cp_attention(kernels, dtypes, timeout) -> dict:
    kernel, res, error = _cp_worker("attention", kernels, timeout)
    if res is None:
        return {"ok": False, "kernel": kernel, "error": error}
    ranks = res["ranks"]
    worst = {key: max(max(r[key].values()) for r in ranks)
             for key in ("vs_fp64", "vs_one_process")}
    problems = [p for r in ranks for p in r["stream_order"]["problems"]]
    tol = gk.TOLERANCE["bf16"]
    ok = all(r["vs_fp64"]["out"] <= tol["out"] and max(r["vs_fp64"][g] for g in (
        "dq", "dk", "dv")) <= tol["grad"] for r in ranks)
    return {"ok": ok and not problems, "kernel": kernel, "backend": ranks[0]["backend"],
            "worst": worst, "stream_order_problems": problems, "ranks": ranks}


def section_cp_training(kernels, dtypes, timeout) -> dict:
    """CP=1 and CP=2 launched at once (three processes on one GPU fit easily)."""
    shared = {"SKRULL_DIST_BACKEND": "gloo"} if torch.cuda.device_count() < 2 else {}
    runs = _spawn_many(training_commands(), timeout - 5, shared)
    losses = {label: parse_losses(run["out"]) for label, run in runs.items()}
    a, b = losses["cp1"], losses["cp2"]
    if any(run["rc"] != 0 for run in runs.values()) or not a or len(a) != len(b):
        return {"ok": False, "losses": losses, "error": "\n".join(
            f"[{k}, rc {r['rc']}] {r['out'][-1500:]}" for k, r in runs.items())}
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    return {"ok": worst <= LOSS_RTOL, "losses": losses, "max_rel_diff": worst,
            "backend": shared.get("SKRULL_DIST_BACKEND", "nccl")}


def section_cp_timing(kernels, dtypes, timeout) -> dict:
    kernel, res, error = _cp_worker("timing", kernels, timeout)
    return {"ok": False, "error": error} if res is None else {"ok": True, "rows": res["rows"]}


def section_train(kernels, dtypes, timeout) -> dict:
    run = _spawn(torchrun(1) + ["-m", "megatron.skrull.pretrain_gpt", *QWEN_FLAGS], timeout - 5)
    losses = parse_losses(run["out"])
    tokens = [float(x) for x in re.findall(r"tokens/s: (\d+)", run["out"])]
    auto = re.findall(r"attention kernel auto -> (\w+) on cuda", run["out"])
    ok = run["rc"] == 0 and len(losses) >= 2 and all(map(math.isfinite, losses)) and \
        losses[-1] < losses[0]
    res = {"ok": ok, "losses": losses, "tokens_per_s": tokens, "auto_kernel": auto[:1],
           "log_tail": run["out"][-2500:]}
    return res


def calibration_length(gpu_bytes: int) -> int:
    """The calibration's sequence length and bucket on a GPU of ``gpu_bytes``: 32768 from
    100 GiB on (an H200), 16384 below: at 32768 an 80 GB H100 runs out of memory in the loss
    (fp32 logits of 32768 tokens x 151936 take 18.45 GiB; GPU run 7)."""
    return 32768 if gpu_bytes >= 100 * 2**30 else 16384


def section_hook(name, timeout) -> dict:
    _, script, args, _ = next(h for h in HOOKS if h[0] == name)
    if not os.path.exists(os.path.join(ROOT, script)):
        return {"ok": True, "skipped": f"{script} not in this checkout"}
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        fill = {"report": report, "out": os.environ.get("SKRULL_GPU_OUT") or tmp,
                "budget": str(max(10, int(timeout) - 40)),
                "calib_len": str(calibration_length(torch.cuda.get_device_properties(0).total_memory
                                                    if torch.cuda.is_available() else 0))}
        run = _spawn([sys.executable, os.path.join(ROOT, script),
                      *(a.format(**fill) for a in args)], timeout - 5,
                     {"SKRULL_GPU_REPORT": report, "SKRULL_GPU_BUDGET_S": fill["budget"]})
        data = json.load(open(report)) if os.path.exists(report) else None
    if run["rc"] == 2 and "unrecognized arguments" in run["out"]:  # not the GPU version yet
        return {"ok": True, "skipped": f"{script} does not take {' '.join(args)} yet",
                "log_tail": run["out"][-1000:]}
    return {"ok": run["rc"] == 0, "rc": run["rc"], "report": data, "log_tail": run["out"][-4000:]}


SECTION_FUNCS = {"parity": section_parity, "kernel_time": section_kernel_time,
                 "cp_attention": section_cp_attention, "cp_training": section_cp_training,
                 "cp_timing": section_cp_timing, "train": section_train}


# --- orchestration: one child process per section, a report after each ------------------------

def detail(name: str, res: dict) -> str:
    """One line of numbers per section for the summary table."""
    if res.get("error") or res.get("skipped"):
        return (res.get("skipped") or res["error"].strip().splitlines()[-1])[:90]
    if name == "parity":
        by = {}
        for r in res["rows"]:
            k = (r["kernel"], r["dtype"])
            by[k] = [max(a, r.get(f, 0) or 0) for a, f in zip(by.get(k, [0, 0]), ("out", "grad"))]
        return "; ".join(f"{k} {d} out {o:.1e} grad {g:.1e}" for (k, d), (o, g) in by.items())
    if name == "kernel_time":
        return gk.summarize_timing(res["rows"]) or "no kernel timed"
    if name == "cp_attention":
        w = res["worst"]
        return (f"{res['kernel']} over {res['backend']}: vs fp64 {w['vs_fp64']:.1e}, vs 1 proc "
                f"{w['vs_one_process']:.1e}, order {'ok' if not res['stream_order_problems'] else 'BAD'}")
    if name == "cp_training":
        return f"max rel loss diff {res['max_rel_diff']:.1e} over {res['backend']}"
    if name == "cp_timing":
        by = {r["side_stream"]: r["ms"] for r in res["rows"]}
        return f"side stream on {by[True]:.1f} ms, off {by[False]:.1f} ms"
    if name == "train":
        tok = res["tokens_per_s"]
        return (f"auto -> {(res['auto_kernel'] or ['?'])[0]}, loss {res['losses'][0]:.2f} -> "
                f"{res['losses'][-1]:.2f}" + (f", {max(tok):.0f} tokens/s" if tok else ""))
    return f"rc {res.get('rc')}"


def safe_detail(name: str, res: dict) -> str:
    try:
        return detail(name, res)[:300]
    except Exception as exc:  # noqa: BLE001 - a summary line must not fail the run
        return f"({type(exc).__name__} in the summary; see the JSON report)"


def meta() -> dict:
    info = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        info.update(gpus=torch.cuda.device_count(), gpu=torch.cuda.get_device_name(0),
                    cudnn=torch.backends.cudnn.version(),
                    kernels=gk.available_kernels(torch.device("cuda")))
    # A copied checkout (an offline GPU machine) may carry a stale .git: $SKRULL_COMMIT, set
    # by whoever copied it, names the commit that actually runs.
    info["commit"] = os.environ.get("SKRULL_COMMIT", "")[:7]
    if not info["commit"]:
        try:
            info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                            capture_output=True, text=True,
                                            timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return info


class Reporter:
    """Prints to stdout and the log file; rewrites the JSON report after each section."""

    def __init__(self, json_path: Optional[str], log_path: Optional[str], out=sys.stdout):
        self.json_path, self.out = json_path, out
        self.log = open(log_path, "a") if log_path else None
        self.report = {"meta": meta(), "sections": {}}

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)
        if self.log:
            self.log.write(text + "\n")
            self.log.flush()

    def section(self, name: str, res: dict) -> None:
        self.report["sections"][name] = res
        if self.json_path:
            with open(self.json_path + ".tmp", "w") as f:
                json.dump(self.report, f, indent=1, default=str)
            os.replace(self.json_path + ".tmp", self.json_path)

    def summary(self) -> bool:
        m = self.report["meta"]
        self.say(f"== summary: {m.get('gpu', 'no GPU')} x{m.get('gpus', 0)}, torch {m['torch']}, "
                 f"CUDA {m['cuda']}, {m['date']}, commit {m.get('commit', '?')}")
        self.say(f"  {'section':14s} {'status':8s} {'s':>6s}  detail")
        ok = True
        for name, res in self.report["sections"].items():
            ok &= res["status"] in ("ok", "skipped")
            self.say(f"  {name:14s} {res['status']:8s} {res.get('seconds', 0):6.1f}  "
                     f"{safe_detail(name, res)}")
        return ok


def run_sections(sections, args, rep: Reporter) -> None:
    deadline = time.monotonic() + args.budget
    for sec in sections:
        left = deadline - time.monotonic()
        if left < 30:
            rep.section(sec.name, {"status": "skipped", "skipped": "out of --budget"})
            continue
        timeout = min(sec.timeout, left - 10)
        rep.say(f"== {sec.name}: {sec.title} (timeout {timeout:.0f} s)")
        start = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "section.json")
            run = _spawn([sys.executable, os.path.abspath(__file__), "--section", sec.name,
                          "--json", path, "--kernels", ",".join(args.kernels),
                          "--dtypes", ",".join(args.dtypes), "--timeout", str(int(timeout))],
                         timeout + 5)
            res = json.load(open(path)) if os.path.exists(path) else {
                "ok": False, "error": f"section process ended with rc {run['rc']}: "
                                      f"{run['out'][-3000:]}"}
        res["seconds"] = round(time.monotonic() - start, 1)
        res["status"] = ("skipped" if res.get("skipped") else "ok" if res.get("ok") else
                         "timeout" if run["rc"] == "timeout" else "FAIL")
        for line in run["out"].splitlines()[-60:]:
            rep.say("  | " + line)
        rep.say(f"   -> {res['status']} in {res['seconds']} s: {safe_detail(sec.name, res)}")
        rep.section(sec.name, res)


def run_one(name: str, args) -> dict:
    """``--section NAME`` in this (child) process."""
    try:
        if name in SECTION_FUNCS:
            return SECTION_FUNCS[name](args.kernels, args.dtypes, args.timeout)
        return section_hook(name, args.timeout)
    except Exception as exc:  # noqa: BLE001 - reported in the section's result
        import traceback
        return {"ok": False, "error": traceback.format_exc()[-3000:]}


def dry_run(sections, args, out) -> dict:
    """Prints what a GPU run would do; builds every layout and shape on the way."""
    plan = {"kernels": args.kernels, "dtypes": args.dtypes,
            "sections": [s.name for s in sections], "parity": [], "training": {}}
    for sec in sections:
        print(f"== {sec.name}: {sec.title} (timeout {sec.timeout} s"
              + (f", {sec.gpus} GPUs" if sec.gpus > 1 else "") + ")", file=out)
        lines = []
        if sec.name == "parity":
            lines = [line for k in args.kernels for d in args.dtypes
                     for line in gk.parity_rows(k, torch.device("cpu"), None, d, plan_only=True)]
            plan["parity"] = lines
        elif sec.name == "kernel_time":
            lines = gk.timing_plan()
        elif sec.name in ("cp_attention", "cp_timing"):
            what = "attention" if sec.name == "cp_attention" else "timing"
            lines = [" ".join(torchrun(2, "python") + ["tools/gpu_check_cp.py", what,
                                                      _cp_kernel(args.kernels)])]
        elif sec.name == "cp_training":
            plan["training"] = cmds = training_commands("auto", "python")
            lines = [f"{k}: {' '.join(v)}" for k, v in cmds.items()]
            lines.append("cp2 on one GPU: SKRULL_DIST_BACKEND=gloo (ring staged through host)")
        elif sec.name == "train":
            lines = [" ".join(torchrun(1, "python") + ["-m", "megatron.skrull.pretrain_gpt",
                                                       *QWEN_FLAGS])]
        else:
            _, script, hook_args, _ = next(h for h in HOOKS if h[0] == sec.name)
            lines = [f"python {script} {' '.join(hook_args)} (if present; "
                     "$SKRULL_GPU_REPORT names its JSON result)"]
        for line in lines:
            print("  " + line, file=out)
    return plan


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print the plan; run nothing")
    ap.add_argument("--all", action="store_true", help="also the training run and the hooks")
    ap.add_argument("--kernels", default=None, help="comma list of torch,flash,te "
                    "(default: those that run here; all with --dry-run)")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--sections", default=None, help="comma list of section names to run")
    ap.add_argument("--budget", type=float, default=None, help="seconds for all sections "
                    "(default 420 with --all, else unlimited)")
    ap.add_argument("--out", help="folder for gpu_check.json and gpu_check.log")
    ap.add_argument("--json", help="also write the results (or the plan) to this file")
    ap.add_argument("--section", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=600, help=argparse.SUPPRESS)
    return ap


def main(argv: Optional[list] = None, out=sys.stdout) -> int:
    args = _parser().parse_args(argv)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    args.kernels = ([k for k in args.kernels.split(",") if k] if args.kernels else
                    list(gk.KERNELS) if args.dry_run else None)
    names = [s.name for s in SECTIONS]
    wanted = [s for s in (args.sections.split(",") if args.sections else []) if s]
    bad = ([d for d in args.dtypes if d not in gk.DTYPES] + [k for k in args.kernels or []
                                                            if k not in gk.KERNELS]
           + [s for s in wanted if s not in names])
    if bad:
        print(f"error: unknown {bad}: --kernels takes {','.join(gk.KERNELS)}, --dtypes "
              f"bf16,fp16, --sections {','.join(names)}", file=sys.stderr)
        return 2
    if args.section:  # a child process: one section, its result as JSON
        args.kernels = args.kernels or gk.available_kernels(torch.device("cuda"))
        res = run_one(args.section, args)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
        return 0
    sections = ([s for s in SECTIONS if s.name in wanted] if wanted else
                [s for s in SECTIONS if args.all or not s.all_only])
    if args.dry_run:
        plan = dry_run(sections, args, out)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(plan, f, indent=1)
        return 0
    if not torch.cuda.is_available():
        print("error: no CUDA device: run on a GPU machine, or pass --dry-run for the plan",
              file=sys.stderr)
        return 2
    args.kernels = args.kernels or gk.available_kernels(torch.device("cuda"))
    if not args.kernels:
        print("error: no attention kernel runs here: PyTorch's FlashAttention-2 op is "
              "unusable and neither flash-attn nor Transformer Engine imports",
              file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count()
    skipped = [s for s in sections if s.gpus > gpus]
    sections = [s for s in sections if s.gpus <= gpus]
    args.budget = args.budget or (420 if args.all else 1e9)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        os.environ["SKRULL_GPU_OUT"] = os.path.abspath(args.out)  # the hooks' {out}
    rep = Reporter(args.json or (os.path.join(args.out, "gpu_check.json") if args.out else None),
                   os.path.join(args.out, "gpu_check.log") if args.out else None, out)
    rep.say(f"check_gpu: {json.dumps(rep.report['meta'])}")
    for s in skipped:
        rep.section(s.name, {"status": "skipped", "skipped": f"needs {s.gpus} GPUs, {gpus} here"})
    run_sections(sections, args, rep)
    return 0 if rep.summary() else 1


if __name__ == "__main__":
    sys.exit(main())
