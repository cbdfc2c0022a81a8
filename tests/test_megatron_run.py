"""Megatron-LM's run-control flags through the launcher, in one spawned process (bf16):

* ``--exit-duration-in-mins``: the program started an hour ago (its start moved back), so
  the run saves and exits after its first iteration, as Megatron-LM;
* ``--wandb-*`` with a fake ``wandb`` (tests/fakes/wandb.py) in ``sys.modules``: one
  offline run in ``SAVE/wandb`` getting the TensorBoard scalars, including
  ``--log-timers-to-tensorboard``'s timers and ``--log-validation-ppl-to-tensorboard``'s PPL;
* ``--no-save-optim --no-save-rng``: the checkpoint has neither; resuming it plainly is one
  error line naming ``--no-load-optim`` (exit 2); with ``--no-load-optim --no-load-rng``
  the fp32 main params follow the loaded bf16 weights (an LR-0 step keeps them exactly;
  before, it wrote the initial weights back).
"""
from __future__ import annotations

import contextlib
import io
import json
import os

import pytest
import torch

from mcore_helpers import TINY_FLAGS, spawn

pytestmark = pytest.mark.multiprocess


def _main(argv):
    from megatron.core import parallel_state

    from megatron.skrull.pretrain_gpt import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    parallel_state.destroy_model_parallel()
    return {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.module.named_parameters()}


def _reload_keeps_weights(ckpt):
    """Loads without optimizer/RNG, steps at LR 0: the weights must stay the loaded ones."""
    from megatron.core import parallel_state

    from megatron.skrull import checkpointing
    from megatron.skrull.arguments import parse_args
    from megatron.skrull.pretrain_gpt import build_trainer, init_distributed, init_model_parallel

    cpu = torch.device("cpu")
    init_distributed(cpu)
    cfg = parse_args(TINY_FLAGS + ["--bf16", "--split", "90,10,0", "--lr", "0", "--min-lr", "0"])
    init_model_parallel(cfg, cpu)
    trainer = build_trainer(cfg, cpu)
    initial = _params(trainer)
    import dataclasses

    meta = checkpointing.CheckpointMeta.from_parallel_state(cpu)
    checkpointing.load_checkpoint(ckpt, trainer, meta, dataclasses.asdict(cfg),
                                  load_optim=False, load_rng=False)
    loaded = _params(trainer)
    trainer.train_step()
    after = _params(trainer)
    parallel_state.destroy_model_parallel()
    return {"changed_by_load": any(not torch.equal(initial[n], loaded[n]) for n in loaded),
            "kept": all(torch.equal(loaded[n], after[n]) for n in loaded)}


def _worker(rank, world, tmp):
    import torch.distributed as dist

    from fakes import wandb as fake_wandb
    from megatron.skrull import run_control

    wandb = fake_wandb.install()
    dist.destroy_process_group()  # main() starts its own, as a launch does
    run_control.PROGRAM_START -= 3600  # the program "started" an hour ago
    ckpt = f"{tmp}/ckpt"
    first = _main(TINY_FLAGS + [
        "--bf16", "--train-iters", "5", "--save", ckpt, "--no-save-optim", "--no-save-rng",
        "--exit-duration-in-mins", "30", "--split", "90,10,0", "--eval-iters", "1",
        "--eval-interval", "1", "--wandb-project", "proj", "--wandb-exp-name", "exp",
        "--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard",
        "--eod-mask-loss"])
    plain = _main(TINY_FLAGS + ["--bf16", "--split", "90,10,0", "--train-iters", "5", "--load",
                                ckpt])
    out = {"first": first, "plain": plain, "wandb": wandb.CALLS,
           "tracker": open(f"{ckpt}/latest_checkpointed_iteration.txt").read(),
           "reload": _reload_keeps_weights(ckpt)}
    with open(os.path.join(tmp, "out.json"), "w") as f:
        json.dump(out, f, default=str)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("megatron_run")
    spawn(_worker, 1, tmp, timeout=300)
    with open(tmp / "out.json") as f:
        return json.load(f), str(tmp)


def test_exit_duration_saves_and_exits_after_the_first_iteration(result):
    out, _ = result
    first = out["first"]
    assert first["rc"] == 0, first["stderr"][-2000:]
    stdout = first["stdout"]
    assert " iteration        1/" in stdout and "iteration        2/" not in stdout
    assert "exiting program after" in first["stderr"] and out["tracker"] == "1"
    assert "--eod-mask-loss: the samples have no EOD token" in first["stderr"]


def test_wandb_gets_the_tensorboard_scalars_offline(result):
    out, tmp = result
    calls = out["wandb"]
    init = [c[1] for c in calls if c[0] == "init"]
    assert init == [{"dir": f"{tmp}/ckpt/wandb", "name": "exp", "project": "proj",
                     "entity": None, "mode": "offline", "config_keys": init[0]["config_keys"]}]
    assert {"model", "optim", "logging"} <= set(init[0]["config_keys"])
    logged = {name: step for c in calls if c[0] == "log" for name in c[1] for step in [c[2]]}
    for name in ("loss", "learning-rate", "forward-backward-time", "optimizer-time",
                 "batch-generator-time", "lm loss validation", "lm loss validation ppl"):
        assert logged.get(name) == 1, (name, logged)
    assert calls[-1] == ["finish"]


def test_checkpoint_without_optimizer_needs_no_load_optim(result):
    out, _ = result
    plain = out["plain"]
    errors = [line for line in plain["stderr"].splitlines() if "error:" in line]
    assert plain["rc"] == 2 and len(errors) == 1, plain["stderr"][-2000:]
    assert "--no-save-optim" in errors[0] and "--no-load-optim" in errors[0]


def test_loading_without_optimizer_keeps_the_loaded_weights(result):
    out, _ = result
    assert out["reload"] == {"changed_by_load": True, "kept": True}
