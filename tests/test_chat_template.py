"""Chat templates: tokens equal transformers' apply_chat_template, mask = assistant replies."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from data_helpers import CHATML_SPECIALS, make_hf_tokenizer
from megatron.skrull import preprocess
from megatron.skrull.chat_template import ChatTemplateError, has_generation_tags, tokenize_chat
from megatron.skrull.tokenizer import build_tokenizer

# ChatML with a default system prompt when the conversation has none (like SmolLM2/Qwen2.5).
CHATML = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nBe brief.<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The same with the assistant content and end of turn inside {% generation %} blocks.
CHATML_GEN = CHATML.replace(
    "{{ m['content'] }}<|im_end|>\n",
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>"
    "{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}{{ '\\n' }}")
# Renders only the last user turn's prefix (earlier turns change once a reply follows).
REWRITING = ("{% for m in messages %}{% if loop.last %}<|im_start|>{{ m['role'] }}\n"
             "{{ m['content'] }}<|im_end|>{% else %}[{{ m['role'] }}]{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATION = [
    {"role": "user", "content": "hello world, how are you?"},
    {"role": "assistant", "content": "the quick brown fox"},
    {"role": "user", "content": "reverse: cloud green tiger"},
    {"role": "assistant", "content": "tiger green cloud"},
]


def make_template_tokenizer(directory: str, template: str | None) -> str:
    """A tiny BPE tokenizer directory (tokenizer.json + tokenizer_config.json [+ template])."""
    from transformers import PreTrainedTokenizerFast

    os.makedirs(directory, exist_ok=True)
    path = make_hf_tokenizer(os.path.join(directory, "raw.json"), CHATML_SPECIALS)
    tok = PreTrainedTokenizerFast(tokenizer_file=path, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(directory)
    return directory


def reference_ids(hf_tok, messages) -> list[int]:
    out = hf_tok.apply_chat_template(messages, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("template", [CHATML, CHATML_GEN], ids=["incremental", "generation"])
def test_tokens_equal_apply_chat_template_and_mask_is_replies(tmp_path, template):
    tok = build_tokenizer("HuggingFaceTokenizer", make_template_tokenizer(str(tmp_path), template))
    assert tok.chat_format == "template"
    assert has_generation_tags(template) == (template is CHATML_GEN)
    for messages in (CONVERSATION, [{"role": "system", "content": "x"}] + CONVERSATION[:2]):
        tokens, mask = preprocess.tokenize_conversation(tok, messages)
        assert tokens.tolist() == reference_ids(tok.hf, messages)
        assert mask.shape == tokens.shape
        # Masked tokens = each reply's content and its <|im_end|>, nothing else.
        runs, cur = [], []
        for t, m in zip(tokens.tolist(), mask.tolist()):
            if m:
                cur.append(t)
            elif cur:
                runs.append(cur)
                cur = []
        runs += [cur] if cur else []
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        assert [tok.decode(r) for r in runs] == [r + "<|im_end|>" for r in replies]


def test_incremental_and_generation_tags_agree(tmp_path):
    a = build_tokenizer("HFTokenizer", make_template_tokenizer(str(tmp_path / "a"), CHATML))
    b = build_tokenizer("HFTokenizer", make_template_tokenizer(str(tmp_path / "b"), CHATML_GEN))
    ta, ma = tokenize_chat(a.hf, CONVERSATION)
    tb, mb = tokenize_chat(b.hf, CONVERSATION)
    np.testing.assert_array_equal(ta, tb)
    np.testing.assert_array_equal(ma, mb)


def test_rewriting_template_is_a_clear_error(tmp_path):
    tok = build_tokenizer("HFTokenizer", make_template_tokenizer(str(tmp_path), REWRITING))
    with pytest.raises(ChatTemplateError, match="generation"):
        tokenize_chat(tok.hf, CONVERSATION)


def test_preprocess_cli_template_and_missing_markers(tmp_path, capsys):
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    tok_dir = make_template_tokenizer(str(tmp_path / "tok"), CHATML)
    rc = preprocess.main(["--input", str(data), "--output-prefix", str(tmp_path / "ds"),
                          "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                          tok_dir, "--seq-length", "256"])
    assert rc == 0
    meta = json.loads((tmp_path / "ds.json").read_text())
    assert meta["tokenizer"]["chat_format"] == "template"
    # A directory with neither a template nor role markers: one error line, exit 2, no files.
    plain = make_hf_tokenizer(str(tmp_path / "plain.json"), ["</s>"])
    os.makedirs(tmp_path / "plain")
    os.replace(plain, tmp_path / "plain" / "tokenizer.json")
    capsys.readouterr()
    rc = preprocess.main(["--input", str(data), "--output-prefix", str(tmp_path / "bad"),
                          "--tokenizer-type", "HFTokenizer", "--tokenizer-model",
                          str(tmp_path / "plain"), "--seq-length", "256"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "neither a chat template nor chat markers" in err[0]
    assert not os.path.exists(tmp_path / "bad.json")
