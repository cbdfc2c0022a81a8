"""The ``python -m skrull_ext.plan`` contract: JSON shape, summary, exit code 2 on bad input."""
import json
import subprocess
import sys

import numpy as np
import pytest

from skrull_ext.scheduler.plan import Plan
from skrull_ext.plan import main


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_json_contract_and_summary(tmp_path, capsys):
    lengths = [300, 12000, 40, 900, 5000, 77, 2500, 31000]
    src = _write(tmp_path, "b.json", json.dumps(lengths))
    out = str(tmp_path / "plan.json")
    assert main(["--lengths", src, "--dp-size", "2", "--cp-size", "4", "--bucket-size", "9000",
                 "--json", out]) == 0
    obj = json.load(open(out))
    assert obj["config"]["dp_size"] == 2 and obj["config"]["cp_size"] == 4
    assert len(obj["dp_ranks"]) == 2
    m = obj["num_micro_batches"]
    seen = []
    for rank in obj["dp_ranks"]:
        assert len(rank["micro_batches"]) == m
        for mb in rank["micro_batches"]:
            assert len(mb["local"]) == 4
            seen += mb["distributed"] + [i for r in mb["local"] for i in r]
    assert sorted(seen) == list(range(len(lengths)))
    assert set(obj["predicted"]["speedup"]) == {"all-cp", "per-seq-cp"}
    Plan.from_json(obj).validate()  # round-trips through the plan type
    text = capsys.readouterr().out
    assert "predicted speedup over all-cp" in text and "tokens/cp-rank" in text
    assert obj["config"]["objective"] == "ring"  # the default
    # The paper's objective is accepted, planned with and recorded.
    assert main(["--lengths", src, "--dp-size", "2", "--cp-size", "4", "--bucket-size", "9000",
                 "--json", out, "--objective", "paper"]) == 0
    paper = json.load(open(out))
    assert paper["config"]["objective"] == "paper"
    Plan.from_json(paper).validate()


@pytest.mark.parametrize("content,name,needle", [
    ("[5, 0, 7]", "z.json", "element 1: length 0"),
    ("[5, -3]", "n.json", "element 1: length -3"),
    ("[]", "e.json", "no lengths"),
    ("[5, 2.5]", "f.json", "element 1 is 2.5"),
    ("5\nabc\n", "t.txt", "line 2: 'abc'"),
    ("[5, 100000]", "big.json", "sample 1 of length 100000 cannot fit"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, content, name, needle):
    src = _write(tmp_path, name, content)
    rc = main(["--lengths", src, "--dp-size", "1", "--cp-size", "2", "--bucket-size", "1000"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert needle in err and len(err.splitlines()) == 1


def test_bad_sizes_and_flags(tmp_path):
    src = _write(tmp_path, "b.txt", "10\n20\n")
    for argv, needle in ([["--dp-size", "0", "--cp-size", "2", "--bucket-size", "100"], "--dp-size"],
                         [["--dp-size", "1", "--cp-size", "2", "--bucket-size", "3"], "bucket"],
                         [["--dp-size", "1", "--cp-size", "x", "--bucket-size", "3"], "--cp-size"]):
        proc = subprocess.run([sys.executable, "-m", "skrull_ext.plan", "--lengths", src] + argv,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert needle in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_npy_input_and_every_policy(tmp_path, capsys):
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 3000, size=40)
    path = str(tmp_path / "l.npy")
    np.save(path, lengths)
    for policy in ("skrull", "per-seq-cp", "all-cp", "sorted", "hybrid-cp", "kk"):
        out = str(tmp_path / f"{policy}.json")
        assert main(["--lengths", path, "--dp-size", "2", "--cp-size", "4", "--bucket-size",
                     "2048", "--policy", policy, "--json", out, "--quiet"]) == 0
        plan = Plan.from_json(json.load(open(out)))
        plan.validate()
        assert plan.policy == policy
