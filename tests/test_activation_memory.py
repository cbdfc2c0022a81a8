"""Activation memory: the memory model's bytes per token next to what autograd really saves.

One spawned process runs the launcher's tiny model on CPU twice: fp32, one micro-batch's
forward and backward under ``benchmarks/bench_memory.py``'s ``SavedTensorPeak`` (peak live
saved-for-backward bytes, recomputed tensors included) with ``--recompute-granularity``
none, selective and full; and ``benchmarks/memory_breakdown.py`` (bf16), which walks the
autograd graph tensor by tensor.  On CPU torch's RMSNorm is its composite (the model's
``norm="composite"``) and the meters see saved tensors only (the model's ``saved`` terms).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys

import pytest
import torch

from skrull_ext.costmodel.activations import SAVED
from skrull_ext.costmodel.memory import TrainingMemory
from skrull_ext.costmodel.model import MODEL_PRESETS

from mcore_helpers import spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECOMPUTE = {"none": [], "selective": ["--recompute-granularity", "selective"],
             "full": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                      "--recompute-num-layers", "1"]}


def _measure(rank, world, tmp):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import memory_breakdown
    from bench_memory import measure_activations, spec_of
    from megatron.core import parallel_state
    from megatron.skrull.cpu_compat import apply_cpu_compat
    from megatron.skrull.pretrain_gpt import build_trainer, init_model_parallel

    from mcore_helpers import tiny_config

    cpu = torch.device("cpu")
    apply_cpu_compat(cpu)
    out = {}
    for name, flags in RECOMPUTE.items():
        cfg = tiny_config(flags)
        parallel_state.destroy_model_parallel()
        init_model_parallel(cfg, cpu)
        trainer = build_trainer(cfg, cpu)
        peak, tokens = measure_activations(trainer)
        spec = spec_of(cfg, trainer.model.module.vocab_size)
        predicted = TrainingMemory(precision="fp32", norm="composite",
                                   recompute=None if name == "none" else name)
        out[name] = {"measured": peak / tokens,
                     "predicted": predicted.activation_bytes_per_token(spec, kinds=(SAVED,))}
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()  # the breakdown sets up its own
    os.environ["SKRULL_RESULTS_DIR"] = ""  # this process: the breakdown records nothing
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        memory_breakdown.main(["--device", "cpu", "--tokens", "150", "300", "--json",
                               os.path.join(tmp, "breakdown.json"), "--time-budget-s", "200",
                               "--mock-num-samples", "64"])
    out["stdout"] = log.getvalue()
    with open(os.path.join(tmp, "act.json"), "w") as f:
        json.dump(out, f)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("activations")
    spawn(_measure, 1, tmp, timeout=300)
    return (json.loads((tmp / "act.json").read_text()),
            json.loads((tmp / "breakdown.json").read_text()))


@pytest.mark.multiprocess
def test_activation_prediction_against_saved_tensors(measured):
    out = measured[0]
    for name in RECOMPUTE:
        # Every saved tensor is a term of the model (CPU: composite RMSNorm, fp32).
        assert out[name]["measured"] == pytest.approx(out[name]["predicted"], rel=0.005), name
    none, sel, full = (out[k]["measured"] for k in RECOMPUTE)
    # Full recompute keeps layer inputs (and one recomputed layer in backward).
    assert full < 0.6 * none
    # Selective recomputes core attention: only its few own saved tensors go.
    assert 0.9 * none < sel < none


@pytest.mark.multiprocess
def test_breakdown_walks_the_graph_tensor_by_tensor(measured):
    report = measured[1]
    assert [s["recompute"] for s in report["settings"]] == list(RECOMPUTE)
    assert not report["budget"]["skipped"]
    for s in report["settings"]:
        got, model = s["measured"]["totals"], s["model"]["totals"]
        # Saved bytes per token, one layer and outside the layers: each storage once.
        assert got["layer"] == pytest.approx(model["layer"], rel=1e-6), s["recompute"]
        # Outside: the micro-batch's buffer also holds the layout's attention metadata
        # (cu_seqlens, index tensors: under 1 KiB a micro-batch, not per token).
        assert got["outside"] == pytest.approx(model["outside"], abs=1024 / s["tokens"])
        shared = [r for r in s["measured"]["rows"] if r["scope"] == "(shared by the layers)"]
        assert bool(shared) == (s["recompute"] == "none"), s["recompute"]  # RoPE cos, sin
        assert len(s["peaks"]) == 2 and s["peaks"][0]["tokens"] < s["peaks"][1]["tokens"]
        assert s["peak_bytes_per_token"] == pytest.approx(s["peak_model"], rel=0.005)
        rows = {(r["where"], r["nodes"]) for r in s["measured"]["rows"]}
        assert ("outside", "_VocabParallelCrossEntropyBackward") in rows
    nodes = [{r["nodes"] for r in s["measured"]["rows"] if r["where"] == "layer"}
             for s in report["settings"]]
    assert any("_DACPAttentionBackward" in n for n in nodes[0])
    assert "CheckpointFunctionBackward" in nodes[1] and not any("_DACP" in n for n in nodes[1])
    assert nodes[2] == {"CheckpointFunctionBackward"}  # full: the layer inputs only
    assert "saved per layer  : measured" in measured[0]["stdout"]


def test_sequence_parallel_splits_layer_activations():
    q7 = MODEL_PRESETS["qwen2.5-7b"]  # 4 KV groups: TP 4 keeps one group per rank
    for recompute in (None, "selective", "full"):
        tp = TrainingMemory(precision="bf16", tp_size=4, recompute=recompute)
        sp = TrainingMemory(precision="bf16", tp_size=4, recompute=recompute,
                            sequence_parallel=True)
        assert sp.logits_bytes_per_token(q7) == tp.logits_bytes_per_token(q7)  # gathered
        # SP splits what lies between the TP regions: the norms' tensors (the linear
        # layers keep their un-gathered input) and the layer inputs full recompute keeps.
        for a, b in zip(tp.layer_terms(q7) + tp.outside_terms(q7),
                        sp.layer_terms(q7) + sp.outside_terms(q7), strict=True):
            split = "layernorm" in a.name or "layer input" in a.name
            assert b.bytes_per_token == pytest.approx(a.bytes_per_token / (4 if split else 1))
        assert sp.activation_bytes_per_token(q7) < tp.activation_bytes_per_token(q7)
    # TP splits the heads and the MLP, not the norms (without SP) nor RoPE's cos/sin tables.
    one, tp = TrainingMemory(precision="bf16"), TrainingMemory(precision="bf16", tp_size=4)
    for a, b in zip(one.layer_terms(q7), tp.layer_terms(q7), strict=True):
        whole = "layernorm" in a.name or "RoPE cos" in a.name
        assert b.bytes_per_token == pytest.approx(a.bytes_per_token / (1 if whole else 4))
    # Fewer KV groups than TP ranks: mcore gathers the QKV output whole on every rank.
    tp8 = {t.name: t.bytes_per_token for t in
           TrainingMemory(precision="bf16", tp_size=8).layer_terms(q7)}
    assert tp8["QKV output [T, h + 2 h_kv] (the value view keeps it)"] == \
        2 * (q7.hidden_size + 2 * q7.kv_hidden_size)
    assert tp8["key after RoPE (DACP input)"] == 2 * q7.head_dim
    # SP is off at TP 1 (as Megatron): nothing to split.
    assert TrainingMemory(sequence_parallel=True).activation_bytes_per_token(q7) == \
        TrainingMemory().activation_bytes_per_token(q7)
