"""Flags -> frozen RunConfig; every bad combination gives exactly one clear message."""
from __future__ import annotations

import dataclasses

import pytest

from megatron.skrull.arguments import ConfigError, parse_args
from megatron.skrull.pretrain_gpt import main

from mcore_helpers import TINY_FLAGS, drop_flag, tiny_config


def _problems(extra, world_size=1):
    with pytest.raises(ConfigError) as info:
        tiny_config(extra, world_size=world_size)
    return info.value.problems


def test_valid_flags_build_a_frozen_config():
    cfg = tiny_config(["--context-parallel-size", "2", "--tensor-model-parallel-size", "1",
                       "--seq-length", "500", "--max-position-embeddings", "512"], world_size=4)
    assert cfg.parallel.dp_size == 2
    assert cfg.model.query_groups == 2 and cfg.model.head_dim == 16
    assert cfg.model.ffn_size == 128  # SwiGLU default: 2/3 of 4h, rounded down to 64
    assert cfg.model.padded_vocab_size(100, 2) == 256
    assert cfg.data.use_mock and cfg.skrull.scheduler == "skrull"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seq_length = 1  # type: ignore[misc]


@pytest.mark.parametrize("extra, world, needles", [
    (["--context-parallel-size", "2"], 3, ["--context-parallel-size 2", "world size 3"]),
    (["--context-parallel-size", "2", "--skrull-bucket-size", "3"], 2,
     ["--skrull-bucket-size 3", "at least 4"]),
    (["--context-parallel-size", "2", "--seq-length", "600", "--max-position-embeddings",
      "600"], 2, ["--seq-length 600", "--skrull-bucket-size 256"]),
    (["--num-query-groups", "3"], 1, ["--num-query-groups 3", "divisor"]),
    (["--max-position-embeddings", "64"], 1, ["--max-position-embeddings 64", "at least 96"]),
    (["--tensor-model-parallel-size", "2", "--num-query-groups", "1"], 2,
     ["--tensor-model-parallel-size 2"]),
    (["--min-lr", "1.0"], 1, ["--min-lr"]),
    (["--lr-warmup-iters", "50"], 1, ["--lr-warmup-iters 50"]),
    (["--mock-data", "--data-path", "x"], 1, ["exclusive"]),
    (["--skrull-cost-model-config", "/nonexistent.json"], 1, ["no such file"]),
    (["--hidden-size", "66"], 1, ["--hidden-size 66", "--num-attention-heads 4"]),
    (["--bf16", "--fp64"], 1, ["--fp64 and --bf16 conflict"]),
    (["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "3"], 1, ["--recompute-num-layers 3", "--num-layers 2"]),
    (["--recompute-granularity", "full"], 1, ["--recompute-method uniform or block"]),
    (["--recompute-method", "block"], 1, ["--recompute-granularity full"]),
    (["--override-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"], 1,
     ["--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler", "pick one"]),
    (["--max-seqlen-per-dp-cp-rank", "128"], 1,
     ["--skrull-bucket-size 256 and --max-seqlen-per-dp-cp-rank 128", "keep one"]),
    (["--hybrid-context-parallel"], 1, ["needs --max-seqlen-per-dp-cp-rank"]),
    (["--hybrid-context-parallel", "--max-seqlen-per-dp-cp-rank", "256",
      "--pipeline-model-parallel-size", "2"], 2, ["pipeline parallelism"]),
    (["--hybrid-context-parallel", "--dynamic-context-parallel",
      "--max-seqlen-per-dp-cp-rank", "256"], 1, ["keep --dynamic-context-parallel"]),
    (["--dynamic-context-parallel", "--sequence-packing-scheduler", "dp_balanced",
      "--max-seqlen-per-dp-cp-rank", "256"], 1, ["default_dynamic_cp", "got dp_balanced"]),
    (["--sequence-packing-scheduler", "default_dynamic_cp"], 1,
     ["needs --dynamic-context-parallel"]),
    (["--dynamic-context-parallel"], 1,
     ["--dynamic-context-parallel needs --max-seqlen-per-dp-cp-rank"]),
    (["--dynamic-context-parallel", "--max-seqlen-per-dp-cp-rank", "256",
      "--min-dynamic-context-parallel-size", "2"], 1, ["only Megatron's default 1"]),
    (["--overlap-param-gather", "--context-parallel-size", "2"], 2,
     ["--use-distributed-optimizer"]),
    (["--attention-dropout", "0.1"], 1, ["--attention-dropout 0"]),
])
def test_each_bad_flag_gives_one_clear_message(extra, world, needles):
    problems = _problems(extra, world)
    assert len(problems) == 1, problems
    for needle in needles:
        assert needle in problems[0], problems


def test_hybrid_cp_with_cp_sub_groups_is_accepted():
    """CP 4 hybrid CP places samples on 2-rank sub-groups, which the DACP attention runs."""
    cfg = tiny_config(["--skrull-scheduler", "hybrid-cp", "--context-parallel-size", "4"],
                      world_size=4)
    assert cfg.skrull.scheduler == "hybrid-cp" and cfg.parallel.context_parallel_size == 4


def test_distributed_optimizer_runs_at_dp_cp_one():
    """Megatron runs --use-distributed-optimizer with nothing to shard over (DP x CP = 1)."""
    assert tiny_config(["--use-distributed-optimizer"]).optim.use_distributed_optimizer
    tp2 = tiny_config(["--use-distributed-optimizer", "--tensor-model-parallel-size", "2"], 2)
    assert tp2.parallel.dp_size * tp2.parallel.context_parallel_size == 1


def _without_bucket(extra, world_size):
    return parse_args(drop_flag(TINY_FLAGS, "--skrull-bucket-size") + list(extra),
                      world_size=world_size)


def test_megatron_hybrid_context_parallel_flags():
    """--hybrid-context-parallel: Megatron's DP x CP pool becomes one CP group run by the
    hybrid-cp policy with --max-seqlen-per-dp-cp-rank tokens per rank; --skrull-scheduler
    skrull (the one flag a user changes) plans the same pool with Skrull."""
    hybrid = ["--hybrid-context-parallel", "--max-seqlen-per-dp-cp-rank", "64"]
    for cp in ("1", "2"):  # Megatron runs hybrid CP at CP 1 too: the pool is DP x CP
        cfg = _without_bucket(hybrid + ["--context-parallel-size", cp], 4)
        assert (cfg.parallel.dp_size, cfg.parallel.context_parallel_size) == (1, 4)
        assert cfg.parallel.hybrid_context_parallel
        assert (cfg.skrull.scheduler, cfg.skrull.bucket_size) == ("hybrid-cp", 64)
    tp2 = _without_bucket(hybrid + ["--tensor-model-parallel-size", "2"], 4)
    assert (tp2.parallel.dp_size, tp2.parallel.context_parallel_size) == (1, 2)
    skrull = _without_bucket(hybrid + ["--skrull-scheduler", "skrull"], 4)
    assert (skrull.skrull.scheduler, skrull.parallel.context_parallel_size) == ("skrull", 4)
    # Without the flag, --max-seqlen-per-dp-cp-rank is the bucket of any policy and layout.
    plain = _without_bucket(["--max-seqlen-per-dp-cp-rank", "64",
                             "--context-parallel-size", "2"], 4)
    assert (plain.parallel.dp_size, plain.skrull.scheduler, plain.skrull.bucket_size) == (
        2, "skrull", 64)
    with pytest.raises(ConfigError) as info:
        _without_bucket([], 1)
    assert len(info.value.problems) == 1
    assert "--skrull-bucket-size N is required" in info.value.problems[0]


def test_megatron_dev_dynamic_context_parallel_flags():
    """Megatron-LM dev's names: --dynamic-context-parallel is the hybrid-CP pool run by
    its DefaultDynamicCPScheduler (dynamic-cp); --sequence-packing-scheduler dp_balanced
    keeps the layout and packs as its DpBalancedScheduler (dp-balanced)."""
    dynamic = ["--dynamic-context-parallel", "--max-seqlen-per-dp-cp-rank", "64"]
    for extra in ([], ["--sequence-packing-scheduler", "default_dynamic_cp"],
                  ["--min-dynamic-context-parallel-size", "1"]):
        cfg = _without_bucket(dynamic + extra + ["--context-parallel-size", "2"], 4)
        assert (cfg.parallel.dp_size, cfg.parallel.context_parallel_size) == (1, 4)
        assert cfg.parallel.hybrid_context_parallel
        assert (cfg.skrull.scheduler, cfg.skrull.bucket_size) == ("dynamic-cp", 64)
    skrull = _without_bucket(dynamic + ["--skrull-scheduler", "skrull"], 4)
    assert (skrull.skrull.scheduler, skrull.parallel.context_parallel_size) == ("skrull", 4)
    packed = _without_bucket(["--sequence-packing-scheduler", "dp_balanced",
                              "--max-seqlen-per-dp-cp-rank", "64",
                              "--context-parallel-size", "2"], 4)
    assert not packed.parallel.hybrid_context_parallel
    assert (packed.parallel.dp_size, packed.parallel.context_parallel_size,
            packed.skrull.scheduler, packed.skrull.bucket_size) == (2, 2, "dp-balanced", 64)


def test_save_interval_without_save_is_a_note_as_in_megatron():
    """Megatron's example scripts pass --save-interval 1000000 alone (never save)."""
    cfg = tiny_config(["--save-interval", "5"])
    assert cfg.checkpoint.save is None
    assert any("--save-interval 5 without --save: no checkpoints" in n for n in cfg.run.notes)
    assert not any("--save-interval" in n for n in tiny_config(
        ["--save-interval", "5", "--save", "/tmp/x"]).run.notes)


def test_several_problems_are_all_reported():
    problems = _problems(["--num-query-groups", "3", "--min-lr", "1.0", "--log-interval", "0",
                          "--context-parallel-size", "2"], world_size=3)
    assert len(problems) == 4, problems


def test_launcher_exits_2_with_one_line_per_problem(capsys):
    code = main(TINY_FLAGS + ["--num-query-groups", "3", "--min-lr", "1.0"])
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("error: --") for line in lines), lines


def test_launcher_missing_required_flag_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(["--num-layers", "2"])
    assert info.value.code == 2
    assert "required" in capsys.readouterr().err


def test_megatron_stack_flags():
    cfg = tiny_config(["--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce",
                       "--recompute-granularity", "selective", "--micro-batch-size", "4",
                       "--exit-interval", "5", "--context-parallel-size", "2"], world_size=2)
    assert cfg.params_dtype.is_floating_point and str(cfg.params_dtype) == "torch.bfloat16"
    assert cfg.optim.use_distributed_optimizer and cfg.optim.overlap_grad_reduce
    assert cfg.recompute.recompute_granularity == "selective"
    assert (cfg.micro_batch_size, cfg.exit_interval) == (4, 5)


def test_conflicting_precision_exits_2_with_one_line(capsys):
    assert main(TINY_FLAGS + ["--bf16", "--fp64"]) == 2
    errors = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "pick one precision" in errors[0]


def test_sequence_parallel_needs_tensor_parallelism():
    # Megatron disables --sequence-parallel at TP 1 (the launcher logs a warning).
    assert tiny_sp(["--tensor-model-parallel-size", "2"], 2).sequence_parallel_active
    off = tiny_sp([], 1)
    assert off.sequence_parallel and not off.sequence_parallel_active


def tiny_sp(extra, world):
    from mcore_helpers import tiny_config

    return tiny_config(["--sequence-parallel", *extra], world_size=world)
