"""--pretrained-hf flags: config.json -> model flags, disagreeing flags and unsupported features."""
from __future__ import annotations

import json

import pytest

from megatron.skrull.arguments import ConfigError, parse_args
from megatron.skrull.hf.config import HFConfigError, flags_from_hf_config, hf_config_from_model

LLAMA = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
         "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 256, "vocab_size": 320, "rms_norm_eps": 1e-6,
         "rope_theta": 10000.0, "tie_word_embeddings": True, "hidden_act": "silu"}
RUN = ["--seq-length", "64", "--global-batch-size", "2", "--lr", "0", "--train-iters", "1",
       "--skrull-bucket-size", "128", "--device", "cpu"]


def _dir(tmp_path, **changes):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, **changes}))
    return str(tmp_path)


def test_config_sets_every_model_flag(tmp_path):
    cfg = parse_args(["--pretrained-hf", _dir(tmp_path), *RUN, "--num-layers", "2"])
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.ffn_size, m.num_attention_heads, m.query_groups,
            m.head_dim, m.vocab_size, m.rotary_base) == (2, 64, 96, 4, 2, 16, 320, 10000)
    assert m.swiglu and m.normalization == "RMSNorm" and m.disable_bias_linear
    assert not m.add_qkv_bias and not m.untie_embeddings_and_output_weights
    assert m.padded_vocab_size(m.vocab_size, 2) == 320  # no padding rows
    qwen = flags_from_hf_config({**LLAMA, "architectures": ["Qwen2ForCausalLM"],
                                 "tie_word_embeddings": False,
                                 "rope_parameters": {"rope_type": "default",
                                                     "rope_theta": 1e6}}, seq_length=64)
    assert qwen["add_qkv_bias"] and qwen["untie_embeddings_and_output_weights"]
    assert qwen["rotary_base"] == 1000000
    back = hf_config_from_model({**{k: getattr(m, k) for k in vars(m)}}, vocab_size=320)
    assert {k: back[k] for k in LLAMA if k != "hidden_act"} == {
        k: v for k, v in LLAMA.items() if k != "hidden_act"}


def test_disagreeing_flags_name_both_values(tmp_path):
    with pytest.raises(ConfigError) as err:
        parse_args(["--pretrained-hf", _dir(tmp_path), *RUN, "--hidden-size", "32",
                    "--normalization", "LayerNorm"])
    assert len(err.value.problems) == 2
    assert "--hidden-size 32 disagrees with" in err.value.problems[0]
    assert "(64)" in err.value.problems[0]


def test_vocabulary_is_padded_once_at_any_tp(tmp_path):
    """The HF vocabulary is the model's at every TP; Megatron scripts' explicit
    --make-vocab-size-divisible-by (a divisor of it) is accepted and pads nothing."""
    for flags, world in (([], 1), (["--make-vocab-size-divisible-by", "64"], 1),
                         (["--make-vocab-size-divisible-by", "1",
                           "--tensor-model-parallel-size", "2"], 2)):
        cfg = parse_args(["--pretrained-hf", _dir(tmp_path), *RUN, *flags], world_size=world)
        tp = cfg.parallel.tensor_model_parallel_size
        assert cfg.model.padded_vocab_size(cfg.model.vocab_size, tp) == 320
    with pytest.raises(ConfigError) as err:
        parse_args(["--pretrained-hf", _dir(tmp_path), *RUN,
                    "--make-vocab-size-divisible-by", "128"])
    (line,) = err.value.problems
    assert "--make-vocab-size-divisible-by 128 would pad" in line and "320" in line


@pytest.mark.parametrize("changes,needle", [
    ({"architectures": ["GPT2LMHeadModel"]}, "not supported"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 8.0}}, "rope_type .longrope"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 32}, "sliding_window 32"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"vocab_size": 321}, "not divisible by --tensor-model-parallel-size 2"),
])
def test_unsupported_features_are_errors(tmp_path, changes, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_args(["--pretrained-hf", _dir(tmp_path, **changes), *RUN,
                    "--tensor-model-parallel-size", "2"], world_size=2)


def test_launcher_exit_2_without_config_or_weights(tmp_path, capsys):
    from megatron.skrull.pretrain_gpt import main

    assert main(["--pretrained-hf", str(tmp_path), *RUN]) == 2
    assert "no config.json" in capsys.readouterr().err
    _dir(tmp_path)  # a config but no safetensors
    try:
        assert main(["--pretrained-hf", str(tmp_path), *RUN]) == 2
    finally:  # main() ran in this process: leave no model-parallel state behind
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no model.safetensors" in err[0]
    with pytest.raises(HFConfigError):
        hf_config_from_model({"swiglu": False}, vocab_size=8)
