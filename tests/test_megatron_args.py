"""Every Megatron-LM argument is implemented, accepted or refused (in-process, fast).

The names and value kinds are Megatron-LM's (megatron/skrull/megatron_lm_arguments.txt,
written by tools/dump_megatron_lm_args.py from the commit in its header).
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import math
import os

import pytest
import torch

from megatron.skrull import megatron_args as ma
from megatron.skrull.arguments import ConfigError, parse_args
from megatron.skrull.flags import build_parser
from megatron.skrull.pretrain_gpt import main

from mcore_helpers import TINY_FLAGS, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Implemented flags whose values this stack takes differently from Megatron-LM's parser
# (a list where Megatron-LM also takes none; one dataset prefix).
KNOWN_ARITY = {"--data-path": ("str*", "+"), "--valid-data-path": ("str*", "+"),
               "--train-data-path": ("str*", "+")}


def _sample_value(kind: str) -> list[str]:
    """A valid command-line value for a Megatron-LM value kind (``flag`` -> none)."""
    if kind == "flag":
        return []
    kw = ma.parse_kind(kind)
    value = str(kw["choices"][0]) if "choices" in kw else {int: "3", float: "0.5",
                                                           str: "x"}[kw["type"]]
    return [value] * (kw["nargs"] if isinstance(kw.get("nargs"), int) else 1)


def _argv(names) -> list[str]:
    kinds = ma.megatron_kinds()
    return [tok for n in names for tok in [n, *_sample_value(kinds[n])]]


def test_header_names_the_commit_and_every_name_is_megatrons():
    with open(ma.ARGUMENTS_FILE) as f:
        assert ma.MEGATRON_LM_COMMIT in f.readline()
    kinds = ma.megatron_kinds()
    assert len(kinds) > 800
    listed = [n for rows in (ma.ACCEPTED, ma.REFUSED) for _, names in rows
              for n in names.split()]
    assert [n for n, c in collections.Counter(listed).items() if c > 1] == []
    assert [n for n in listed if n not in kinds] == []  # no typo in the tables


def test_every_megatron_name_falls_in_exactly_one_kind():
    implemented = ma.implemented_names(build_parser())
    table = ma.classified()
    kinds_of = {n: [k for k, member in (("implemented", n in implemented), ("table", n in table))
                    if member] for n in ma.megatron_kinds()}
    assert {n: k for n, k in kinds_of.items() if len(k) != 1} == {}


def test_registered_flags_take_megatrons_value_kinds():
    parser, kinds = build_parser(), ma.megatron_kinds()
    for name, (kind, _) in ma.classified().items():
        action = parser._option_string_actions[name]
        want = ma.parse_kind(kinds[name])
        if kinds[name] == "flag":
            assert action.nargs == 0, name
        else:
            assert (action.type, action.nargs, action.choices) == (
                want["type"], want.get("nargs"), want.get("choices")), name
    for name in ma.implemented_names(parser) & set(kinds):  # our own flags: same arity
        action = parser._option_string_actions[name]
        ours = "flag" if action.nargs == 0 else action.nargs
        theirs = "flag" if kinds[name] == "flag" else ma.parse_kind(kinds[name]).get("nargs")
        assert ours == theirs or KNOWN_ARITY.get(name) == (kinds[name], ours), name


def test_all_accepted_flags_at_once_parse_and_are_noted():
    accepted = [n for n, (k, _) in ma.classified().items() if k == "accepted"]
    cfg = tiny_config(_argv(accepted))
    noted = " ".join(cfg.run.notes)
    assert [n for n in accepted if n + "," not in noted + "," and n + ":" not in noted] == []
    reasons = {r for r, _ in ma.ACCEPTED}
    assert len([n for n in cfg.run.notes if n.startswith("accepted")]) == len(reasons)


def test_every_refused_flag_is_one_problem():
    refused = [n for n, (k, _) in ma.classified().items() if k == "refused"]
    with pytest.raises(ConfigError) as info:
        tiny_config(_argv(refused))
    assert len(info.value.problems) == len(refused)
    assert all(p.startswith(n + ": ") for p, n in zip(info.value.problems, refused))
    assert "(use --micro-batch-size)" in " ".join(info.value.problems)  # --batch-size


@pytest.mark.parametrize("extra, needle", [
    (["--num-experts", "8"], "--num-experts: mixture of experts is not supported"),
    (["--fp8-format", "hybrid"], "Transformer Engine"),
    (["--no-masked-softmax-fusionn"], "unrecognized arguments: --no-masked-softmax-fusionn"),
    (["--exit-duration-in-min", "5"], "unrecognized arguments"),  # no abbreviations
    (["--exit-duration-in-mins", "soon"], "invalid int value"),
    (["--empty-unused-memory-level", "3"], "invalid choice"),
    (["--no-masked-softmax-fusion", "1"], "unrecognized arguments: 1"),
    (["--transformer-impl", "inference_optimized"], "invalid choice"),
])
def test_bad_megatron_flag_is_one_line_exit_2(capsys, extra, needle):
    assert main(TINY_FLAGS + extra) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and needle in err[0], err


def test_megatron_value_kinds_parse():
    cfg = tiny_config(["--exit-duration-in-mins", "235", "--empty-unused-memory-level", "1",
                       "--no-masked-softmax-fusion"])
    assert cfg.run.exit_duration_in_mins == 235
    ns = build_parser().parse_args(TINY_FLAGS + ["--hierarchical-context-parallel-sizes", "2",
                                                 "2", "--exit-signal", "SIGUSR1"])
    assert getattr(ns, ma.dest("--hierarchical-context-parallel-sizes")) == [2, 2]
    assert ns.exit_signal == "SIGUSR1"
    with pytest.raises(SystemExit):
        build_parser().parse_args(TINY_FLAGS + ["--rampup-batch-size", "16", "16"])  # 3 ints


def test_docs_page_is_current():
    spec = importlib.util.spec_from_file_location(
        "megatron_flags_doc", os.path.join(ROOT, "tools", "megatron_flags_doc.py"))
    doc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(doc)
    with open(doc.PAGE) as f:
        assert f.read() == doc.current(), "run python tools/megatron_flags_doc.py"
    assert len(doc.current().splitlines()) < 400


@pytest.mark.parametrize("extra, megatron", [
    # --train-samples 40 at GBS 6: 6 iterations; decay 30 samples, warmup 7 samples.
    (["--train-samples", "40", "--lr-decay-samples", "30", "--lr-warmup-samples", "7",
      "--lr-decay-style", "cosine"], dict(warmup=7, decay=30, iters=6)),
    # --lr-warmup-fraction of the decay steps (Megatron-LM's GPT-3 script's flag).
    (["--train-iters", "8", "--lr-decay-iters", "6", "--lr-warmup-fraction", "0.25"],
     dict(warmup=0.25 * 6 * 6, decay=6 * 6, iters=8)),
    (["--train-samples", "40", "--lr-warmup-fraction", "0.1"],
     dict(warmup=4.0, decay=40, iters=6)),
])
def test_sample_based_schedule_is_megatrons(extra, megatron):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron.skrull.optimizer import build_scheduler

    argv = [a for a in TINY_FLAGS] + extra
    if "--train-samples" in extra:
        i = argv.index("--train-iters")
        del argv[i:i + 2]
    cfg = parse_args(argv)
    assert cfg.optim.train_iters == megatron["iters"]
    ours = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    theirs = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    sched = build_scheduler(ours, cfg.optim)
    ref = OptimizerParamScheduler(  # Megatron-LM: steps are samples, +GBS per iteration
        theirs, init_lr=0.0, max_lr=cfg.optim.lr, min_lr=cfg.optim.min_lr,
        lr_warmup_steps=megatron["warmup"], lr_decay_steps=megatron["decay"],
        lr_decay_style=cfg.optim.lr_decay_style, start_wd=0.01, end_wd=0.01,
        wd_incr_steps=1, wd_incr_style="constant")
    for _ in range(megatron["iters"] + 2):
        assert math.isclose(ours.param_groups[0]["lr"], theirs.param_groups[0]["lr"],
                            rel_tol=1e-12, abs_tol=1e-15)
        sched.step(increment=1)
        ref.step(increment=cfg.global_batch_size)


@pytest.mark.parametrize("extra, needle", [
    (["--train-samples", "40"], "not both"),
    (["--lr-decay-samples", "30"], "--lr-decay-samples needs sample-based training"),
    (["--lr-warmup-iters", "2", "--lr-warmup-fraction", "0.1"], "one of --lr-warmup-fraction"),
    (["--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction must be in [0, 1]"),
    (["--wandb-project", "p"], "--wandb-exp-name"),
    (["--padded-vocab-size", "99", "--tensor-model-parallel-size", "2"],
     "--padded-vocab-size 99 is not divisible"),
])
def test_megatron_run_flag_problems(extra, needle):
    world = 2 if "--tensor-model-parallel-size" in extra else 1
    with pytest.raises(ConfigError) as info:
        tiny_config(extra, world_size=world)
    assert any(needle in p for p in info.value.problems), info.value.problems


def test_samples_with_iteration_flags_are_refused():
    argv = [a for a in TINY_FLAGS]
    i = argv.index("--train-iters")
    del argv[i:i + 2]
    with pytest.raises(ConfigError) as info:
        parse_args(argv + ["--train-samples", "40", "--lr-decay-iters", "3"])
    assert info.value.problems == [
        "--lr-decay-iters needs iteration-based training (--train-iters); with "
        "--train-samples use --lr-decay-samples"]
    with pytest.raises(ConfigError) as info:
        parse_args(argv)
    assert "give --train-iters N" in info.value.problems[0]


def test_attention_backend_maps_onto_the_kernel_choice(monkeypatch):
    monkeypatch.delenv("SKRULL_ATTENTION_KERNEL", raising=False)
    cfg = tiny_config(["--attention-backend", "flash"])
    assert cfg.skrull.attention_kernel == "torch"  # CPU: ATen's flash attention
    assert "--attention-backend flash -> --skrull-attention-kernel torch on cpu" in \
        cfg.run.notes[0]
    cfg = tiny_config(["--attention-backend", "flash", "--skrull-attention-kernel", "reference"])
    assert cfg.skrull.attention_kernel == "reference" and "ignored" in cfg.run.notes[0]
    from megatron.skrull.run_args import ATTENTION_BACKEND_KERNELS

    assert {b: k[1] for b, k in ATTENTION_BACKEND_KERNELS.items()} == {
        "auto": "auto", "flash": "flash", "fused": "te", "unfused": "auto", "local": "auto"}


def test_group_query_attention_note():
    assert any("without --group-query-attention" in n for n in tiny_config().run.notes)
    cfg = tiny_config(["--group-query-attention"])
    assert cfg.model.query_groups == 2 and cfg.run.notes == ()


def test_eod_mask_loss_masks_positions_whose_input_is_eod():
    import numpy as np

    from megatron.skrull.run_control import EodMaskedSource
    from megatron.skrull.samples import SyntheticSFTSource

    base = SyntheticSFTSource(8, 32, vocab_size=64, seed=1)
    eod = int(base.sample(0).tokens[5])
    masked = EodMaskedSource(base, eod)
    for i in range(8):
        s, m = base.sample(i), masked.sample(i)
        np.testing.assert_array_equal(m.loss_mask, np.where(s.tokens == eod, 0, s.loss_mask))
        np.testing.assert_array_equal(m.labels, s.labels)
    assert masked.num_loss_tokens(np.arange(8)) < base.num_loss_tokens(np.arange(8))
    assert masked.vocab_size == 64 and list(masked.lengths) == list(base.lengths)


def test_exit_duration_decides_on_elapsed_minutes():
    from megatron.skrull.run_control import ExitDuration

    now = [1000.0]
    exit_fn = ExitDuration(2, torch.device("cpu"), start=1000.0, clock=lambda: now[0])
    trainer = argparse.Namespace(iteration=3)
    now[0] = 1000.0 + 120.0
    assert exit_fn(trainer) is False  # Megatron-LM: strictly more than the limit
    now[0] = 1000.0 + 121.0
    assert exit_fn(trainer) is True


def test_distributed_timeout_reaches_init_process_group(monkeypatch):
    import datetime

    import torch.distributed as dist

    from megatron.skrull import pretrain_gpt

    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: seen.update(kw))
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    pretrain_gpt.init_distributed(torch.device("cpu"), timeout_minutes=60)
    assert seen["timeout"] == datetime.timedelta(minutes=60)
    assert tiny_config(["--distributed-timeout-minutes", "60"]).run.distributed_timeout_minutes \
        == 60


def test_transformer_engine_impl_without_te_is_a_clear_error():
    from megatron.skrull.model import te_layer_spec
    from skrull_ext.attention.choice import te_available

    if te_available():
        pytest.skip("Transformer Engine is installed")
    cfg = tiny_config(["--transformer-impl", "transformer_engine"])
    with pytest.raises(ValueError, match="--transformer-impl local"):
        te_layer_spec(cfg.model)
