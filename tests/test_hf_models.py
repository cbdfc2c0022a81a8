"""Hugging Face models in and out: tiny random Llama (GQA, tied) and Qwen2 (q/k/v bias, untied).

Qwen3 (per-head q/k norms, head_dim != hidden/heads) is checked on logits.  Each model is built with transformers in the test, its config vocabulary larger than the
tokenizer's.  One spawned 2-rank gloo job checks: mcore logits after import equal
transformers' (fp32, 1e-5), and the launcher's first-iteration loss with ``--lr 0`` equals
transformers' loss on the same global batch under TP=2 (Qwen2) and CP=2 (Llama).  The
exporter then turns those checkpoints back into Hugging Face directories, bit-identical.
"""
from __future__ import annotations

import json
import os
import re
import warnings

import pytest
import torch

from mcore_helpers import spawn
from test_chat_template import CHATML, CONVERSATION, make_template_tokenizer

pytestmark = pytest.mark.multiprocess

VOCAB = 320  # > the 300-token test tokenizer; divisible by TP = 2
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None)
MODELS = {"llama": ("LlamaConfig", dict(tie_word_embeddings=True, rope_theta=10000.0)),
          "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False, rope_theta=1000000.0)),
          "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True, head_dim=24))}


def make_hf_model(directory: str, kind, tokenizer_dir: str) -> str:
    """A random tiny model saved with save_pretrained (+ the chat tokenizer files).

    ``kind``: a name of :data:`MODELS` or a transformers config.
    """
    import shutil

    import transformers

    if isinstance(kind, str):
        cls, extra = MODELS[kind]
        config = getattr(transformers, cls)(**COMMON, **extra)
    else:
        config = kind
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():  # non-trivial norms and biases (HF initialises them to 1 and 0)
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.2)
                    + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(directory)
    for name in os.listdir(tokenizer_dir):
        if name.startswith("tokenizer") or name.startswith("chat_template"):
            shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(directory, name))
    return directory


def _flags(tmp, kind, extra):
    return ["--pretrained-hf", f"{tmp}/{kind}", "--seq-length", "200", "--global-batch-size",
            "6", "--lr", "0", "--train-iters", "1", "--skrull-bucket-size", "256",
            "--device", "cpu", "--data-path", f"{tmp}/data", "--tokenizer-type",
            "HFTokenizer", "--tokenizer-model", f"{tmp}/{kind}", "--log-interval", "1", *extra]


def _logits(tmp, kind):
    """Packed mcore logits (2 samples, TP = 1) vs transformers' per sample."""
    import transformers
    from megatron.core import parallel_state as ps
    from megatron.skrull.arguments import parse_args
    from megatron.skrull.hf.io import load_pretrained
    from megatron.skrull.model import SkrullPackedSeqParams, build_model
    from megatron.skrull.pretrain_gpt import init_model_parallel
    from skrull_ext.attention.layout import build_rank_layout

    cfg = parse_args(_flags(tmp, kind, []), world_size=2)
    ps.destroy_model_parallel()
    init_model_parallel(cfg, torch.device("cpu"))
    model = build_model(cfg.model, vocab_size=VOCAB)
    load_pretrained(model, f"{tmp}/{kind}", cfg.model)
    gen = torch.Generator().manual_seed(1)
    toks = {0: torch.randint(0, VOCAB, (9,), generator=gen),
            1: torch.randint(0, VOCAB, (23,), generator=gen)}
    layout = build_rank_layout([9, 23], [], [[0, 1]], 0, 1)
    with torch.no_grad():
        ours = model(layout.pack(toks)[None], layout.position_ids[None], None,
                     packed_seq_params=SkrullPackedSeqParams(layout=layout, cp_group=None))
        hf = transformers.AutoModelForCausalLM.from_pretrained(f"{tmp}/{kind}").float()
        ref = torch.cat([hf(toks[i][None]).logits for i in (0, 1)], dim=1)
    return ours, ref


def _launch(tmp, kind, extra):
    """The launcher's run() with --lr 0: first-iteration loss; saves a checkpoint."""
    from megatron.core import parallel_state as ps
    from megatron.skrull.arguments import parse_args
    from megatron.skrull.pretrain_gpt import run

    cfg = parse_args(_flags(tmp, kind, [*extra, "--save", f"{tmp}/ckpt_{kind}"]), world_size=2)
    ps.destroy_model_parallel()
    return run(cfg, printer=lambda s: None)[0].loss


def _worker(rank, world, tmp):
    from megatron.skrull.cpu_compat import apply_cpu_compat

    apply_cpu_compat("cpu")
    out = {"logits": {k: _logits(tmp, k) for k in MODELS},  # qwen3: logits only
           "tp2": _launch(tmp, "qwen2", ["--tensor-model-parallel-size", "2"]),
           "cp2": _launch(tmp, "llama", ["--context-parallel-size", "2"])}
    torch.save(out, os.path.join(tmp, f"out{rank}.pt"))


def _transformers_loss(tmp, kind):
    return transformers_loss(f"{tmp}/data", f"{tmp}/{kind}")


def transformers_loss(data_prefix, model_dir, dtype=torch.float32) -> float:
    """Masked mean token loss of the whole dataset (= the global batch) by transformers."""
    import transformers
    from megatron.skrull.data import load_sft_dataset

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).to(dtype)
    data = load_sft_dataset(data_prefix)
    total, count = 0.0, 0.0
    with torch.no_grad():
        for i in range(len(data)):
            ex = data.get_example(i)
            logits = hf(ex.input_ids[None]).logits[0]
            ce = torch.nn.functional.cross_entropy(logits.double(), ex.labels, reduction="none")
            mask = ex.loss_mask.double()
            total, count = total + float((ce * mask).sum()), count + float(mask.sum())
    return total / count


def write_chat_data(tmp, tok: str, last) -> None:
    """``tmp/data``: six conversations (the last one ``last``) tokenized at --seq-length 200."""
    from megatron.skrull import preprocess

    convs = [CONVERSATION[:2], CONVERSATION, CONVERSATION[2:], CONVERSATION[:2] * 3,
             [{"role": "system", "content": "the lazy dog"}] + CONVERSATION, last]
    (tmp / "chat.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    assert preprocess.main(["--input", str(tmp / "chat.jsonl"), "--output-prefix",
                            str(tmp / "data"), "--tokenizer-type", "HFTokenizer",
                            "--tokenizer-model", tok, "--seq-length", "200"]) == 0


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    tok = make_template_tokenizer(str(tmp / "tok"), CHATML)
    for kind in MODELS:
        make_hf_model(str(tmp / kind), kind, tok)
    write_chat_data(tmp, tok, CONVERSATION[2:] * 2)
    spawn(_worker, 2, tmp, timeout=300)
    return tmp, torch.load(tmp / "out0.pt", weights_only=False)


@pytest.mark.parametrize("kind", list(MODELS))
def test_logits_equal_transformers(job, kind):
    ours, ref = job[1]["logits"][kind]
    assert ours.shape == ref.shape == (1, 32, VOCAB)  # exactly the config vocabulary
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case,kind", [("tp2", "qwen2"), ("cp2", "llama")])
def test_first_loss_equals_transformers(job, case, kind):
    tmp, out = job
    assert out[case] == pytest.approx(_transformers_loss(tmp, kind), rel=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_export_round_trip_bit_identical(job, kind):
    import transformers
    from safetensors.torch import load_file

    from megatron.skrull.errors import CHECKPOINT_DEPRECATIONS, quiet_checkpoint_deprecations
    from megatron.skrull.hf.export import main as export_main

    tmp = job[0]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert export_main(["--load", str(tmp / f"ckpt_{kind}"), "--output",
                            str(tmp / f"out_{kind}")]) == 0
    # mcore's deprecated torch checkpoint calls are quiet inside the load (only there)
    assert not [w for w in seen if issubclass(w.category, FutureWarning)
                and any(re.search(m, str(w.message)) for m in CHECKPOINT_DEPRECATIONS)], seen
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_checkpoint_deprecations():
            warnings.warn("`load_state_dict` is deprecated and will be removed", FutureWarning)
            warnings.warn("another deprecation", FutureWarning)
        warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.",
                      FutureWarning)
    assert [str(w.message) for w in seen] == [
        "another deprecation", "Please use DTensor instead and we are deprecating ShardedTensor."]
    src = load_file(str(tmp / kind / "model.safetensors"))
    got = load_file(str(tmp / f"out_{kind}" / "model.safetensors"))
    assert sorted(got) == sorted(src)
    for name, tensor in src.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp / f"out_{kind}"))
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp / f"out_{kind}"))
    assert model.config.vocab_size == VOCAB and tok.chat_template == CHATML
    # Exporting again into a non-empty directory is refused, nothing touched.
    assert export_main(["--load", str(tmp / f"ckpt_{kind}"), "--output",
                        str(tmp / f"out_{kind}")]) == 2
