"""Preprocessing: chat template, JSONL -> indexed datasets, synthetic corpus, CLI errors."""
from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from data_helpers import CHATML_SPECIALS, make_hf_tokenizer
from megatron.skrull import corpus
from megatron.skrull.data import SFTDataset
from megatron.skrull.preprocess import dataset_paths, main, tokenize_conversation
from megatron.skrull.tokenizer import ByteLevelTokenizer, HFTokenizer

BOS, EOS, SYS, USER, ASST = 257, 258, 259, 260, 261
RECORDS = [
    {"prompt": "hi", "response": "yo"},
    {"messages": [{"role": "system", "content": "be brief"},
                  {"role": "user", "content": "naïve 東京?"},
                  {"role": "assistant", "content": "ok 🚀"},
                  {"role": "user", "content": "again"},
                  {"role": "assistant", "content": "done"}]},
    {"system": "sys", "prompt": "2", "response": "two"},
]


def write_jsonl(path, records, raw_lines=()):
    with open(path, "w", encoding="utf-8") as fh:
        for rec in records:
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
        for line in raw_lines:
            fh.write(line + "\n")
    return str(path)


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def b(text):
    return list(text.encode("utf-8"))


def test_chat_template_by_hand():
    tok = ByteLevelTokenizer()
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    tokens, mask = tokenize_conversation(tok, msgs)
    assert tokens.tolist() == [BOS, USER, *b("hi"), EOS, ASST, *b("yo"), EOS]
    assert mask.tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1]
    assert tokens.dtype == np.int64 and mask.dtype == np.uint8


def test_round_trip_both_formats(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS, raw_lines=["", "   "])
    rc, out, err = run(capsys, "--input", src, "--output-prefix", tmp_path / "ds",
                       "--seq-length", 64)
    assert rc == 0, err
    assert "written=3" in out
    ds = SFTDataset(str(tmp_path / "ds"))
    assert len(ds) == 3
    tokens, mask = ds[0]
    assert tokens.tolist() == [BOS, USER, *b("hi"), EOS, ASST, *b("yo"), EOS]
    assert mask.tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1]
    tokens, mask = ds[1]
    expected = ([BOS, SYS, *b("be brief"), EOS, USER, *b("naïve 東京?"), EOS, ASST]
                + b("ok 🚀") + [EOS, USER, *b("again"), EOS, ASST, *b("done"), EOS])
    assert tokens.tolist() == expected
    trained = tokens[mask.bool()].tolist()
    assert trained == b("ok 🚀") + [EOS] + b("done") + [EOS]
    # The prompt/response format with "system" equals the equivalent messages record.
    tokens, _ = ds[2]
    assert tokens.tolist() == [BOS, SYS, *b("sys"), EOS, USER, *b("2"), EOS, ASST, *b("two"),
                               EOS]
    meta = json.load(open(tmp_path / "ds.json"))
    assert meta["stats"]["loss_tokens"] == sum(int(ds[i][1].sum()) for i in range(3))
    assert meta["tokenizer"]["type"] == "ByteLevelTokenizer" and meta["seq_length"] == 64


def test_round_trip_hf_tokenizer(tmp_path, capsys):
    tok_path = make_hf_tokenizer(str(tmp_path / "tok.json"), CHATML_SPECIALS)
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    rc, _, err = run(capsys, "--input", src, "--output-prefix", tmp_path / "hf",
                     "--tokenizer-type", "HFTokenizer", "--tokenizer-model", tok_path,
                     "--seq-length", 256)
    assert rc == 0, err
    ds = SFTDataset(str(tmp_path / "hf"))
    tok = HFTokenizer(tok_path)
    ds.check_tokenizer(tok, seq_length=256)
    tokens, mask = ds[0]
    assert tok.decode(tokens.tolist()) == ("<|im_start|>user\nhi<|im_end|>\n"
                                           "<|im_start|>assistant\nyo<|im_end|>\n")
    assert tok.decode(tokens[mask.bool()].tolist()) == "yo<|im_end|>"
    _, mask1 = ds[1]
    assert tok.decode(ds[1][0][mask1.bool()].tolist()) == "ok 🚀<|im_end|>done<|im_end|>"
    assert ds.metadata["token_dtype"] == "uint16"


def check_task_rule(user: str, answer: str) -> None:
    """Independent statement of the corpus rules: the answer is a function of the prompt."""
    task, _, text = user.partition(": ")
    words = text.split(" ")
    expected = {"copy": text, "reverse": " ".join(words[::-1]), "upper": text.upper(),
                "double": " ".join(w + " " + w for w in words),
                "initials": "".join(w[0] for w in words)}[task]
    assert answer == expected, (task, user, answer)


def test_synthetic_corpus_profile_rules_and_determinism():
    config = corpus.CorpusConfig(num_samples=600, seed=7, max_tokens=8192)
    records = list(corpus.generate_records(config))
    tok = ByteLevelTokenizer()
    lengths = []
    for rec in records:
        msgs = rec["messages"]
        tokens, mask = tokenize_conversation(tok, msgs)
        assert len(tokens) == corpus.byte_level_length(rec)
        lengths.append(len(tokens))
        assert mask.any()
        turns = [m for m in msgs if m["role"] != "system"]
        assert [m["role"] for m in turns] == ["user", "assistant"] * (len(turns) // 2)
        for user, answer in zip(turns[::2], turns[1::2]):
            check_task_rule(user["content"], answer["content"])
    lengths = np.array(lengths)
    assert 0.6 <= np.mean(lengths < 512) <= 0.9
    assert lengths.max() <= 8192 and lengths.max() >= 8192 - 64
    assert np.sum(lengths >= 1024) >= 10  # a real long tail, not just the one forced sample
    assert lengths.min() >= 30
    assert list(corpus.generate_records(config)) == records
    other = corpus.CorpusConfig(num_samples=600, seed=8, max_tokens=8192)
    assert list(corpus.generate_records(other)) != records


def test_corpus_config_validation():
    with pytest.raises(ValueError, match="num_samples"):
        corpus.CorpusConfig(num_samples=0)
    with pytest.raises(ValueError, match="max_tokens"):
        corpus.CorpusConfig(num_samples=4, max_tokens=40, min_tokens=48)
    with pytest.raises(ValueError, match="long_fraction"):
        corpus.CorpusConfig(num_samples=4, long_fraction=1.5)
    # A cap below the long tail start still works: every sample is short.
    small = corpus.CorpusConfig(num_samples=50, seed=1, max_tokens=300)
    assert max(corpus.byte_level_length(r) for r in corpus.generate_records(small)) <= 300


def test_synthetic_cli_deterministic(tmp_path, capsys):
    def make(name, seed):
        rc, out, err = run(capsys, "--synthetic", 40, "--seed", seed, "--seq-length", 2048,
                           "--output-prefix", tmp_path / name,
                           "--save-jsonl", tmp_path / f"{name}.jsonl")
        assert rc == 0, err
        return dataset_paths(str(tmp_path / name))

    a, a2, c = make("a", 3), make("a2", 3), make("c", 4)
    for key in ("tokens_bin", "tokens_idx", "mask_bin", "mask_idx"):
        assert filecmp.cmp(a[key], a2[key], shallow=False)
    assert not filecmp.cmp(a["tokens_bin"], c["tokens_bin"], shallow=False)
    ds = SFTDataset(str(tmp_path / "a"))
    assert 2048 - 64 <= ds.max_length <= 2048  # longest sample spans about all --seq-length
    # The saved JSONL re-preprocesses to the same dataset.
    rc, _, err = run(capsys, "--input", tmp_path / "a.jsonl", "--seq-length", 2048,
                     "--output-prefix", tmp_path / "again")
    assert rc == 0, err
    assert filecmp.cmp(a["tokens_bin"], str(tmp_path / "again.bin"), shallow=False)
    assert filecmp.cmp(a["mask_bin"], str(tmp_path / "again_lossmask.bin"), shallow=False)


def test_overlong_policies(tmp_path, capsys):
    recs = [{"prompt": "a" * 20, "response": "b" * 20}, {"prompt": "hi", "response": "yo"}]
    src = write_jsonl(tmp_path / "in.jsonl", recs)
    base = ["--input", src, "--seq-length", 30]
    rc, _, err = run(capsys, *base, "--output-prefix", tmp_path / "e")
    assert rc == 2 and f"{src}:1:" in err and "--overlong" in err
    assert len(err.strip().splitlines()) == 1
    assert not any(os.path.exists(p) for p in dataset_paths(str(tmp_path / "e")).values())
    rc, out, err = run(capsys, *base, "--overlong", "drop", "--output-prefix", tmp_path / "d")
    assert rc == 0 and "dropped=1" in out and "written=1" in out
    assert len(SFTDataset(str(tmp_path / "d"))) == 1
    rc, out, err = run(capsys, *base, "--overlong", "truncate", "--output-prefix",
                       tmp_path / "t")
    assert rc == 0 and "truncated=1" in out and "written=2" in out
    ds = SFTDataset(str(tmp_path / "t"))
    assert ds.lengths.tolist() == [30, 8]
    assert ds[0][0].tolist() == [BOS, USER, *b("a" * 20), EOS, ASST, *b("b" * 20), EOS][:31]
    assert int(ds[0][1].sum()) == 7
    # Truncation that cuts away every response token is an empty sample.
    rc, _, err = run(capsys, "--input", src, "--seq-length", 16, "--overlong", "truncate",
                     "--output-prefix", tmp_path / "t2")
    assert rc == 2 and "no assistant/response tokens" in err


BAD_LINES = [
    ('{"prompt": "x", "response": "y"', "malformed JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"prompt": "x"}', "missing key 'response'"),
    ('{"text": "x"}', "fits no input format"),
    ('{"messages": [{"role": "user"}]}', "needs 'role' and 'content'"),
    ('{"messages": [{"role": "bot", "content": "x"}]}', "role 'bot'"),
    ('{"messages": [{"role": "user", "content": 3}]}', "content must be a string"),
    ('{"messages": "hi"}', "'messages' must be a list"),
    ('{"prompt": "x", "response": ""}', "no assistant/response tokens"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "no assistant/response tokens"),
]


@pytest.mark.parametrize("line,message", BAD_LINES)
def test_bad_input_names_line(tmp_path, capsys, line, message):
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS[:1], raw_lines=["", line])
    rc, out, err = run(capsys, "--input", src, "--output-prefix", tmp_path / "x")
    assert rc == 2
    assert err.startswith("preprocess_sft.py: error: ") and len(err.strip().splitlines()) == 1
    assert f"{src}:3:" in err and message in err
    assert os.listdir(tmp_path) == ["in.jsonl"]  # no dataset files, no temporaries left


def test_skip_empty_and_other_cli_errors(tmp_path, capsys):
    recs = [{"prompt": "x", "response": ""}, {"prompt": "hi", "response": "yo"}]
    src = write_jsonl(tmp_path / "in.jsonl", recs)
    rc, out, _ = run(capsys, "--input", src, "--skip-empty", "--output-prefix", tmp_path / "s")
    assert rc == 0 and "skipped_empty=1" in out and "written=1" in out
    only_empty = write_jsonl(tmp_path / "empty.jsonl", recs[:1])
    rc, _, err = run(capsys, "--input", only_empty, "--skip-empty", "--output-prefix",
                     tmp_path / "n")
    assert rc == 2 and "no sample left" in err
    assert not any(os.path.exists(p) for p in dataset_paths(str(tmp_path / "n")).values())
    rc, _, err = run(capsys, "--input", tmp_path / "nope.jsonl", "--output-prefix", tmp_path / "m")
    assert rc == 2 and "does not exist" in err
    rc, _, err = run(capsys, "--synthetic", 4, "--tokenizer-type", "HFTokenizer",
                     "--output-prefix", tmp_path / "h")
    assert rc == 2 and "needs --tokenizer-model" in err
    rc, _, err = run(capsys, "--input", src, "--save-jsonl", tmp_path / "o.jsonl",
                     "--output-prefix", tmp_path / "j")
    assert rc == 2 and "--save-jsonl only applies to --synthetic" in err
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9", "response": "x"}\n')
    rc, _, err = run(capsys, "--input", tmp_path / "latin1.jsonl", "--output-prefix",
                     tmp_path / "l")
    assert rc == 2 and "latin1.jsonl:1: not valid UTF-8" in err
    with pytest.raises(SystemExit) as exc:  # argparse: unknown choice / missing source
        main(["--input", src, "--output-prefix", "p", "--tokenizer-type", "GPT2BPETokenizer"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        main(["--output-prefix", "p"])


def test_cli_script_one_line_error(tmp_path):
    """The real script (fresh interpreter, megatron.core import included) exits 2, one line."""
    src = write_jsonl(tmp_path / "in.jsonl", RECORDS[:1], raw_lines=['{"prompt": '])
    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools",
                          "preprocess_sft.py")
    proc = subprocess.run([sys.executable, script, "--input", src, "--output-prefix",
                           str(tmp_path / "x")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"preprocess_sft.py: error: {src}:2: malformed JSON "
                                   "(Expecting value at column 12)")
