"""Owner balancing (schedule/herald/balance.py): shared rows handed from an overloaded owner to its least loaded
readers, on a hand-made step (which rows, where to, the loads after) and on a trace whose hot rows all start on rank 0
(the busiest rank falls to near the mean, 0 stale reads, about the same rows); off for plain Herald (its plans
unchanged); the setting's validation. numpy only, fast."""

from __future__ import annotations

import numpy as np
import pytest

from herald_torchrec.schedule import GlobalBatch, make_policy
from herald_torchrec.schedule.herald.balance import OWNER_BALANCE, balance_owners, rank_loads
from herald_torchrec.schedule.traffic import host_traffic
from tests.schedule.test_policies import plan_signature, run


def csr(readers_per_key: list[list[int]]):
    """(count, start, pair_key, pair_rank) of a step's readers, sorted by key then rank."""
    count = np.array([len(r) for r in readers_per_key], dtype=np.int64)
    start = np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int64)
    pk = np.repeat(np.arange(len(readers_per_key)), count)
    pr = np.array([x for r in readers_per_key for x in sorted(r)], dtype=np.int64)
    return count, start, pk, pr


def test_an_overloaded_owner_hands_its_widest_rows_to_the_least_loaded_readers():
    # R=4. Rank 0 owns keys 0-2 and reads them; key 0 is read by every rank, key 1 by ranks 0, 1, 2, key 2 by 0, 3.
    # Key 3 (owned by 1) is read by 1 and 2; key 4 migrates 3 -> 2 (read by 2 alone).
    R = 4
    count, start, pk, pr = csr([[0, 1, 2, 3], [0, 1, 2], [0, 3], [1, 2], [2]])
    own = np.array([0, 0, 0, 1, 3])
    want = np.array([0, 0, 0, 1, 2])
    load = rank_loads(want, own, count, pk, pr, None, R)
    # rank 0 serves 3 + 2 + 1 remote reads (x 2); rank 1 makes 2 remote reads and serves 1; rank 2 makes 3 and
    # takes an arrival; rank 3 makes 2 and sends a departure
    np.testing.assert_array_equal(load, [12, 6, 7, 5])  # mean 7.5

    def balanced(factor):
        w = want.copy()
        moved = balance_owners(w, own, count, start, pk, pr, None, R, factor)
        return moved, w, rank_loads(w, own, count, pk, pr, None, R)

    # threshold 10.5: key 0 (3 remote readers, the widest) goes to its least loaded reader, rank 3 (5 + 5 <= 10.5);
    # rank 0 falls by 3 (it now reads key 0 remotely and sends the row) and is no longer over the threshold
    moved, w, after = balanced(1.4)
    assert moved == 1
    np.testing.assert_array_equal(w, [3, 0, 0, 1, 2])
    np.testing.assert_array_equal(after, [9, 6, 7, 10])
    assert after.sum() == load.sum() + 2  # one more row moved, counted at both ends
    # threshold 9.75: key 0 would overload rank 3 (10); key 1 goes to rank 1 (6 + 3); key 2 (one remote reader)
    # never moves: its owner would gain a row
    moved, w, after = balanced(1.3)
    assert moved == 1
    np.testing.assert_array_equal(w, [0, 1, 0, 1, 2])
    np.testing.assert_array_equal(after, [11, 9, 7, 5])
    # threshold 7.5: no reader can take a row without going over it
    moved, w, _ = balanced(1.0)
    assert moved == 0
    np.testing.assert_array_equal(w, want)


def test_skipped_rows_stay_and_count_for_no_load():
    # rank 0 owns key 0 (read by every rank) and keys 1-3 (each read by it and one other rank)
    R = 4
    count, start, pk, pr = csr([[0, 1, 2, 3], [0, 1], [0, 2], [0, 3]])
    own = want = np.zeros(4, dtype=np.int64)
    w = want.copy()
    assert balance_owners(w, own, count, start, pk, pr, None, R, factor=1.5) == 1  # loads [12, 4, 4, 4]
    np.testing.assert_array_equal(w, [1, 0, 0, 0])
    skip = np.array([True, False, False, False])  # key 0 replicated: loads [6, 2, 2, 2], only 1-reader rows left
    np.testing.assert_array_equal(rank_loads(want, own, count, pk, pr, skip, R), [6, 2, 2, 2])
    w = want.copy()
    assert balance_owners(w, own, count, start, pk, pr, skip, R, factor=1.5) == 0
    np.testing.assert_array_equal(w, want)


def hot_heads_trace(R: int, B: int, steps: int, seed: int = 0):
    """Three tables of 64 rows (homes: rank r holds rows 16 r .. 16 r + 15): every sample reads one of rows 0-3 of each
    (all on rank 0, read by most ranks every step) or, one time in two, a uniform row."""
    rng = np.random.default_rng(seed)
    rows = [64, 64, 64]
    out = []
    for _ in range(steps):
        hot = rng.integers(0, 4, (R * B, 3))
        cold = rng.integers(0, 64, (R * B, 3))
        ids = np.where(rng.random((R * B, 3)) < 0.5, hot, cold)
        out.append(GlobalBatch.from_dense(ids, rows))
    return rows, out


def busiest_over_mean(plans, warmup: int) -> float:
    return float(np.median([host_traffic(p, 1).balance() for p in plans[warmup:]]))


def test_balancing_spreads_the_hot_rows_of_rank_0():
    R, B = 8, 8
    rows, batches = hot_heads_trace(R, B, 24)
    plain, _ = run("herald", rows, batches, R, B, cache_ratio=0.25, tables="all", owner_balance=None)
    bal, chk = run("herald", rows, batches, R, B, cache_ratio=0.25, tables="all", owner_balance=1.1)
    assert chk.stale_reads == 0 and not chk.errors
    before, after = busiest_over_mean(plain, 4), busiest_over_mean(bal, 4)
    assert before > 1.4 and after < 1.2, (before, after)
    # the hot rows leave rank 0 once: about the same rows in all
    rows_plain = sum(p.transmitted_rows() for p in plain[4:])
    rows_bal = sum(p.transmitted_rows() for p in bal[4:])
    assert rows_bal <= 1.02 * rows_plain, (rows_bal, rows_plain)
    owners_of_heads = {int(o) for p in bal[4:] for o in p.shared.owner[p.shared.row < 4]}
    assert len(owners_of_heads) > 2


def test_on_by_default_and_off_on_request():
    R, B = 8, 8
    rows, batches = hot_heads_trace(R, B, 8)
    assert make_policy("herald", rows, R, B).owner_balance == OWNER_BALANCE  # on by default
    assert make_policy("herald", rows, R, B, hosts=4, replicate=True).owner_balance == OWNER_BALANCE
    assert make_policy("herald", rows, R, B, replicate=True, owner_balance=None).owner_balance is None
    plain, _ = run("herald", rows, batches, R, B, cache_ratio=0.25)
    off, _ = run("herald", rows, batches, R, B, cache_ratio=0.25, owner_balance=None)
    assert any(plan_signature(a) != plan_signature(b) for a, b in zip(plain, off))  # it hands rows on here


@pytest.mark.parametrize("value", [0.9, "on", True, -1])
def test_bad_owner_balance_is_named(value):
    with pytest.raises(ValueError, match="owner_balance"):
        make_policy("herald", [10, 20], 4, 2, owner_balance=value)
