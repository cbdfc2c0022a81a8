"""Every user entry point against the bad inputs a user meets (docs/troubleshooting.md).

Each row asserts the contract of :mod:`megatron.skrull.errors`: exit status 2 (bad input)
or 1 (failure), a few stderr lines carrying ``error:`` and the fix, no Python traceback,
and nothing written before lost or half-written.  Entry points that take ``argv`` are
called in-process (a subprocess costs 2-5 s of torch imports); the torchrun rows share one
launch each.
"""
from __future__ import annotations

import errno
import io
import json
import os
import shutil

import numpy as np
import pytest

from megatron.skrull import preprocess as pp
from megatron.skrull.data import DatasetFormatError, load_sft_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def assert_reported(code, err, expect_code, *needles, max_lines=3):
    """One error report: status, few lines, ``error:``, the needles, no traceback."""
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == expect_code, err
    assert 1 <= len(lines) <= max_lines, err
    assert any("error:" in ln for ln in lines), err
    assert "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """A small preprocessed dataset (byte-level tokenizer)."""
    prefix = str(tmp_path_factory.mktemp("data") / "synth")
    assert pp.main(["--synthetic", "30", "--seed", "2", "--seq-length", "200",
                    "--output-prefix", prefix]) == 0
    return prefix


def _copy(prefix, dest):
    out = str(dest / "copy")
    for src in pp.dataset_paths(prefix).values():
        shutil.copy(src, out + src[len(prefix):])
    return out


def _snapshot(prefix):
    return {k: open(p, "rb").read() for k, p in pp.dataset_paths(prefix).items()}


# --- tools/preprocess_sft.py ------------------------------------------------------------

PREPROCESS_ROWS = [
    # (argv after --output-prefix, status, needles)
    (["--synthetic", "0"], 2, ["--synthetic must be >= 1"]),
    (["--synthetic", "3", "--seq-length", "-5"], 2, ["--seq-length must be >= 1"]),
    (["--synthetic", "x"], 2, ["invalid int value", "see --help"]),
    (["--input", "MISSING.jsonl"], 2, ["--input", "does not exist"]),
    (["--synthetic", "3", "--tokenizer-type", "HFTokenizer", "--tokenizer-model", "nope.json"],
     2, ["--tokenizer-model", "does not exist", "tokenizer.json"]),
    (["--synthetic", "3", "--save-jsonl", "x.jsonl", "--input", "a.jsonl"], 2,
     ["not allowed with"]),
    (["--input", "BAD.jsonl"], 2, ["BAD.jsonl:2", "malformed JSON"]),
    (["--input", "BAD.jsonl", "--skrull-bucket-size", "8"], 2,
     ["unrecognized arguments: --skrull-bucket-size"]),
]


@pytest.mark.parametrize("argv,status,needles", PREPROCESS_ROWS)
def test_preprocess_bad_input(tmp_path, capsys, argv, status, needles):
    (tmp_path / "BAD.jsonl").write_text('{"prompt": "a", "response": "b"}\n{"prompt": \n')
    argv = [str(tmp_path / a) if a.endswith(".jsonl") else a for a in argv]
    try:
        code = pp.main(argv + ["--output-prefix", str(tmp_path / "out")])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert_reported(code, capsys.readouterr().err, status, *needles)
    assert sorted(os.listdir(tmp_path)) == ["BAD.jsonl"]  # nothing written, no temp file


class _FullDiskRaw(io.FileIO):
    """A file on a disk with ``room`` bytes left: the OS refuses writes past it (the
    buffered writer on top then fails again when it flushes at close)."""

    room = 3000

    def write(self, data):
        if self.tell() + len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(data)


def test_preprocess_full_disk_keeps_the_old_dataset_and_no_temp_file(tmp_path, capsys,
                                                                       monkeypatch, dataset):
    prefix = _copy(dataset, tmp_path)
    before = _snapshot(prefix)
    builder = pp._import_indexed_dataset().IndexedDatasetBuilder
    real_init = builder.__init__

    def full_disk_init(self, path, dtype=None):
        real_init(self, path, dtype=dtype)
        self.data_file.close()
        self.data_file = io.BufferedWriter(_FullDiskRaw(path, "wb"))

    monkeypatch.setattr(builder, "__init__", full_disk_init)
    code = pp.main(["--synthetic", "30", "--seq-length", "200", "--output-prefix", prefix])
    assert_reported(code, capsys.readouterr().err, 1, "No space left on device",
                    "free space", "nothing was replaced")
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f], os.listdir(tmp_path)
    assert _snapshot(prefix) == before


# --- the dataset as the launcher opens it ---------------------------------------------

def _corrupt(prefix, kind):
    paths = pp.dataset_paths(prefix)
    if kind == "token-out-of-vocab":
        meta = json.load(open(paths["meta"]))
        tokens = np.memmap(paths["tokens_bin"], dtype=meta["token_dtype"], mode="r+")
        tokens[17] = meta["tokenizer"]["vocab_size"] + 3
        tokens.flush()
    elif kind == "truncated-bin":
        os.truncate(paths["tokens_bin"], os.path.getsize(paths["tokens_bin"]) - 7)
    elif kind == "truncated-idx":
        os.truncate(paths["tokens_idx"], 20)
    elif kind == "corrupt-json":
        open(paths["meta"], "w").write('{"format_version": 1,')
    elif kind == "missing-json":
        os.remove(paths["meta"])
    elif kind == "mask-of-another-dataset":
        os.truncate(paths["mask_bin"], 0)


@pytest.mark.parametrize("kind,needle", [
    ("token-out-of-vocab", "outside the dataset's vocabulary"),
    ("truncated-bin", "bytes but"),
    ("truncated-idx", "bad header"),
    ("corrupt-json", "not valid JSON"),
    ("missing-json", "missing"),
    ("mask-of-another-dataset", "_lossmask.bin"),
])
def test_corrupt_dataset_is_one_clear_error_at_load(tmp_path, dataset, kind, needle):
    prefix = _copy(dataset, tmp_path)
    _corrupt(prefix, kind)
    with pytest.raises(DatasetFormatError, match="preprocess_sft.py") as info:
        load_sft_dataset(prefix)
    assert needle in str(info.value) and "\n" not in str(info.value)


# --- python -m skrull_ext.plan and skrull-plan -----------------------------------------

def _plan_main(argv):
    from skrull_ext.plan import main
    return main(argv)


def _skrull_plan_main(argv):
    from skrull_ext.planner.cli import main
    return main(argv + ["--num-batches", "2"])


def _call(entry, argv):
    try:
        return entry(argv)
    except SystemExit as exc:  # argparse's own errors
        return exc.code


PLAN = ["--dp-size", "1", "--cp-size", "2", "--bucket-size", "100"]
CLI_ROWS = [
    # (entry, argv, needles, forbidden)
    (_plan_main, ["--lengths", "OK", "--dp-size", "1e8", "--cp-size", "8", "--bucket-size", "9"],
     ["--dp-size 100000000", "at most 1048576"], []),
    (_plan_main, ["--lengths", "HUGE.json"] + PLAN, ["element 1", "2^40"], ["Overflow"]),
    (_plan_main, ["--lengths", "HUGE.txt"] + PLAN, ["line 2", "2^40"], ["Overflow"]),
    (_plan_main, ["--lengths", "OK", "--dp-size", "1", "--cp-size", "2", "--bucket-size",
                  str(2 ** 70)], ["--bucket-size must be in [1, 2^40]"], ["TypeError"]),
    (_plan_main, ["--lengths", "OK", "--dp-size", "1", "--cp-size", "2", "--bucket-size", "40"],
     ["raise the bucket size (--bucket-size)", "--cp-size"],
     ["--skrull-bucket-size", "--context-parallel-size"]),
    (_plan_main, ["--lengths", "OK", "--dp-size", "1", "--cp-size", "4", "--bucket-size", "5"],
     ["raise --bucket-size"], ["--skrull-bucket-size"]),
    (_plan_main, ["--lengths", "OK", "--skrull-bucket-size", "100"] + PLAN,
     ["unrecognized arguments: --skrull-bucket-size"], []),
    (_plan_main, ["--lengths", "MISSING.txt"] + PLAN, ["no such lengths file"], []),
    (_plan_main, ["--lengths", "OK", "--dp-size", "one", "--cp-size", "2", "--bucket-size", "9"],
     ["--dp-size", "invalid integer"], []),
    (_skrull_plan_main, ["--profile", "wikipedia", "--dp-size", "1e8"], ["at most 1048576"], []),
    (_skrull_plan_main, ["--lengths", "HUGE.txt"], ["2^40"], ["Overflow"]),
    (_skrull_plan_main, ["--profile", "wikipedia", "--global-batch-size", "1e9"],
     ["at most 16777216"], []),
    (_skrull_plan_main, ["--profile", "wikipedia", "--bucket-size", "1e30"], ["2^40"],
     ["TypeError"]),
    (_skrull_plan_main, ["--profile", "wikipedia", "--cp-size", "0"], ["--cp-size must be >= 1"],
     []),
    (_skrull_plan_main, ["--profile", "wikipedia", "--skrull-scheduler", "skrull"],
     ["unrecognized arguments: --skrull-scheduler"], []),
]


@pytest.mark.parametrize("entry,argv,needles,forbidden", CLI_ROWS)
def test_planning_clis_bad_input(tmp_path, capsys, entry, argv, needles, forbidden):
    (tmp_path / "OK").write_text("5\n300\n17\n")
    (tmp_path / "HUGE.json").write_text(f"[5, {2 ** 70}]")
    (tmp_path / "HUGE.txt").write_text(f"5\n{2 ** 70}\n")
    argv = [str(tmp_path / a) if a in ("OK", "HUGE.json", "HUGE.txt", "MISSING.txt") else a
            for a in argv]
    code = _call(entry, argv)
    err = capsys.readouterr().err
    assert_reported(code, err, 2, *needles, max_lines=1)
    for word in forbidden:
        assert word not in err, err


@pytest.mark.parametrize("profile", ["wikipedia", "lmsyschat1m", "chatqa2-long-sft",
                                     "llama3-sft"])
def test_skrull_plan_default_flags_work_on_every_bundled_profile(capsys, profile):
    assert _skrull_plan_main(["--profile", profile]) == 0
    out = capsys.readouterr().out
    assert "smallest power of two that fits" in out and "skrull " in out


def test_progress_line_only_for_slow_plans():
    import time

    from skrull_ext.cli_common import Progress

    quick, slow = io.StringIO(), io.StringIO()
    with Progress("tool", "planning 5 sequences", delay=0.5, stream=quick):
        pass
    with Progress("tool", "planning 10M sequences", delay=0.05, stream=slow):
        time.sleep(0.3)
    assert quick.getvalue() == ""
    lines = slow.getvalue().splitlines()
    assert lines[0] == "tool: planning 10M sequences ..."
    assert lines[1].startswith("tool: planning 10M sequences: done in ")


# --- megatron.skrull.pretrain_gpt, direct and under the launcher -----------------------

TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "200", "--global-batch-size", "4", "--lr", "1e-3", "--device", "cpu",
        "--skrull-bucket-size", "256"]

PRETRAIN_ROWS = [
    (["--mock-data", "--bogus-flag"], ["unrecognized arguments: --bogus-flag", "see --help"]),
    (["--mock-data", "--bucket-size", "8"], ["unrecognized arguments: --bucket-size"]),
    (["--mock-data", "--lr", "fast"], ["argument --lr: invalid float value"]),
    (["--mock-data", "--train-iters", "10", "--num-layers", "-1"], ["--num-layers"]),
    (["--mock-data", "--context-parallel-size", "2"], ["--context-parallel-size"]),
    (["--mock-data", "--skrull-bucket-size", "1", "--context-parallel-size", "1"],
     ["--skrull-bucket-size"]),
    (["--mock-data", "--split", "90,x"], ["--split '90,x'", "e.g. --split 969,30,1"]),
    (["--mock-data", "--eval-interval", "0"], ["--eval-interval must be >= 1"]),
]


@pytest.mark.parametrize("argv,needles", PRETRAIN_ROWS)
def test_pretrain_gpt_bad_flags_rank0_reports_others_quiet(monkeypatch, capsys, argv, needles):
    from megatron.skrull.pretrain_gpt import main

    flags = TINY + ["--train-iters", "2"] + argv
    assert_reported(main(flags), capsys.readouterr().err, 2, *needles)
    monkeypatch.setenv("RANK", "1")  # as torchrun's second rank: same status, no output
    assert main(flags) == 2
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


def test_unexpected_failure_is_one_line_and_debug_shows_the_traceback(capsys, monkeypatch):
    from megatron.skrull import errors

    try:
        raise RuntimeError("gloo connection reset\nmore detail")
    except RuntimeError as exc:
        monkeypatch.setenv("RANK", "3")
        assert errors.report_failure(exc) == 1
        assert_reported(1, capsys.readouterr().err, 1, "rank 3: RuntimeError: gloo connection "
                        "reset", "--debug", max_lines=1)
        assert errors.report_failure(exc, debug=True) == 1
        assert "Traceback" in capsys.readouterr().err
    assert errors.take_debug_flag(["--lr", "1", "--debug"]) == (["--lr", "1"], True)
    monkeypatch.setenv("SKRULL_DEBUG", "1")
    assert errors.take_debug_flag(["--lr", "1"]) == (["--lr", "1"], True)


class _Failure:
    def __init__(self, exitcode, pid=100):
        self.exitcode, self.pid = exitcode, pid


@pytest.mark.parametrize("failures,status,needle", [
    ({0: _Failure(2), 1: _Failure(2)}, 2, None),            # bad input: rank 0 reported
    ({1: _Failure(1), 0: _Failure(-15)}, 1, None),          # rank 1 failed and reported
    ({0: _Failure(-15), 1: _Failure(-9, 7)}, 1, "rank 1 (pid 7) was killed by SIGKILL"),
    ({0: _Failure(-15)}, 1, "stopped by SIGTERM"),
    ({0: _Failure(3)}, 1, None),
])
def test_launcher_exit_status(failures, status, needle):
    from megatron.skrull.launch import exit_status

    code, message = exit_status(failures)
    assert code == status
    assert (message is None) if needle is None else (needle in message)


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_pretrain_gpt_direct_rejects_a_token_outside_the_vocabulary(tmp_path, dataset):
    import subprocess
    import sys

    prefix = _copy(dataset, tmp_path)
    _corrupt(prefix, "token-out-of-vocab")
    proc = subprocess.run([sys.executable, "-m", "megatron.skrull.pretrain_gpt", *TINY,
                           "--train-iters", "2", "--data-path", prefix], env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert_reported(proc.returncode, proc.stderr, 2, "outside the dataset's vocabulary",
                    "preprocess_sft.py", max_lines=1)
    assert "UserWarning" not in proc.stderr  # Megatron's TE/Apex notices are filtered


@pytest.mark.parametrize("argv,needles", [
    (["--mock-data", "--eval-iters", "2"],
     ["there is no validation set", "--split", "--eval-iters 0"]),
    (["--data-path", "DATA", "--valid-data-path", "MISSING"],
     ["--valid-data-path", "no dataset at this prefix", "--output-prefix"]),
])
def test_pretrain_gpt_validation_without_a_validation_set(tmp_path, dataset, argv, needles):
    import subprocess
    import sys

    argv = [dataset if a == "DATA" else str(tmp_path / a) if a == "MISSING" else a
            for a in argv]
    proc = subprocess.run([sys.executable, "-m", "megatron.skrull.pretrain_gpt", *TINY,
                           "--train-iters", "2", *argv], env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert_reported(proc.returncode, proc.stderr, 2, *needles, max_lines=1)


def _child_with_rank(parent_pid, rank):
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent_pid and \
                f"RANK={rank}".encode() in environ:
            return int(pid)
    return None


@pytest.mark.multiprocess
def test_sigkill_of_one_rank_under_the_launcher_is_one_line(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    cmd = [sys.executable, "-m", "megatron.skrull.launch", "--standalone", "--nproc-per-node",
           "2", "-m", "megatron.skrull.pretrain_gpt", *TINY, "--mock-data",
           "--train-iters", "100000", "--log-interval", "100000",
           "--save", str(tmp_path / "ckpt"), "--save-interval", "100000"]
    proc = subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        started = proc.stdout.readline()  # rank 0's start line: both ranks train now
        assert " skrull: world 2" in started, started + proc.stderr.read()
        victim = _child_with_rank(proc.pid, 1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    # The launcher names the killed rank; a survivor may first say it lost its peer.
    assert_reported(proc.returncode, err, 1, "rank 1", "SIGKILL", "--load", max_lines=2)
    assert "GLHF" not in err
    assert "ChildFailedError" not in err
