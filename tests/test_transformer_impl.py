"""``--transformer-impl transformer_engine`` on CPU, through fake Transformer Engine layers.

One spawned process installs the fakes (tests/fakes/transformer_engine.py for attention,
tests/fakes/transformer_engine_layers.py for mcore's TE layers) before Megatron-Core is
imported, as a GPU machine with TE has them.  A float64 run with the local spec saves at
iteration 2; resuming it with the TE spec (mcore's ``TELayerNormColumnParallelLinear`` /
``TERowParallelLinear`` / ``TENorm`` around our ``SkrullCoreAttention``) trains iterations
3-4 with the local run's losses to 1e-12: the checkpoint keys match and the layers compute
the same thing.  What the fakes cannot show: TE's own kernels (fused norms and GEMMs,
fp8), TP > 1 inside TE layers, and TE on CUDA.
"""
from __future__ import annotations

import json
import os

import pytest

from mcore_helpers import spawn

pytestmark = pytest.mark.multiprocess

FLAGS = ["--fp64", "--lr-warmup-iters", "1", "--train-iters", "4", "--skrull-bucket-size", "128",
         "--qk-layernorm"]


def _trainer(cfg):
    import torch
    from megatron.core import parallel_state

    from megatron.skrull.pretrain_gpt import build_trainer, init_model_parallel

    parallel_state.destroy_model_parallel()
    init_model_parallel(cfg, torch.device("cpu"))
    return build_trainer(cfg, torch.device("cpu"))


def _run(cfg, iters, *, save=None, load=None):
    import dataclasses

    from megatron.skrull import checkpointing as ckpt
    from megatron.skrull.training import train

    trainer = _trainer(cfg)
    meta, desc = ckpt.CheckpointMeta.from_parallel_state(), dataclasses.asdict(cfg)
    if load:
        ckpt.load_checkpoint(load, trainer, meta, desc)
    save_fn = (lambda t: ckpt.save_checkpoint(save, t, meta, desc)) if save else None  # noqa: E731
    losses = [s.loss for s in train(trainer, train_iters=iters, save_fn=save_fn)]
    layer = trainer.model.module.decoder.layers[0]
    kinds = [type(m).__name__ for m in (layer.self_attention.linear_qkv,
                                        layer.self_attention.core_attention,
                                        layer.mlp.linear_fc2,
                                        trainer.model.module.decoder.final_layernorm)]
    return losses, kinds


def _worker(rank, world, tmp):
    import sys

    from fakes import transformer_engine as fake_te
    from fakes import transformer_engine_layers

    assert "megatron.core" not in sys.modules  # mcore binds TE at import time
    sys.modules.update(transformer_engine_layers.modules(fake_te.modules("2.6.0", [])))
    from megatron.skrull.cpu_compat import apply_cpu_compat
    from mcore_helpers import tiny_config

    import torch

    apply_cpu_compat(torch.device("cpu"))
    local = tiny_config(FLAGS)
    te = tiny_config(FLAGS + ["--transformer-impl", "transformer_engine"])
    _run(local, 2, save=f"{tmp}/ckpt")
    out = {"local": _run(local, 4, load=f"{tmp}/ckpt"), "te": _run(te, 4, load=f"{tmp}/ckpt")}
    with open(os.path.join(tmp, "out.json"), "w") as f:
        json.dump(out, f)


def test_te_spec_resumes_a_local_checkpoint_with_the_same_losses(tmp_path):
    spawn(_worker, 1, tmp_path, timeout=300)
    with open(tmp_path / "out.json") as f:
        out = json.load(f)
    (local, local_kinds), (te, te_kinds) = out["local"], out["te"]
    assert te_kinds == ["TELayerNormColumnParallelLinear", "SkrullCoreAttention",
                        "TERowParallelLinear", "RMSNorm"], te_kinds
    assert local_kinds[0] == "ColumnParallelLinear" and local_kinds[2] == "RowParallelLinear"
    assert len(local) == len(te) == 2
    assert te == pytest.approx(local, rel=1e-12, abs=1e-12)
