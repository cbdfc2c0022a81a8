"""Smoke test of the end-to-end CPU benchmark and its time split (no timing assertions).

Runs ``benchmarks/bench_e2e_cpu.py`` on one short global batch (~10 s) and checks what its
tables are built from: every policy trained the batch, the timers put the attention of whole
(local) samples and of ring shards in the right parts, the linear-layer hooks measured
something, and no part is counted twice (the remainder ``model_other`` stays >= 0).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_e2e_cpu_runs_and_splits_time(tmp_path):
    out = tmp_path / "e2e.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # Sampler seed 3, batch of 8: 2.5K tokens, longest 1022, so skrull keeps everything local.
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_e2e_cpu.py"), "--iters", "1",
           "--warmup", "0", "--repeats", "1", "--model", "h128", "--seed", "3",
           "--global-batch-size", "8", "--data-dir", str(tmp_path), "--json", str(out),
           "--policies", "skrull", "all-cp", "per-seq-cp", "hybrid-cp",
           "--cost-model-config", os.path.join(ROOT, "examples", "configs",
                                               "tiny_cpu_cost_model.json")]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "time split" in proc.stdout and "tiny_cpu_cost_model.json; load average" in proc.stdout
    summary = json.loads(out.read_text())["summary"]
    assert list(summary) == ["skrull", "all-cp", "per-seq-cp", "hybrid-cp"]
    for policy, row in summary.items():
        split = row["split"]
        assert row["seconds"] > 0
        assert split["linear"] > 0, policy
        assert split["model_other"] >= 0, (policy, split)
        assert all(v >= 0 for v in split.values()), (policy, split)
    skrull, all_cp, per_seq = summary["skrull"], summary["all-cp"], summary["per-seq-cp"]
    assert skrull["local"] == 1.0
    assert skrull["split"]["attn_local"] > 0 and skrull["split"]["attn_ring"] == 0
    assert all_cp["local"] == 0.0
    assert all_cp["split"]["attn_local"] == 0 and all_cp["split"]["attn_ring"] > 0
    assert per_seq["mbs"] == 8  # one sample per micro-batch
    hybrid = summary["hybrid-cp"]  # every sample fits one rank's bucket: all whole
    assert hybrid["local"] == 1.0 and hybrid["split"]["attn_ring"] == 0


def test_passes_run_each_policy_in_training_order_and_rotate_the_blocks():
    """Within a pass every policy runs its iterations in order (a case follows the same
    policy's previous iteration), and over len(policies) passes each policy's block runs
    once at every position of the pass."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from bench_e2e_cpu import schedule_cases

    policies = ("skrull", "all-cp", "kk")
    batches = [None] * 4
    first = {}
    for shift in range(len(policies)):
        order = schedule_cases(batches, 0, policies, shift=shift)
        assert sorted(order) == sorted((i, p) for i in range(4) for p in policies)
        for prev, case in zip(order, order[1:]):
            if case[0] > 0:  # measured iterations: the same policy ran the one before
                assert prev == (case[0] - 1, case[1]), (prev, case)
        blocks = [p for i, p in order if i == 0]
        for pos, p in enumerate(blocks):
            first.setdefault(p, set()).add(pos)
    assert all(positions == {0, 1, 2} for positions in first.values())
