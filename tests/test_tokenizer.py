"""Tokenizers: byte-level round trips, Hugging Face wrapper, factory errors."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data_helpers import CHATML_SPECIALS, SKRULL_SPECIALS, make_hf_tokenizer
from megatron.skrull.tokenizer import (ByteLevelTokenizer, HFTokenizer, build_tokenizer,
                                       tokenizer_from_description)

TEXTS = ["", "hello world", "naïve café — 東京 🚀", "tab\tnew\nline", "<|eos|> is plain text"]


def test_byte_level_ids_and_round_trip():
    tok = ByteLevelTokenizer()
    assert tok.vocab_size == 262
    assert (tok.pad, tok.bos, tok.eod) == (256, 257, 258)
    assert tok.encode("Ab") == [65, 98]
    for text in TEXTS:
        ids = tok.encode(text)
        assert all(0 <= i < 256 for i in ids)  # special text never becomes a special id
        assert tok.decode(ids) == text
        assert tok.detokenize(tok.tokenize(text)) == text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_level_round_trip_any_text(text):
    tok = ByteLevelTokenizer()
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) == len(text.encode("utf-8"))


def test_byte_level_specials_and_roles():
    tok = ByteLevelTokenizer()
    prefixes = [tok.role_prefix(r) for r in ("system", "user", "assistant")]
    assert prefixes == [[259], [260], [261]]
    assert tok.turn_end == [258] and tok.turn_sep == []
    # A marker between the bytes of one multi-byte character must not garble the rest.
    ids = [257] + tok.encode("é") + [261] + tok.encode("ü") + [258]
    assert tok.decode(ids) == "<|bos|>é<|assistant|>ü<|eos|>"
    with pytest.raises(ValueError, match="unknown role 'tool'"):
        tok.role_prefix("tool")
    with pytest.raises(ValueError, match="outside the byte-level vocabulary"):
        tok.decode([262])


def test_hf_skrull_markers(tmp_path):
    path = make_hf_tokenizer(str(tmp_path / "tok.json"), SKRULL_SPECIALS)
    tok = HFTokenizer(path)
    assert tok.chat_format == "skrull"
    ids = {name: tok._tok.token_to_id(name) for name in SKRULL_SPECIALS}
    assert (tok.pad, tok.bos, tok.eod) == (ids["<|pad|>"], ids["<|bos|>"], ids["<|eos|>"])
    assert tok.role_prefix("user") == [ids["<|user|>"]]
    assert tok.turn_end == [ids["<|eos|>"]]
    assert tok.vocab_size == tok._tok.get_vocab_size(with_added_tokens=True)
    for text in TEXTS[:4]:
        enc = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in enc)
        assert tok.decode(enc) == text
    # Trained merges are used: a frequent word is shorter than its byte count.
    assert len(tok.encode("apple")) < len("apple")


def test_hf_chatml_markers(tmp_path):
    path = make_hf_tokenizer(str(tmp_path / "tok.json"), CHATML_SPECIALS)
    tok = HFTokenizer(path)
    assert tok.chat_format == "chatml"
    start, end = (tok._tok.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>"))
    eot = tok._tok.token_to_id("<|endoftext|>")
    assert tok.eod == eot and tok.pad == eot and tok.bos is None
    assert tok.role_prefix("assistant")[0] == start
    assert tok.decode(tok.role_prefix("assistant")) == "<|im_start|>assistant\n"
    assert tok.turn_end == [end] and tok.decode(tok.turn_sep) == "\n"


def test_hf_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        HFTokenizer(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not a tokenizer")
    with pytest.raises(ValueError, match="not a Hugging Face tokenizer.json"):
        HFTokenizer(str(bad))
    no_eod = make_hf_tokenizer(str(tmp_path / "no_eod.json"), ["<|user|>"])
    with pytest.raises(ValueError, match="no end-of-document token"):
        HFTokenizer(no_eod)
    no_roles = make_hf_tokenizer(str(tmp_path / "no_roles.json"), ["</s>"])
    with pytest.raises(ValueError, match="neither a chat template nor chat markers"):
        HFTokenizer(no_roles)


def test_build_tokenizer_factory(tmp_path):
    assert isinstance(build_tokenizer(), ByteLevelTokenizer)
    assert isinstance(build_tokenizer(None), ByteLevelTokenizer)
    path = make_hf_tokenizer(str(tmp_path / "tok.json"), SKRULL_SPECIALS)
    hf = build_tokenizer("HFTokenizer", path)
    assert isinstance(hf, HFTokenizer)
    again = tokenizer_from_description(hf.describe())
    assert again.describe() == hf.describe()
    assert tokenizer_from_description(ByteLevelTokenizer().describe()).vocab_size == 262
    with pytest.raises(ValueError, match="unknown --tokenizer-type 'GPT2BPETokenizer'"):
        build_tokenizer("GPT2BPETokenizer")
    with pytest.raises(ValueError, match="needs --tokenizer-model"):
        build_tokenizer("HFTokenizer")
    with pytest.raises(ValueError, match="takes no --tokenizer-model"):
        build_tokenizer("ByteLevelTokenizer", path)
    with pytest.raises(FileNotFoundError):
        build_tokenizer("HFTokenizer", str(tmp_path / "nope.json"))
