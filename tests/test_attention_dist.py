"""DACP attention on 2 and 4 gloo ranks vs single-process causal attention (float64).

One spawn per world size runs every case (see ``tests/_attn_worker.py``); each case is
reported as its own test.
"""
import pytest

from _attn_worker import ALL_CASES, worker
from _spawn import spawn_and_collect

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cache = {}

    def get(world):
        if world not in cache:
            tmp = tmp_path_factory.mktemp(f"attn_world{world}")
            cache[world] = spawn_and_collect(worker, world, tmp, args=(ALL_CASES,))
        return cache[world]

    return get


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ALL_CASES)
def test_case(results, world, case):
    per_rank = results(world)
    failures = {r: res[case] for r, res in enumerate(per_rank) if res.get(case) != "ok"}
    assert not failures, "\n".join(f"rank {r}:\n{msg}" for r, msg in failures.items())
