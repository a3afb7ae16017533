"""Owner balancing (schedule/herald/balance.py): shared rows handed from an overloaded owner to its least loaded
readers, on a hand-made step (which rows, where to, the loads after) and on a trace whose hot rows all start on rank 0
(the busiest rank falls to near the mean, 0 stale reads, about the same rows); planned per host, each directory
host's heavy rows on its own ranks; on by default, off on request; the setting's validation. numpy only, fast."""

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


def test_rows_no_rank_could_take_go_to_the_directory_hosts_own_ranks():
    # R=8; the directory host's own ranks are 1 and 5 (= 1 mod 4). Keys 0 and 1 are read by every rank and owned by
    # rank 0; key 2 by ranks 0 and 4. Loads [30, 4, 4, 4, 6, 4, 4, 4]: mean 7.5, threshold 8.625 at 1.15; a key read
    # by 8 ranks costs a new owner 13 rows, more than the threshold minus the least load (4.625): no rank could take
    # it under the threshold, so it is heavy
    R = 8
    count, start, pk, pr = csr([list(range(8)), list(range(8)), [0, 4]])
    own = np.zeros(3, dtype=np.int64)
    heavy = np.arange(R) % 4 == 1
    np.testing.assert_array_equal(rank_loads(own, own, count, pk, pr, None, R), [30, 4, 4, 4, 6, 4, 4, 4])
    w = own.copy()
    # without heavy ranks neither heavy key moves: every reader would pass the threshold; key 2 (one remote reader)
    # never moves
    assert balance_owners(w, own, count, start, pk, pr, None, R, 1.15) == 0
    # with them: key 0 to rank 1 (both at 4, the lowest), key 1 to rank 5 (4 against rank 1's 17)
    assert balance_owners(w, own, count, start, pk, pr, None, R, 1.15, heavy) == 2
    np.testing.assert_array_equal(w, [1, 5, 0])
    np.testing.assert_array_equal(rank_loads(w, own, count, pk, pr, None, R), [8, 17, 4, 4, 6, 17, 4, 4])
    # a heavy row already on one of them stays there (no move back and forth between steps)
    own2 = np.array([1, 0, 0])
    w = own2.copy()
    assert balance_owners(w, own2, count, start, pk, pr, None, R, 1.15, heavy) == 1
    np.testing.assert_array_equal(w, [1, 5, 0])


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


def with_and_without(name: str, rows, batches, R: int, B: int, factor="auto", **kw):
    """Plans without owner balancing and with it (every plan checked, 0 stale reads): busiest rank / mean of each
    (median over the steps after 4), the rows ratio (with / without) and the balanced plans."""
    plain, _ = run(name, rows, batches, R, B, cache_ratio=0.25, tables="all", owner_balance=None, **kw)
    bal, chk = run(name, rows, batches, R, B, cache_ratio=0.25, tables="all", owner_balance=factor, **kw)
    assert chk.stale_reads == 0 and not chk.errors
    ratio = sum(p.transmitted_rows() for p in bal[4:]) / sum(p.transmitted_rows() for p in plain[4:])
    return busiest_over_mean(plain, 4), busiest_over_mean(bal, 4), ratio, bal


def tiny_heads_trace(R: int, B: int, steps: int, seed: int = 0):
    """Six tables of 8 rows, each sample reading one row of every one (homed on ranks 0-7, read by most ranks every
    step, as Criteo's tiny tables) and two Zipf-skewed tables of 4,096 rows."""
    rng = np.random.default_rng(seed)
    rows = [8] * 6 + [4096] * 2
    out = []
    for _ in range(steps):
        tiny = rng.integers(0, 8, (R * B, 6))
        big = np.minimum(rng.zipf(1.2, (R * B, 2)) - 1, 4095)
        out.append(GlobalBatch.from_dense(np.concatenate([tiny, big], 1), rows))
    return rows, out


def test_planned_per_host_each_directory_host_balances_its_rows():
    """herald_hier (4 hosts of 8): without owner balancing the ranks owning the tiny tables' rows move ~1.9x the mean
    rank's rows; each directory host balancing its own keys brings that down, exact (0 stale reads, every plan
    checked), for about the same rows."""
    R, P, B = 32, 8, 8
    rows, batches = tiny_heads_trace(R, B, 16)
    before, after, ratio, _ = with_and_without("herald_hier", rows, batches, R, B, hosts=P)
    assert before > 1.8 and after < 1.5, (before, after)
    assert ratio <= 1.02, ratio


def test_balancing_spreads_the_hot_rows_of_rank_0():
    R, B = 8, 8
    rows, batches = hot_heads_trace(R, B, 24)
    before, after, ratio, bal = with_and_without("herald", rows, batches, R, B, factor=1.1)
    assert before > 1.4 and after < 1.2, (before, after)
    assert ratio <= 1.02, ratio  # the hot rows leave rank 0 once: about the same rows in all
    owners_of_heads = {int(o) for p in bal[4:] for o in p.shared.owner[p.shared.row < 4]}
    assert len(owners_of_heads) > 2


def test_one_host_herald_hier_counts_plain_herald_s_handed_rows():
    """With one host herald_hier is plain herald: the same plans, and the rows its balancing handed on are herald's."""
    R, B = 8, 8
    rows, batches = hot_heads_trace(R, B, 10)
    pols = [
        make_policy(name, rows, R, B, 0.25, 2, tables="all", owner_balance=1.1) for name in ("herald", "herald_hier")
    ]
    for i in range(len(batches)):
        for pol in pols:
            pol.plan(batches[i : i + 3])
    assert pols[0].balanced > 0
    assert pols[1].balanced == pols[0].balanced


def test_on_by_default_and_off_on_request():
    R, B = 8, 8
    rows, batches = hot_heads_trace(R, B, 8)
    assert make_policy("herald", rows, R, B).owner_balance == OWNER_BALANCE  # on by default
    assert make_policy("herald", rows, R, B, hosts=4, replicate=True).owner_balance == OWNER_BALANCE
    assert make_policy("herald", rows, R, B, replicate=True, owner_balance=None).owner_balance is None
    assert make_policy("herald_hier", rows, R, B, hosts=4).owner_balance == OWNER_BALANCE
    assert make_policy("herald_hier", rows, R, B, hosts=4, owner_balance=None).owner_balance is None
    plain, _ = run("herald", rows, batches, R, B, cache_ratio=0.25)
    off, _ = run("herald", rows, batches, R, B, cache_ratio=0.25, owner_balance=None)
    assert any(plan_signature(a) != plan_signature(b) for a, b in zip(plain, off))  # it hands rows on here


@pytest.mark.parametrize("name", ["herald", "herald_hier"])
@pytest.mark.parametrize("value", [0.9, "on", True, -1])
def test_bad_owner_balance_is_named(name, value):
    with pytest.raises(ValueError, match="owner_balance"):
        make_policy(name, [10, 20], 4, 2, owner_balance=value, **({"hosts": 2} if name == "herald_hier" else {}))
