"""The launcher's cost model: hardware presets, the JSON override, CPU planning decisions,
the shipped GPU preset."""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import numpy as np
import pytest

from megatron.skrull.arguments import parse_args
from megatron.skrull.batch_schedule import build_cost_model, make_batch_scheduler, model_spec
from megatron.skrull.data import GlobalBatchSampler
from megatron.skrull.pretrain_gpt import build_sample_source
from skrull_ext.scheduler import predict
from skrull_ext.costmodel.hardware import CPU, H100

from mcore_helpers import tiny_config

# The end-to-end CPU demo's shape (benchmarks/bench_e2e_cpu.py): 2 layers, hidden 256,
# 4 heads / 2 KV groups, 16K-token samples, bucket 12288 per rank, CP = 2.
DEMO = ["--hidden-size", "256", "--seq-length", "16384", "--max-position-embeddings", "16384",
        "--skrull-bucket-size", "12288", "--context-parallel-size", "2"]
VOCAB = 384
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cpu_runs_use_the_cpu_preset_with_the_run_dtype():
    cfg = tiny_config(DEMO, world_size=2)
    cost = build_cost_model(cfg, VOCAB)
    want = CPU.cost_model(model_spec(cfg, VOCAB), 2, 1)
    assert cost.time == want.time and cost.comm == want.comm
    assert cost.bytes_per_element == 4
    assert build_cost_model(tiny_config(DEMO + ["--fp64"], world_size=2), VOCAB
                            ).bytes_per_element == 8
    h100 = build_cost_model(tiny_config(DEMO + ["--skrull-hardware", "h100"], world_size=2),
                            VOCAB)
    assert h100.time == H100.cost_model(model_spec(cfg, VOCAB), 2, 1).time
    assert h100.bytes_per_element == 2
    assert cost.objective == "ring"  # the default
    paper = tiny_config(DEMO + ["--skrull-objective", "paper"], world_size=2)
    assert build_cost_model(paper, VOCAB).objective == "paper"


def test_config_file_overrides_every_time_key(tmp_path):
    path = tmp_path / "cost.json"
    values = {"c_linear": 1e-11, "c_attention": 2e-11, "micro_batch_overhead": 0.5,
              "attention_half_tokens": 128.0, "attention_call_overhead": 3e-4,
              "iteration_overhead": 0.25, "bytes_per_element": 2,
              "comm_sizes_bytes": [1024, 2048], "comm_seconds": [1e-5, 2e-5]}
    path.write_text(json.dumps(values))
    cost = build_cost_model(tiny_config(DEMO + ["--skrull-cost-model-config", str(path)],
                                        world_size=2), VOCAB)
    for key in ("c_linear", "c_attention", "micro_batch_overhead", "attention_half_tokens",
                "attention_call_overhead", "iteration_overhead"):
        assert getattr(cost.time, key) == values[key], key
    assert cost.comm.sizes_bytes == (1024, 2048) and cost.bytes_per_element == 2
    # Keys left out keep the preset's values.
    path.write_text(json.dumps({"attention_call_overhead": 1e-3}))
    partial = build_cost_model(tiny_config(DEMO + ["--skrull-cost-model-config", str(path)],
                                           world_size=2), VOCAB)
    preset = build_cost_model(tiny_config(DEMO, world_size=2), VOCAB)
    assert partial.time == dataclasses.replace(preset.time, attention_call_overhead=1e-3)


@pytest.mark.parametrize("content, match", [
    ({"attention_half": 1.0}, "unknown keys"),
    ({"comm_seconds": [1e-5, 2e-5]}, "go together"),
    ({"attention_half_tokens": -1.0}, ">= 0"),
    ([1, 2], "JSON object"),
])
def test_bad_config_files_name_the_problem(tmp_path, content, match):
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(content))
    cfg = tiny_config(DEMO + ["--skrull-cost-model-config", str(path)], world_size=2)
    with pytest.raises(ValueError, match=match):
        build_cost_model(cfg, VOCAB)


def _long_tail_batch(seed: int) -> np.ndarray:
    """32 lengths: one 11K-token sample, a few of 1-3K, the rest under 512."""
    rng = np.random.default_rng(seed)
    short = rng.integers(20, 512, size=27)
    return np.concatenate([[11000, 2900, 1700, 1200, 800], short]).astype(np.int64)


def test_cpu_batch_scheduler_keeps_short_sequences_local_on_a_long_tail_batch():
    """Regression: the old CPU guesses made distributing look free (0% local tokens)."""
    batch_scheduler = make_batch_scheduler(tiny_config(DEMO, world_size=2), VOCAB)
    # Without the local search (budget 0) the placement itself keeps every short sample
    # local; the search may then distribute one where the model predicts a gain.
    placement_only = make_batch_scheduler(
        tiny_config(DEMO + ["--skrull-plan-budget-ms", "0"], world_size=2), VOCAB)
    for seed in range(3):
        lengths = _long_tail_batch(seed)
        short = set(np.flatnonzero(lengths < 512).tolist())
        placed = placement_only(lengths)
        local = {i for mb in placed.dp_ranks[0] for rank in mb.local for i in rank}
        assert short <= local, f"short samples distributed: {sorted(short - local)}"
        plan = batch_scheduler(lengths)
        dist = {i for mb in plan.dp_ranks[0] for i in mb.distributed}
        assert 0 in dist  # the 11K-token sample is split over both ranks
        assert plan.local_token_share() > 0.3
    # A batch of short samples only needs no ring at all.
    plan = batch_scheduler(np.random.default_rng(7).integers(20, 512, size=32))
    assert plan.local_token_share() == 1.0


# The shipped calibrations: file, its fitted micro-batch overhead (s), the largest held-out
# error its run recorded (H200 2.6%, H100 5.5%), rounded up.
SHIPPED = [("h200_qwen2.5-0.5b_cost_model.json", 0.0899907, 0.05),
           ("h100_qwen2.5-0.5b_cost_model.json", 0.0632451, 0.06)]


@pytest.mark.parametrize("name,overhead,tol", SHIPPED, ids=["h200", "h100"])
def test_shipped_preset_predicts_the_held_out_iterations_it_was_checked_on(name, overhead, tol):
    """A shipped ``examples/configs/*_cost_model.json``, loaded as the launcher loads it,
    plans the held-out batches of the calibration run it came from (the same sampler seed,
    hence the same tokens): its predictions are the ones the run recorded, and within
    ``tol`` of the measured iteration times."""
    preset = os.path.join(ROOT, "examples", "configs", name)
    with open(preset, encoding="utf-8") as f:
        meta = json.load(f)["calibration"]
    with open(os.path.join(ROOT, meta["results"]), encoding="utf-8") as f:
        held_out = json.load(f)["rows"]["validation"]
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from calibrate_gpu import HELD_OUT_SEED
    finally:
        sys.path.pop(0)
    flags = list(meta["launcher_flags"])
    flags[flags.index("--device") + 1] = "cpu"  # plans and predictions need no GPU
    # --skrull-hardware h100 is what --device cuda picks; the file replaces its time terms.
    cfg = parse_args(flags + ["--skrull-hardware", "h100", "--skrull-cost-model-config",
                              preset], world_size=1)
    source = build_sample_source(cfg)
    vocab = cfg.model.padded_vocab_size(cfg.model.vocab_size or source.vocab_size, 1)
    scheduler = make_batch_scheduler(cfg, vocab, cost_model=build_cost_model(cfg, vocab))
    assert scheduler.cost_model.time.micro_batch_overhead == pytest.approx(overhead, rel=1e-5)
    assert scheduler.cost_model.bytes_per_element == 2 and scheduler.refit is None
    sampler = GlobalBatchSampler(len(source), cfg.global_batch_size, HELD_OUT_SEED)
    errors = []
    for i, rec in enumerate(held_out["iterations"]):
        lengths = source.lengths[np.asarray(next(sampler))]
        assert int(lengths.sum()) == rec["tokens"], "not the recorded held-out batch"
        predicted = predict(scheduler(lengths), scheduler.cost_model)["iteration_time"]
        assert predicted == pytest.approx(rec["predicted"], rel=1e-6)  # the run's own plans
        if i >= held_out["skipped_first"]:  # warm-up iterations, left out by the run too
            errors.append(predicted / rec["measured"] - 1)
    assert len(errors) == held_out["summary"]["n"] == 8
    assert max(map(abs, errors)) < tol, errors
