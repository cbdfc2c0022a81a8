"""Scaled-RoPE Hugging Face models through the launcher and back, float64, one 2-rank job.

Tiny random models, one per scaling, with documents (59-184 tokens) longer than the
original context they scale from: Llama with Llama 3.1's ``llama3`` (original 32), Qwen2 with
YaRN x4 (original 64, attention factor 1.139), Qwen3 with ``linear`` x2, and a plain Llama
of context 64 extended by ``--position-embedding-type yarn --rotary-scaling-factor 4``.  The
iteration-1 loss with ``--lr 0`` under CP 2 (long documents sharded over the ring, short ones
local) and under TP 2 with sequence parallelism equals transformers' (float64, 1e-6
relative); ``tools/export_hf.py`` then gives the source tensors bit for bit and a config
from which transformers builds the same RoPE (the extension's config gains the YaRN block).
"""
from __future__ import annotations

import os

import pytest
import torch

from mcore_helpers import spawn
from test_chat_template import CHATML, CONVERSATION, make_template_tokenizer
from test_hf_models import make_hf_model, transformers_loss, write_chat_data

pytestmark = pytest.mark.multiprocess

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
MODELS = {  # name: (config class, config fields (4.x spelling), extra launcher flags)
    "llama3": ("LlamaConfig", dict(tie_word_embeddings=True, rope_theta=10000.0,
                                   rope_scaling=LLAMA3), []),
    "yarn": ("Qwen2Config", dict(tie_word_embeddings=False, rope_theta=1000000.0, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}), []),
    "linear": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=24, rope_scaling={
        "rope_type": "linear", "factor": 2.0}), []),
    "extend": ("LlamaConfig", dict(tie_word_embeddings=True, max_position_embeddings=64),
               ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "4"]),
}
LAYOUTS = {"cp2": ["--context-parallel-size", "2", "--skrull-bucket-size", "128"],
           "tp2sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"]}


def _flags(tmp, name, extra):
    return ["--pretrained-hf", f"{tmp}/{name}", "--seq-length", "200", "--global-batch-size",
            "6", "--lr", "0", "--train-iters", "1", "--skrull-bucket-size", "256", "--fp64",
            "--device", "cpu", "--data-path", f"{tmp}/data", "--tokenizer-type",
            "HFTokenizer", "--tokenizer-model", f"{tmp}/{name}", "--log-interval", "1",
            *MODELS[name][2], *extra]


def _worker(rank, world, tmp):
    from megatron.core import parallel_state as ps
    from megatron.skrull.arguments import parse_args
    from megatron.skrull.cpu_compat import apply_cpu_compat
    from megatron.skrull.pretrain_gpt import run

    apply_cpu_compat("cpu")
    out = {}
    for name in MODELS:
        for layout, flags in LAYOUTS.items():
            save = ["--save", f"{tmp}/ckpt_{name}"] if layout == "cp2" else []
            cfg = parse_args(_flags(tmp, name, [*flags, *save]), world_size=2)
            ps.destroy_model_parallel()
            stats = run(cfg, printer=lambda s: None)[0]
            out[name, layout] = (stats.loss, stats.local_share)
    torch.save(out, os.path.join(tmp, f"out{rank}.pt"))


def _make_model(directory, name, tokenizer_dir):
    import transformers

    cls, extra, _ = MODELS[name]
    config = getattr(transformers, cls).from_dict({**COMMON, **extra})
    return make_hf_model(directory, config, tokenizer_dir)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_rope")
    tok = make_template_tokenizer(str(tmp / "tok"), CHATML)
    for name in MODELS:
        _make_model(str(tmp / name), name, tok)
    write_chat_data(tmp, tok, CONVERSATION * 2)  # 59 to 184 tokens
    spawn(_worker, 2, tmp, timeout=400)
    return tmp, torch.load(tmp / "out0.pt", weights_only=False)


@pytest.mark.parametrize("name", list(MODELS))
def test_first_loss_equals_transformers_at_cp2_and_tp2(job, exported, name):
    from megatron.skrull.data import load_sft_dataset

    tmp, out = job
    data = load_sft_dataset(f"{tmp}/data")
    assert max(len(data.get_example(i).input_ids) for i in range(len(data))) > 2 * 64
    assert 0 < out[name, "cp2"][1] < 1  # the long documents on the ring, the others local
    # The extension's reference is its export: the source config has no scaling.
    ref = transformers_loss(f"{tmp}/data", tmp / (f"out_{name}" if name == "extend" else name),
                            torch.float64)
    for layout in LAYOUTS:
        assert out[name, layout][0] == pytest.approx(ref, rel=1e-6), layout
    if name == "extend":  # the scaling does change the loss
        assert abs(transformers_loss(f"{tmp}/data", tmp / name, torch.float64) - ref) > 1e-4


@pytest.fixture(scope="module")
def exported(job):
    from megatron.skrull.hf.export import main as export_main

    tmp = job[0]
    for name in MODELS:
        assert export_main(["--load", str(tmp / f"ckpt_{name}"), "--output",
                            str(tmp / f"out_{name}")]) == 0
    return tmp


@pytest.mark.parametrize("name", list(MODELS))
def test_export_bit_equal_with_the_same_rope(exported, name):
    import transformers
    from safetensors.torch import load_file

    tmp = exported
    src = load_file(str(tmp / name / "model.safetensors"))
    got = load_file(str(tmp / f"out_{name}" / "model.safetensors"))
    assert sorted(got) == sorted(src)
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in src.items())
    rope = {}
    for d in (name, f"out_{name}"):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp / d))
        emb = model.model.rotary_emb
        rope[d] = (emb.inv_freq, emb.attention_scaling, model.config.rope_parameters)
    if name == "extend":  # the YaRN the run added, on the plain model's original context
        assert rope[f"out_{name}"][2]["rope_type"] == "yarn"
        assert rope[f"out_{name}"][2]["original_max_position_embeddings"] == 64
        assert rope[f"out_{name}"][1] == pytest.approx(1 + 0.1 * torch.log(torch.tensor(4.)))
    else:
        assert torch.equal(rope[name][0], rope[f"out_{name}"][0])
        assert rope[name][1:] == rope[f"out_{name}"][1:]
