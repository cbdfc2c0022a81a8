"""Input formats and files of tools/preprocess_sft.py, --sft-loss-on, --workers, progress.

The same conversations written as OpenAI messages (JSONL), ShareGPT (a JSON list), Alpaca
(gzip JSONL), Parquet, a save_to_disk Arrow directory and a hub-cache folder give identical
token and mask files; tool calls render through the chat template; a bad record is one
FILE:LINE error with nothing written; --workers 2 is byte-identical to one worker.
"""
from __future__ import annotations

import filecmp
import gzip
import json
import os

import numpy as np
import pytest

from test_chat_template import CHATML, make_template_tokenizer
from megatron.skrull.data import SFTDataset
from megatron.skrull.preprocess import dataset_paths, main, tokenize_conversation
from megatron.skrull.tokenizer import ByteLevelTokenizer, build_tokenizer

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

BOS, EOS, SYS, USER, ASST = 257, 258, 259, 260, 261
# (system, [(user, assistant), ...]); Alpaca holds the earlier pairs in "history".
CHATS = [("be brief", [("Copy the words.\n\napple river", "apple river")]),
         ("", [("hello", "hi"), ("reverse: cloud green tiger", "tiger green cloud")]),
         ("sys 東京", [("naïve?", "ok 🚀"), ("and", "more"), ("last", "done")])]
# Hermes-style tools (as Qwen2.5's template): calls inside the assistant turn, results as user.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m['content'] }}\n</tool_response><|im_end|>\n{% elif m.get('tool_calls') %}"
    "<|im_start|>assistant\n{{ m['content'] }}{% for c in m['tool_calls'] %}<tool_call>\n"
    "{{ c['function'] | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n{% else %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def as_messages(system, turns):
    head = [{"role": "system", "content": system}] if system else []
    return {"messages": head + [m for u, a in turns for m in (
        {"role": "user", "content": u}, {"role": "assistant", "content": a})]}


def as_sharegpt(system, turns):
    return {"system": system, "conversations": [t for u, a in turns for t in (
        {"from": "human", "value": u}, {"from": "gpt", "value": a})]}


def as_alpaca(system, turns):
    (*history, (user, answer)) = turns
    instruction, _, extra = user.partition("\n\n")  # user = instruction, blank line, input
    return {"system": system, "history": [list(p) for p in history],
            "instruction": instruction, "input": extra, "output": answer}


def write_files(d):
    """Every supported file of CHATS; returns their paths."""
    paths = {"jsonl": str(d / "chat.jsonl"), "sharegpt": str(d / "share.json"),
             "alpaca": str(d / "alpaca.jsonl.gz"), "parquet": str(d / "chat.parquet"),
             "arrow": str(d / "saved"), "hub": str(d / "hub")}
    with open(paths["jsonl"], "w") as fh:
        fh.writelines(json.dumps(as_messages(*c), ensure_ascii=False) + "\n" for c in CHATS)
    with open(paths["sharegpt"], "w") as fh:
        json.dump([as_sharegpt(*c) for c in CHATS], fh, indent=2, ensure_ascii=False)
    with gzip.open(paths["alpaca"], "wt") as fh:
        fh.writelines(json.dumps(as_alpaca(*c)) + "\n" for c in CHATS)
    # Parquet: a messages column (a list of structs), as hub datasets store chats.
    pq.write_table(pa.Table.from_pylist([as_messages(*c) for c in CHATS]), paths["parquet"])
    # datasets' save_to_disk layout: Arrow IPC stream files listed in state.json.
    os.makedirs(paths["arrow"])
    table = pa.Table.from_pylist([as_sharegpt(*c) for c in CHATS])
    with pa.ipc.new_stream(os.path.join(paths["arrow"], "data-00000-of-00001.arrow"),
                           table.schema) as writer:
        writer.write_table(table)
    with open(os.path.join(paths["arrow"], "state.json"), "w") as fh:
        json.dump({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}, fh)
    # A hub cache entry: refs/main -> snapshot with train and test Parquet shards.
    snap = d / "hub" / "snapshots" / "abc123" / "data"
    os.makedirs(snap)
    os.makedirs(d / "hub" / "refs")
    (d / "hub" / "refs" / "main").write_text("abc123")
    rows = [as_messages(*c) for c in CHATS]
    pq.write_table(pa.Table.from_pylist(rows[:2]), str(snap / "train-00000-of-00002.parquet"))
    pq.write_table(pa.Table.from_pylist(rows[2:]), str(snap / "train-00001-of-00002.parquet"))
    pq.write_table(pa.Table.from_pylist(rows[:1]), str(snap / "test-00000-of-00001.parquet"))
    return paths


def same_dataset(a, b):
    pa_, pb = dataset_paths(a), dataset_paths(b)
    return all(filecmp.cmp(pa_[k], pb[k], shallow=False)
               for k in ("tokens_bin", "tokens_idx", "mask_bin", "mask_idx"))


def test_every_format_and_file_gives_identical_token_files(tmp_path, capsys):
    tok = make_template_tokenizer(str(tmp_path / "tok"), CHATML)
    paths = write_files(tmp_path)
    flags = ["--tokenizer-type", "HFTokenizer", "--tokenizer-model", tok, "--seq-length", "256"]
    for name, path in paths.items():
        assert main(["--input", path, "--output-prefix", str(tmp_path / f"out_{name}"),
                     *flags]) == 0
    out = capsys.readouterr().out
    assert out.count("written=3 ") == len(paths), out
    for name in paths:
        assert same_dataset(str(tmp_path / "out_jsonl"), str(tmp_path / f"out_{name}")), name
    # Several inputs are concatenated in order; an explicit --input-format must fit.
    assert main(["--input", paths["sharegpt"], paths["alpaca"], "--output-prefix",
                 str(tmp_path / "both"), *flags]) == 0
    assert len(SFTDataset(str(tmp_path / "both"))) == 6
    assert main(["--input", paths["sharegpt"], "--input-format", "sharegpt",
                 "--output-prefix", str(tmp_path / "named"), *flags]) == 0
    assert same_dataset(str(tmp_path / "out_jsonl"), str(tmp_path / "named"))


def test_alpaca_user_turn_is_instruction_blank_line_input():
    from megatron.skrull.formats import to_conversation

    conv = to_conversation({"instruction": "Sum", "input": "1 2", "output": "3"}, "alpaca", "x")
    assert conv.messages == [{"role": "user", "content": "Sum\n\n1 2"},
                             {"role": "assistant", "content": "3"}]
    conv = to_conversation({"instruction": "Hi", "input": "", "output": "yo"}, "alpaca", "x")
    assert conv.messages[0]["content"] == "Hi"


def tool_chat():
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    return [{"role": "user", "content": "1+2?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "3"},
            {"role": "assistant", "content": "It is 3."}]


def test_tool_calls_render_through_the_template_and_sharegpt_maps_to_them(tmp_path, capsys):
    from megatron.skrull.formats import plain_turns, to_conversation

    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    share = {"tools": json.dumps(tools), "conversations": [
        {"from": "human", "value": "1+2?"},
        {"from": "function_call", "value": '{"name": "add", "arguments": {"a": 1, "b": 2}}'},
        {"from": "observation", "value": "3"}, {"from": "gpt", "value": "It is 3."}]}
    conv = to_conversation(share, "sharegpt", "x")
    assert conv.messages == tool_chat() and conv.tools == tools
    tok = build_tokenizer("HFTokenizer", make_template_tokenizer(str(tmp_path / "t"),
                                                                 TOOL_TEMPLATE))
    tokens, mask = tokenize_conversation(tok, conv.messages, tools=conv.tools)
    assert tokens.tolist() == list(tok.hf.apply_chat_template(conv.messages, tools=tools,
                                                              tokenize=True, return_dict=True)
                                   ["input_ids"])
    trained = tok.decode(tokens[mask.astype(bool)].tolist())
    assert trained == ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
                       "</tool_call><|im_end|>It is 3.<|im_end|>")
    # Without a template: Hermes-style text under the role markers.
    assert plain_turns(conv.messages)[1:3] == [
        ("assistant", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
                      "</tool_call>"), ("user", "<tool_response>\n3\n</tool_response>")]
    # A template that cannot render tool calls is refused rather than dropping them.
    src = tmp_path / "tools.jsonl"
    src.write_text(json.dumps({"messages": tool_chat()}) + "\n")
    plain = make_template_tokenizer(str(tmp_path / "plain"), CHATML)
    rc = main(["--input", str(src), "--output-prefix", str(tmp_path / "x"), "--tokenizer-type",
               "HFTokenizer", "--tokenizer-model", plain])
    err = capsys.readouterr().err
    assert rc == 2 and "does not render 'tool_calls'" in err and len(err.splitlines()) == 1


def test_loss_on_choices():
    tok = ByteLevelTokenizer()
    msgs = as_messages("s", [("hi", "yo"), ("and", "ok")])["messages"]
    b = lambda t: list(t.encode())  # noqa: E731
    for loss_on, trained in (("assistant", b("yo") + [EOS] + b("ok") + [EOS]),
                             ("last-assistant", b("ok") + [EOS])):
        tokens, mask = tokenize_conversation(tok, msgs, loss_on=loss_on)
        assert tokens[mask.astype(bool)].tolist() == trained
    tokens, mask = tokenize_conversation(tok, msgs, loss_on="all")
    assert mask.all() and tokens[0] == BOS


def test_loss_on_with_a_template(tmp_path):
    from test_chat_template import CHATML_GEN

    for template in (CHATML, CHATML_GEN):
        tok = build_tokenizer("HFTokenizer", make_template_tokenizer(
            str(tmp_path / str(len(template))), template))
        msgs = as_messages("", [("hi", "yo"), ("and", "ok")])["messages"]
        tokens, mask = tokenize_conversation(tok, msgs, loss_on="last-assistant")
        assert tok.decode(tokens[mask.astype(bool)].tolist()) == "ok<|im_end|>"
        _, mask = tokenize_conversation(tok, msgs, loss_on="all")
        assert mask.all()


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "format"])
def test_a_record_that_fits_no_format_is_one_line_with_file_and_line(tmp_path, capsys, kind):
    good, bad = as_messages(*CHATS[0]), {"text": "no chat here"}
    if kind == "jsonl":
        path, line = tmp_path / "in.jsonl", 3
        path.write_text("\n".join(json.dumps(r) for r in (good, good, bad)) + "\n")
    elif kind == "json":  # a pretty-printed list: the line where the record starts
        path = tmp_path / "in.json"
        path.write_text(json.dumps([good, bad], indent=1))
        line = path.read_text().splitlines().index(' {', 2) + 1
    elif kind == "parquet":
        path, line = tmp_path / "in.parquet", 2
        pq.write_table(pa.Table.from_pylist([{"prompt": "a", "response": "b"},
                                             {"prompt": None, "response": None}]), str(path))
    else:  # an explicit --input-format that a record does not fit
        path, line = tmp_path / "in.jsonl", 2
        path.write_text(json.dumps(as_sharegpt(*CHATS[0])) + "\n" + json.dumps(good) + "\n")
    extra = ["--input-format", "sharegpt"] if kind == "format" else []
    rc = main(["--input", str(path), "--output-prefix", str(tmp_path / "out"), *extra])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{path}:{line}: record " in err, err
    assert sorted(os.listdir(tmp_path)) == [path.name]  # nothing written, no temporaries


def test_workers_are_byte_identical_with_progress_and_the_same_first_error(tmp_path, capsys):
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "東京", "🚀"]
    src = tmp_path / "big.jsonl"
    with open(src, "w") as fh:
        for i in range(3000):
            turns = [(" ".join(rng.choice(words, rng.integers(1, 30))),
                      " ".join(rng.choice(words, rng.integers(1, 60))))
                     for _ in range(int(rng.integers(1, 4)))]
            fh.write(json.dumps(as_sharegpt("", turns), ensure_ascii=False) + "\n")
    outs = {}
    for workers in ("1", "2"):
        assert main(["--input", str(src), "--output-prefix", str(tmp_path / f"w{workers}"),
                     "--workers", workers, "--log-interval", "1000"]) == 0
        outs[workers] = capsys.readouterr()
    paths = [dataset_paths(str(tmp_path / f"w{w}")) for w in ("1", "2")]
    assert all(filecmp.cmp(paths[0][k], paths[1][k], shallow=False) for k in paths[0])
    progress = outs["2"].err.splitlines()
    assert len(progress) == 4 and "3000 records in" in progress[-1], progress
    assert "records/s | ETA" in progress[0] and progress[0].startswith(
        "preprocess_sft.py: 1024 records (")
    with open(src, "a") as fh:  # a bad record at line 3001, after many good chunks
        fh.write('{"oops": 1}\n')
    for workers in ("1", "2"):
        rc = main(["--input", str(src), "--output-prefix", str(tmp_path / "bad"),
                   "--workers", workers, "--log-interval", "0"])
        err = capsys.readouterr().err
        assert rc == 2 and err.strip().endswith("fix the record or pass --input-format")
        assert f"{src}:3001: record fits no input format" in err
    assert not any(n.startswith("bad") for n in os.listdir(tmp_path))
