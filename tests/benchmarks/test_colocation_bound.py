"""benchmarks/colocation_bound.py: the premise of its bound (every exact plan moves at least 2 rows per extra
(key, rank) pair of its own assignment) and its pair count; the partitioner itself (KaHyPar) is not a test
dependency, and the benchmark says how to install it when it is missing."""

from __future__ import annotations

import builtins

import numpy as np
import pytest

from herald_torchrec.data.synthetic import SyntheticCTR, SyntheticSpec
from herald_torchrec.schedule import GlobalBatch, make_policy
from tests.helpers.benchmarks import load_benchmark


def load_bound():
    return load_benchmark("colocation_bound")


def test_key_pairs_counts_distinct_key_rank_pairs():
    mod = load_bound()
    keys = np.array([[0, 5], [0, 6], [1, 5], [0, 5]], dtype=np.int64)  # 4 samples, 2 tables (global ids)
    # ranks 0, 0, 1, 1: rank 0 reads {0, 5, 6}, rank 1 reads {0, 1, 5}
    assert mod.key_pairs(keys, np.array([0, 0, 1, 1]), 2) == 6
    assert mod.key_pairs(keys, np.array([0, 0, 0, 0]), 2) == 4  # every key once: no extra pair


@pytest.mark.parametrize("name", ["herald", "static", "p2res"])
def test_every_exact_plan_moves_two_rows_per_extra_pair_at_least(name):
    """The bound's premise, on the plans themselves: a key read by lambda ranks costs >= 2 (lambda - 1) rows."""
    mod = load_bound()
    R, B, L = 4, 16, 2
    gen = SyntheticCTR(SyntheticSpec(scale=0.0005, val_block=R * B))
    rows = list(gen.table_rows)
    offsets = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
    ids = [gen.train_samples(i * R * B, R * B).ids for i in range(8 + L)]
    pol = make_policy(name, rows, R, B, 0.1, L)
    for s in range(8):
        plan = pol.plan([GlobalBatch.from_dense(x, rows, index=s + j) for j, x in enumerate(ids[s : s + L + 1])])
        keys = ids[s] + offsets[None, :]
        extra = mod.key_pairs(keys, plan.assignment(), R) - np.unique(keys).shape[0]
        assert extra > 0
        assert plan.transmitted_rows() >= 2 * extra


def test_a_missing_partitioner_is_one_line(monkeypatch):
    mod = load_bound()
    real = builtins.__import__

    def no_kahypar(name, *args, **kwargs):
        if name == "kahypar":
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_kahypar)
    with pytest.raises(SystemExit, match="pip install kahypar"):
        mod.main(["--workers", "8"])
