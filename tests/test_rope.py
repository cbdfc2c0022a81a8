"""RoPE scaling (default, linear, llama3, yarn): frequencies, flags, configs, one process.

The frequencies must be bit-equal to transformers' ``ROPE_INIT_FUNCTIONS`` (what a Hugging
Face model computes) and to mcore's ``RotaryEmbedding`` / ``YarnRotaryEmbedding`` (what
Megatron's flags mean); the attention layer must hand every kernel q/k rotated at each token's
position in its own document and multiplied by YaRN's attention factor.  The launcher-level
parity (losses at CP 2 / TP 2, export) is tests/test_hf_rope.py.
"""
from __future__ import annotations

import json

import pytest
import torch

from megatron.skrull.arguments import ConfigError, parse_args
from megatron.skrull.hf.config import flags_from_hf_config
from megatron.skrull.hf.rope import hf_rope_parameters, rope_flags_from_hf, with_run_rope
from megatron.skrull.rope import RopeArgs, RopeFrequencies, rope_args

from mcore_helpers import TINY_FLAGS

LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# (config fields, head_dim): real models' settings and the corner cases of each formula.
CONFIGS = {
    "llama3.1": (dict(rope_theta=500000.0, max_position_embeddings=131072,
                      rope_scaling=LLAMA31), 128),
    "llama3.2-tiny-original": (dict(rope_theta=10000.0, max_position_embeddings=256,
                                    rope_scaling={**LLAMA31, "factor": 32.0,
                                                  "original_max_position_embeddings": 32}), 16),
    "qwen2.5-yarn": (dict(rope_theta=1e6, max_position_embeddings=131072,
                          rope_scaling={"type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 32768}), 128),
    "yarn-mscale-betas": (dict(rope_theta=10000.0, max_position_embeddings=163840,
                               rope_scaling={"rope_type": "yarn", "factor": 40,
                                             "original_max_position_embeddings": 4096,
                                             "mscale": 0.707, "mscale_all_dim": 1.0,
                                             "beta_fast": 16, "beta_slow": 2}), 64),
    "yarn-attention-factor-no-truncate": (dict(
        rope_theta=10000.0, max_position_embeddings=16384,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                         "original_max_position_embeddings": 2048, "truncate": False,
                         "attention_factor": 1.25}), 64),
    "yarn-5.x-no-factor": (dict(max_position_embeddings=256, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": None,
        "original_max_position_embeddings": 64}),
        24),
    "linear": (dict(rope_theta=10000.0, max_position_embeddings=4096,
                    rope_scaling={"type": "linear", "factor": 4.0}), 128),
    "default": (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                     max_position_embeddings=40960), 128),
}


def _ours(cfg: dict, head_dim: int) -> RopeFrequencies:
    problems: list[str] = []
    values = rope_flags_from_hf(cfg, "config.json", problems)
    assert not problems
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 1e4))
    return RopeFrequencies.build(RopeArgs(**values), head_dim, int(theta))


def _transformers(cfg: dict, head_dim: int):
    """(inv_freq, attention factor) of transformers' own rope init for ``cfg``."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig.from_dict({**cfg, "hidden_size": 4 * head_dim,
                                             "num_attention_heads": 4})
    kind = hf.rope_parameters["rope_type"]
    if kind == "default":
        return transformers.models.llama.modeling_llama.LlamaRotaryEmbedding \
            .compute_default_rope_parameters(hf)
    return ROPE_INIT_FUNCTIONS[kind](hf, None)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_frequencies_bit_equal_transformers(name):
    cfg, head_dim = CONFIGS[name]
    ref, factor = _transformers(cfg, head_dim)
    ours = _ours(cfg, head_dim)
    assert ours.inv_freq.dtype == ref.dtype == torch.float32
    assert torch.equal(ours.inv_freq, ref), name
    assert ours.attention_factor == factor


def test_megatron_flags_bit_equal_mcore():
    """--use-rope-scaling, --position-embedding-type yarn ... mean what they mean in mcore."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding)
    from megatron.skrull.cpu_compat import apply_cpu_compat

    apply_cpu_compat("cpu")  # YarnRotaryEmbedding moves its tables to "the" CUDA device
    plain = parse_args(TINY_FLAGS + ["--rotary-base", "500000"]).model
    llama3 = parse_args(TINY_FLAGS + ["--use-rope-scaling", "--rope-scaling-factor", "16"]).model
    yarn = parse_args(TINY_FLAGS + [
        "--position-embedding-type", "yarn", "--rotary-scaling-factor", "4",
        "--yarn-original-max-position-embeddings", "32", "--yarn-beta-fast", "24",
        "--mscale", "0.8", "--mscale-all-dim", "0.5"]).model
    for m, ref in ((plain, RotaryEmbedding(16, 1.0, rotary_base=500000,
                                           use_cpu_initialization=True)),
                   (llama3, RotaryEmbedding(16, 1.0, rope_scaling=True, rope_scaling_factor=16,
                                            use_cpu_initialization=True))):
        assert torch.equal(RopeFrequencies.build(rope_args(m), 16, m.rotary_base).inv_freq,
                           ref.inv_freq)
    ref = YarnRotaryEmbedding(16, scaling_factor=4.0, original_max_position_embeddings=32,
                              beta_fast=24.0, mscale=0.8, mscale_all_dim=0.5,
                              use_cpu_initialization=True)
    emb, mscale = ref.get_emb(300)
    ours = RopeFrequencies.build(rope_args(yarn), 16, yarn.rotary_base)
    assert torch.equal(ours.angles(torch.arange(300)), emb) and ours.attention_factor == mscale
    # linear: mcore multiplies positions by 1/F, transformers (and we) divide frequencies.
    interp = parse_args(TINY_FLAGS + ["--rotary-seq-len-interpolation-factor", "4"]).model
    ref = RotaryEmbedding(16, 1.0, seq_len_interpolation_factor=4.0, use_cpu_initialization=True)
    torch.testing.assert_close(RopeFrequencies.build(rope_args(interp), 16, 10000).angles(
        torch.arange(300)), ref.get_freqs_non_repeated(300).repeat(1, 2)[:, None, None],
        rtol=1e-6, atol=0)


def test_core_attention_rotates_at_document_positions_with_the_attention_factor():
    """Every kernel gets q/k = transformers' rotation at each token's position in its own
    document (local or a zigzag shard of CP rank 1), times YaRN's factor, in float64."""
    import transformers
    from megatron.core.transformer.transformer_config import TransformerConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, \
        apply_rotary_pos_emb

    from megatron.skrull.model import SkrullCoreAttention, SkrullPackedSeqParams
    from skrull_ext.attention.layout import build_rank_layout

    cfg, _ = CONFIGS["yarn-5.x-no-factor"]
    rope = RopeArgs(**rope_flags_from_hf(cfg, "config.json", []))
    config = TransformerConfig(num_layers=1, hidden_size=96, num_attention_heads=4,
                               kv_channels=24, attention_dropout=0.0,
                               use_cpu_initialization=True)
    seen = []
    attn = SkrullCoreAttention(config, 1, None, "self", rotary_base=10000, rope=rope,
                               attention_fn=lambda q, k, v, *a, **kw: seen.append((q, k)) or q)
    lengths = (7, 150, 90)  # sample 1 (150 > 64, the original context) is sharded over CP 2
    layout = build_rank_layout(lengths, [1], [[0], [2]], 1, 2)
    gen = torch.Generator().manual_seed(0)
    q_docs = [torch.randn(n, 4, 24, generator=gen, dtype=torch.float64) for n in lengths]
    k_docs = [torch.randn(n, 4, 24, generator=gen, dtype=torch.float64) for n in lengths]
    attn(layout.pack(q_docs), layout.pack(k_docs), layout.pack(k_docs), None,
         packed_seq_params=SkrullPackedSeqParams(layout=layout, cp_group=object()))
    hf_rope = LlamaRotaryEmbedding(transformers.LlamaConfig.from_dict(
        {**cfg, "hidden_size": 96, "num_attention_heads": 4}))
    ref_q, ref_k = [], []
    for q, k in zip(q_docs, k_docs):  # whole documents from position 0, [1, heads, S, dim]
        cos, sin = hf_rope(q, torch.arange(q.shape[0])[None])
        rq, rk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        ref_q.append(rq[0].transpose(0, 1))
        ref_k.append(rk[0].transpose(0, 1))
    assert hf_rope.attention_scaling == pytest.approx(1.1386, abs=1e-4)
    assert layout.position_ids.max() >= 64 and layout.distributed  # positions past 64, sharded
    torch.testing.assert_close(seen[0][0], layout.pack(ref_q), rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(seen[0][1], layout.pack(ref_k), rtol=1e-15, atol=1e-15)


def _dir(tmp_path, **changes) -> str:
    base = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
            "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 256, "vocab_size": 320, "rope_theta": 10000.0,
            "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps({**base, **changes}))
    return str(tmp_path)


RUN = ["--seq-length", "200", "--global-batch-size", "2", "--lr", "0", "--train-iters", "1",
       "--skrull-bucket-size", "256", "--device", "cpu"]


def test_config_scaling_sets_the_flags_and_contradicting_flags_are_one_line(tmp_path):
    d = _dir(tmp_path, rope_scaling={**LLAMA31, "original_max_position_embeddings": 32})
    m = parse_args(["--pretrained-hf", d, *RUN, "--use-rope-scaling",
                    "--rope-scaling-factor", "8"]).model
    assert m.rope_type == "llama3" and m.rope_scaling_original_max_position_embeddings == 32
    for flags, needle in ((["--rope-scaling-factor", "4"], "--rope-scaling-factor 4.0 disagrees"),
                          (["--position-embedding-type", "yarn"], "--position-embedding-type "
                           "yarn disagrees"),
                          (["--rotary-percent", "0.5"], "--rotary-percent 0.5 disagrees")):
        with pytest.raises(ConfigError) as err:
            parse_args(["--pretrained-hf", d, *RUN, *flags])
        assert len(err.value.problems) == 1 and needle in err.value.problems[0], flags


@pytest.mark.parametrize("block,needle", [
    ({"rope_type": "longrope", "factor": 4.0}, "'longrope' is not supported; supported: "
                                               "default, linear, llama3, yarn"),
    ({"type": "dynamic", "factor": 2.0}, "'dynamic' is not supported"),
    ({"rope_type": "llama3", "factor": 8.0}, "needs low_freq_factor, high_freq_factor"),
    ({"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5}, "partial_rotary"),
])
def test_unsupported_config_rope_is_one_line(tmp_path, block, needle):
    with pytest.raises(ConfigError) as err:
        parse_args(["--pretrained-hf", _dir(tmp_path, rope_scaling=block), *RUN])
    assert len(err.value.problems) == 1 and needle in err.value.problems[0]


def test_refused_and_conflicting_flags_are_one_line_each():
    for flags, needle in (
            (["--position-embedding-type", "learned_absolute"], "learned_absolute is not "
             "supported"),
            (["--position-embedding-type", "none"], "none is not supported"),
            (["--use-rope-scaling", "--rotary-seq-len-interpolation-factor", "2"], "pick one"),
            (["--position-embedding-type", "yarn", "--rotary-scaling-factor", "0.5"], ">= 1"),
            (["--rotary-percent", "0.05"], "even number"),
            (["--no-rope-freq", "4"], "--no-rope-freq"),
            (["--position-embedding-type", "yarn", "--no-position-embedding"], "deprecated")):
        with pytest.raises(ConfigError) as err:
            parse_args(TINY_FLAGS + flags)
        assert len(err.value.problems) == 1 and needle in err.value.problems[0], flags
    # Megatron's deprecated spellings that agree with rope are accepted.
    m = parse_args(TINY_FLAGS + ["--use-rotary-position-embeddings", "--no-position-embedding",
                                 "--no-rope-fusion"]).model
    assert m.rope_type == "default"


def test_context_extension_adds_yarn_to_a_plain_model(tmp_path):
    """A 256-token model trained with YaRN x4: flags on a config without scaling."""
    d = _dir(tmp_path)
    yarn = ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "4"]
    with pytest.raises(ConfigError, match="--seq-length 1024"):
        parse_args(["--pretrained-hf", d, *RUN, "--seq-length", "1024",
                    "--skrull-bucket-size", "1024"])
    m = parse_args(["--pretrained-hf", d, *RUN, *yarn, "--seq-length", "1024",
                    "--skrull-bucket-size", "1024"]).model
    assert (m.rope_type, m.yarn_original_max_position_embeddings, m.max_position_embeddings,
            m.scaled_context(m.max_position_embeddings)) == ("yarn", 256, 256, 1024)
    src = json.loads((tmp_path / "config.json").read_text())
    out = with_run_rope(src, vars(m))
    assert out["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "original_max_position_embeddings": 256,
                                   "truncate": True}
    ref, factor = _transformers(out, 16)
    assert torch.equal(ref, _ours(out, 16).inv_freq) and factor == _ours(out, 16).attention_factor


@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_keeps_or_rewrites_the_config_so_transformers_builds_the_same(name):
    cfg, head_dim = CONFIGS[name]
    cfg = {**cfg, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
           "hidden_size": 4 * head_dim, "intermediate_size": 8, "num_attention_heads": 4,
           "vocab_size": 8}
    model = flags_from_hf_config(cfg, seq_length=8)
    assert with_run_rope(cfg, model) is cfg  # the source config, untouched
    # Written from the flags alone (no source directory): the same frequencies.
    bare = {k: v for k, v in cfg.items() if not k.startswith("rope")}
    written = with_run_rope(bare, model)
    ref, factor = _transformers(written, head_dim)
    assert torch.equal(ref, _ours(cfg, head_dim).inv_freq)
    assert factor == _ours(cfg, head_dim).attention_factor


def test_export_writes_megatron_only_mscale_as_attention_factor_and_refuses_partial_rotary():
    m = parse_args(TINY_FLAGS + ["--position-embedding-type", "yarn", "--rotary-scaling-factor",
                                 "4", "--mscale", "0.707"]).model
    params = hf_rope_parameters(vars(m))
    assert params["attention_factor"] == pytest.approx(0.1 * 0.707 * 1.3862943611 + 1)
    assert "mscale" not in params
    partial = parse_args(TINY_FLAGS + ["--rotary-percent", "0.5"]).model
    with pytest.raises(ValueError, match="--rotary-percent 0.5 has no Hugging Face"):
        hf_rope_parameters(vars(partial))


def test_launcher_logs_the_scaling_and_reports_bad_rope_in_one_line(tmp_path, capsys):
    from megatron.skrull.pretrain_gpt import main
    from megatron.skrull.rope import describe

    yarn = parse_args(TINY_FLAGS + ["--position-embedding-type", "yarn",
                                    "--rotary-scaling-factor", "4",
                                    "--yarn-original-max-position-embeddings", "32768"]).model
    assert describe(yarn, 32768) == "yarn RoPE x4 from 32768 positions (attention factor 1.1386)"
    assert describe(rope_args(parse_args(TINY_FLAGS).model), 96) == "default RoPE"
    d = _dir(tmp_path, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert main(["--pretrained-hf", d, *RUN]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'dynamic' is not supported; supported: default, linear" in err[0]


def test_resume_check_reads_a_checkpoint_saved_before_the_rope_flags(monkeypatch):
    """A saved model record without the RoPE fields means their defaults: no false
    mismatch; a saved scaling that the flags drop is still one."""
    import dataclasses

    from megatron.core import dist_checkpointing
    from megatron.skrull import checkpointing

    now = dataclasses.asdict(parse_args(TINY_FLAGS))
    old = {k: v for k, v in now["model"].items() if k not in dataclasses.asdict(RopeArgs())}
    saved = {"skrull": {"model": old, "layout": "L"}}
    monkeypatch.setattr(dist_checkpointing, "load_common_state_dict", lambda path: saved)
    assert checkpointing._check_compatible("ckpt", now) == "L"
    saved["skrull"]["model"] = {**old, "use_rope_scaling": True}
    with pytest.raises(checkpointing.CheckpointError, match="use_rope_scaling: saved True"):
        checkpointing._check_compatible("ckpt", now)


def test_a_flag_that_changes_nothing_leaves_the_config_alone(tmp_path):
    d = _dir(tmp_path)
    m = parse_args(["--pretrained-hf", d, *RUN, "--position-embedding-type", "rope"]).model
    assert m == parse_args(["--pretrained-hf", d, *RUN]).model
    src = json.loads((tmp_path / "config.json").read_text())
    assert with_run_rope(src, vars(m)) is src
